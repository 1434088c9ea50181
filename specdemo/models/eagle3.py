"""EAGLE-3 draft heads in the checkpoint format vLLM and SGLang load: config, module, save and load (the drafter is
specdemo.drafters.eagle3.Eagle3Drafter).

The format is vLLM 0.32's vllm/model_executor/models/llama_eagle3.py (Eagle3LlamaForCausalLM) checked against
SGLang's python/sglang/srt/models/llama_eagle3.py (LlamaForCausalLMEagle3); docs/eagle3.md lists each name and default.
Over 400 lines on purpose: the config's keys, the module's parameter names and the files' layout are one contract
with those engines, and a change to one is a change to all three.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..config import Runtime
from . import speculators
from .loading import hub_folder
from .placement import weight_of

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")  # SGLang's name, vLLM's name
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
META_FILE = "specdemo.json"  # our extras (training metrics, k); engines ignore it
SPEC_FILE = "speculative_config.json"  # written by `python -m specdemo export`; its k is the head's recorded k
# config.json flags of variants this module does not implement (each changes the computation when true)
UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output", "attention_bias", "mlp_bias", "bias",
                     "parallel_drafting")


class Eagle3FormatError(ValueError):
    """A checkpoint is not an EAGLE-3 head this module can run, or not one for the given target."""


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """vLLM's SupportsEagle3 default (and SGLang's): (2, L // 2, L - 3)."""
    return (2, num_target_layers // 2, num_target_layers - 3)


@dataclass(frozen=True)
class Eagle3Config:
    """The head's config.json. vocab_size and target_hidden_size are the target's; aux_layer_ids None means the
    engines' default for the target. Ids index HF's output_hidden_states (vLLM: hidden + residual before layer i)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict | None = None
    aux_layer_ids: tuple[int, ...] | None = None
    norm_before_residual: bool = False
    architecture: str = ARCHITECTURES[0]
    extra: dict = field(default_factory=dict, compare=False)  # other config.json keys, written back unchanged

    def __post_init__(self):
        if self.aux_layer_ids is not None:
            object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))

    @property
    def num_aux(self) -> int:
        """How many target hidden states `fc` reads (vLLM: len(ids), else 3)."""
        return len(self.aux_layer_ids) if self.aux_layer_ids else 3

    def resolve_aux(self, num_target_layers: int) -> tuple[int, ...]:
        """The target layers read, sorted as vLLM captures them; refuses ids the target does not have."""
        ids = self.aux_layer_ids or default_aux_layer_ids(num_target_layers)
        resolved = tuple(sorted(set(ids)))
        if len(resolved) != self.num_aux or not all(0 <= i < num_target_layers for i in resolved):
            source = "its eagle_aux_hidden_state_layer_ids" if self.aux_layer_ids else "the default (2, L//2, L-3)"
            raise Eagle3FormatError(
                f"the head reads target hidden states {list(ids)} ({source}), but a target with {num_target_layers} "
                f"layers has {self.num_aux} distinct ones only among 0..{num_target_layers - 1}: it is for another "
                f"target")
        return resolved

    @classmethod
    def for_target(cls, target_config, draft_vocab_size: int, aux_layer_ids: tuple[int, ...] | None = None,
                   norm_before_residual: bool = False) -> Eagle3Config:
        """A head shaped like one decoder layer of the target (HF config), over the given draft vocabulary size."""
        rope = dict(getattr(target_config, "rope_parameters", None) or {})
        theta = float(rope.pop("rope_theta", getattr(target_config, "rope_theta", 10000.0)))
        scaling = rope if rope.get("rope_type", "default") != "default" else None
        num_layers = target_config.num_hidden_layers
        if aux_layer_ids is not None and tuple(sorted(set(aux_layer_ids))) == default_aux_layer_ids(num_layers):
            aux_layer_ids = None  # the engines' default: written as no ids, which vLLM and SGLang read the same
        h = target_config.hidden_size
        c = cls(h, target_config.intermediate_size, target_config.num_attention_heads,
                target_config.num_key_value_heads,
                getattr(target_config, "head_dim", None) or h // target_config.num_attention_heads,
                float(target_config.rms_norm_eps), target_config.vocab_size, draft_vocab_size, h,
                target_config.max_position_embeddings, theta, scaling, aux_layer_ids, norm_before_residual)
        c.resolve_aux(num_layers)
        return c

    @classmethod
    def from_json(cls, d: dict) -> Eagle3Config:
        """Parse a config.json; raises Eagle3FormatError for anything but a one-layer llama EAGLE-3 head."""
        arch = next((a for a in d.get("architectures") or [] if a in ARCHITECTURES), None)
        if arch is None:
            raise Eagle3FormatError(f"not an EAGLE-3 head: architectures {d.get('architectures')} names none of "
                                    f"{', '.join(ARCHITECTURES)}")
        eagle = d.get("eagle_config") or {}
        problems = [f"{k}: true" for k in UNSUPPORTED_FLAGS if d.get(k) or eagle.get(k)]
        if d.get("num_hidden_layers", 1) != 1:
            problems.append(f"num_hidden_layers {d['num_hidden_layers']} (only one-layer heads are supported)")
        if not eagle.get("use_aux_hidden_state", True):
            problems.append("use_aux_hidden_state: false (an EAGLE-1 style head)")
        if d.get("hidden_act", "silu") != "silu":
            problems.append(f"hidden_act {d['hidden_act']}")
        if problems:
            raise Eagle3FormatError("unsupported EAGLE-3 variant: " + "; ".join(problems))
        rope = dict(d.get("rope_parameters") or {})
        theta = float(d.get("rope_theta") or rope.pop("rope_theta", 10000.0))
        rope.pop("rope_theta", None)
        scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        ids = d.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
        h = d["hidden_size"]
        known = set(cls.__dataclass_fields__) | {"architectures", "eagle_config", "rope_parameters",
                                                  "eagle_aux_hidden_state_layer_ids", "num_hidden_layers"}
        return cls(h, d["intermediate_size"], d["num_attention_heads"], d.get("num_key_value_heads") or
                   d["num_attention_heads"], d.get("head_dim") or h // d["num_attention_heads"],
                   float(d.get("rms_norm_eps", 1e-6)), d["vocab_size"], d.get("draft_vocab_size") or d["vocab_size"],
                   d.get("target_hidden_size") or h, d.get("max_position_embeddings", 2048), theta, scaling,
                   tuple(ids) if ids else None, bool(d.get("norm_before_residual", False)), arch,
                   {k: v for k, v in d.items() if k not in known})

    def to_json(self, dtype: torch.dtype = torch.float16) -> dict:
        """The checkpoint's config.json (tie_word_embeddings false: SGLang would tie lm_head to embed_tokens)."""
        eagle = {"use_aux_hidden_state": True}
        if self.aux_layer_ids:
            eagle["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layer_ids)
        return {**self.extra, "architectures": [self.architecture], "model_type": "llama",
                "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
                "head_dim": self.head_dim, "num_hidden_layers": 1, "hidden_act": "silu",
                "rms_norm_eps": self.rms_norm_eps, "vocab_size": self.vocab_size,
                "draft_vocab_size": self.draft_vocab_size, "target_hidden_size": self.target_hidden_size,
                "max_position_embeddings": self.max_position_embeddings, "rope_theta": self.rope_theta,
                "rope_scaling": self.rope_scaling, "tie_word_embeddings": False, "attention_bias": False,
                "mlp_bias": False, "norm_before_residual": self.norm_before_residual, "eagle_config": eagle,
                "torch_dtype": str(dtype).removeprefix("torch.")}


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
                scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (T, D) for integer positions (T,); `scale` is the rope type's attention scaling (1 for the default)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           past_k: torch.Tensor | None, past_v: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor:
    """Grouped attention of q (B, NH, T, D) over past keys (B, KV, L, D) and the new k, v (B, KV, T, D), RoPE applied
    here; `mask` (T, L+T) bool, or None for causal aligned to the end. Returns (B, T, NH * D) and the rotated k."""
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    keys = k if past_k is None else torch.cat([past_k, k], dim=2)
    values = v if past_v is None else torch.cat([past_v, v], dim=2)
    t = q.shape[2]
    if mask is None and t > 1:  # causal, aligned to the end when there is a past
        past = keys.shape[2] - t
        mask = torch.ones(t, past + t, dtype=torch.bool, device=q.device).tril(diagonal=past)
    att = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)  # (B, NH, T, D)
    return att.transpose(1, 2).reshape(q.shape[0], t, -1), k


class Attention(nn.Module):
    """Llama GQA attention whose q, k, v read `width` features (2H in the EAGLE-3 layer: embeddings ++ hidden)."""

    def __init__(self, c: Eagle3Config, width: int):
        super().__init__()
        self.c = c
        d = c.head_dim
        self.q_proj = nn.Linear(width, c.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(width, c.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(width, c.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * d, c.hidden_size, bias=False)

    def forward(self, x, cos, sin, past_k=None, past_v=None, mask=None):
        """x (B, T, W) -> (out (B, T, H), new k (B, KV, T, D), new v)."""
        b, t, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)  # (B, NH, T, D)
        k = self.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)  # (B, KV, T, D)
        v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        att, k = attend(q, k, v, cos, sin, past_k, past_v, mask)
        return self.o_proj(att), k, v


class MLP(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    """vLLM's layer 0 (the checkpoint's `midlayer`): input_layernorm on the embeddings, hidden_norm on the hidden
    state, attention over their concatenation, residual from the hidden state (normed first under
    norm_before_residual). Returns the pre-norm output: vLLM and SGLang feed it back as the next step's hidden."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.c = c
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, 2 * c.hidden_size)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, embeds, hidden, cos, sin, past_k=None, past_v=None, mask=None):
        normed = self.hidden_norm(hidden)
        residual = normed if self.c.norm_before_residual else hidden
        att, k, v = self.self_attn(torch.cat([self.input_layernorm(embeds), normed], dim=-1), cos, sin,
                                   past_k, past_v, mask)
        residual = residual + att
        return residual + self.mlp(self.post_attention_layernorm(residual)), k, v


def _rope_frequencies(c: Eagle3Config) -> tuple[torch.Tensor, float]:
    """inv_freq (D/2,) and the attention scaling of the head's rope; scaled types (llama3, yarn, ...) through
    transformers' own rope initialisers, so they match the target's."""
    scaling = c.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim)), 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(**{k: v for k, v in c.to_json().items() if k not in ("architectures", "torch_dtype")})
    inv, scale = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv.float(), float(scale)


class Eagle3Head(nn.Module):
    """fc(aux hidden states) -> midlayer(embed(token), hidden) -> norm -> lm_head over the draft vocabulary.

    Parameter names are the checkpoint's: fc, midlayer.*, norm, lm_head, d2t (draft id -> target id offset) and
    embed_tokens when the head has its own; otherwise the target's embeddings are borrowed, frozen, and not saved.
    `aux_layer_ids` are the target layers it reads, resolved for its target.
    """

    def __init__(self, c: Eagle3Config, aux_layer_ids: tuple[int, ...], target_embed: torch.Tensor | None = None):
        super().__init__()
        if len(aux_layer_ids) != c.num_aux:
            raise Eagle3FormatError(f"fc reads {c.num_aux} target hidden states but {len(aux_layer_ids)} ids given")
        self.c = c
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.fc = nn.Linear(c.num_aux * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.own_embed = target_embed is None
        if self.own_embed:
            self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        else:
            if tuple(target_embed.shape) != (c.vocab_size, c.hidden_size):
                raise Eagle3FormatError(f"the target's embeddings are {tuple(target_embed.shape)}, the head needs "
                                        f"({c.vocab_size}, {c.hidden_size}): it has none of its own to use instead")
            self.register_buffer("target_embed", target_embed.detach(), persistent=False)
        inv, self.rope_scale = _rope_frequencies(c)
        self.register_buffer("inv_freq", inv, persistent=False)

    @property
    def target_layers(self) -> tuple[int, ...]:
        """The target layers whose hidden states the engine passes after the final one (see prepare)."""
        return self.aux_layer_ids

    @property
    def subset(self) -> torch.Tensor:
        """(draft_vocab,) the target id of each draft id: draft_id + d2t[draft_id] (vLLM's compute_logits)."""
        return torch.arange(self.c.draft_vocab_size, device=self.d2t.device) + self.d2t

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens) if self.own_embed else self.target_embed[tokens]

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """(..., n_aux * target_hidden) target hidden states, in aux_layer_ids order -> (..., H) (vLLM's
        combine_hidden_states)."""
        return self.fc(aux)

    def prepare(self, features: torch.Tensor) -> torch.Tensor:
        """The engine's features (the final hidden state, then the aux layers': engine.target_features) -> (..., H)."""
        return self.combine(features[..., self.c.target_hidden_size:])

    def forward(self, hidden, tokens, positions, past_k=None, past_v=None, mask=None):
        """hidden (B, T, H), tokens (B, T) = the token after each hidden state's position, positions (T,)
        -> (the pre-norm output (B, T, H) the next step reads back, new k, new v)."""
        cos, sin = rope_tables(positions, self.inv_freq, hidden.dtype, self.rope_scale)
        return self.midlayer(self.embed(tokens).to(hidden.dtype), hidden, cos, sin, past_k, past_v, mask)

    def logits(self, hidden_out: torch.Tensor) -> torch.Tensor:
        """(..., H) pre-norm outputs -> (..., draft_vocab) logits."""
        return self.lm_head(self.norm(hidden_out))

    def unrolled(self, aux: torch.Tensor, tokens: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """Training-time test: `depth` draft steps from every position at once, exactly as the drafter runs them.

        aux (B, T, n_aux * target_hidden), tokens (B, T + depth) with tokens[:, i + 1] following position i. Row i of
        step d is the chain that started from the true state at i; it sits at position i + d - 1, sees the true
        entries at positions <= i and its own chain's earlier steps. Returns `depth` pre-norm outputs (B, T, H)."""
        return unroll(self, self.combine(aux), tokens, depth)


def unroll(head: nn.Module, feat: torch.Tensor, tokens: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """The training-time test loop: `head(feat, tokens, positions, past_k, past_v, mask)` from every position at
    once, `depth` times, each step reading the last one's outputs (see Eagle3Head.unrolled)."""
    t = feat.shape[1]
    pos = torch.arange(t, device=feat.device)
    causal = torch.ones(t, t, dtype=torch.bool, device=feat.device).tril()
    eye = torch.eye(t, dtype=torch.bool, device=feat.device)
    outs, past_k, past_v = [], None, None
    for d in range(1, depth + 1):
        mask = causal if d == 1 else torch.cat([causal] + [eye] * (d - 1), dim=1)
        feat, k, v = head(feat, tokens[:, d : d + t], pos + d - 1, past_k, past_v, mask)
        past_k = k if past_k is None else torch.cat([past_k, k], dim=2)
        past_v = v if past_v is None else torch.cat([past_v, v], dim=2)
        outs.append(feat)
    return outs


def build_head(target_model: nn.Module, draft_vocab: torch.Tensor, aux_layer_ids: tuple[int, ...] | None = None,
               norm_before_residual: bool = False) -> Eagle3Head:
    """A fresh head for a target (HF causal LM) on its device and dtype; draft_vocab (S,) holds the target ids of the
    draft vocabulary in draft-id order (d2t = draft_vocab - arange). The lm_head starts as the target's rows (under a
    device map, read back from any offload)."""
    c = Eagle3Config.for_target(target_model.config, len(draft_vocab), aux_layer_ids, norm_before_residual)
    embed = weight_of(target_model.get_input_embeddings())
    head = Eagle3Head(c, c.resolve_aux(target_model.config.num_hidden_layers), embed)
    draft_vocab = draft_vocab.long().to(embed.device)
    with torch.no_grad():
        head.d2t.copy_(draft_vocab - torch.arange(len(draft_vocab), device=embed.device))
        out = weight_of(target_model.get_output_embeddings())
        head.lm_head.weight.copy_(out[draft_vocab.to(out.device)])
    _check_d2t(head)
    return head.to(device=embed.device, dtype=embed.dtype)


def _check_d2t(head: Eagle3Head) -> None:
    ids = head.subset
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= head.c.vocab_size or len(ids.unique()) != len(ids)):
        raise Eagle3FormatError("d2t maps draft ids outside the target vocabulary or two draft ids to one target id")


def save_eagle3(head: Eagle3Head, path: str | Path, meta: dict | None = None,
                dtype: torch.dtype = torch.float16) -> None:
    """config.json + model.safetensors that vLLM and SGLang load unchanged (d2t int64, t2d bool as EAGLE's own
    checkpoints ship it; borrowed embeddings are not saved), and `meta` in specdemo.json."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.long() if k == "d2t" else v.detach().to(dtype)).contiguous().cpu()
               for k, v in head.state_dict().items()}
    t2d = torch.zeros(head.c.vocab_size, dtype=torch.bool)
    t2d[head.subset.cpu()] = True
    save_file({**tensors, "t2d": t2d}, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    (path / CONFIG_FILE).write_text(json.dumps(head.c.to_json(dtype), indent=2) + "\n")
    if meta:
        (path / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def read_config(folder: str | Path) -> dict | None:
    """config.json of a folder (a speculators-format head's as the raw EAGLE-3 one), or None when it has none (or it
    is not JSON)."""
    try:
        config = json.loads((Path(folder) / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return None
    return speculators.to_raw(config) if speculators.is_speculators_eagle3(config) else config


def is_eagle3(spec_or_config: str | Path | dict | None) -> bool:
    """Whether a config dict, or a folder's config.json, names an EAGLE-3 architecture (never guessed from a name)."""
    config = spec_or_config if isinstance(spec_or_config, dict) else (
        read_config(spec_or_config) if spec_or_config else None)
    if speculators.is_speculators_eagle3(config):
        return True
    return bool(config) and any(a in ARCHITECTURES for a in config.get("architectures") or [])


def not_a_draft(draft: str, why: str) -> str:
    """What a draft that is neither an EAGLE-3 head nor a causal LM is told (`why`: what the folder lacks)."""
    return (f"'{draft}' is not an EAGLE-3 head (a config.json with architectures {' or '.join(ARCHITECTURES)}) nor a "
            f"causal LM: {why}")


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if files:  # a speculators-format head names its layer layers.0., ours midlayer.
        return speculators.to_raw_tensors({k: v for f in files for k, v in load_file(str(f)).items()})
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if bins:
        return {k: v for f in bins for k, v in torch.load(f, map_location="cpu", weights_only=True).items()}
    raise Eagle3FormatError(f"{folder} has a config.json but no model.safetensors (or pytorch_model.bin)")


def recorded_k(folder: str | Path) -> int | None:
    """The head's own k: num_speculative_tokens in its speculative_config.json (export writes it), else in
    specdemo.json; None if neither (the EAGLE-3 config.json has no such field)."""
    for name in (SPEC_FILE, META_FILE):
        try:
            k = json.loads((Path(folder) / name).read_text()).get("num_speculative_tokens")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(k, int) and k > 0:
            return k
    try:  # a speculators-format head records its k in its config.json
        return speculators.recorded_k(json.loads((Path(folder) / CONFIG_FILE).read_text()))
    except (OSError, ValueError):
        return None


def load_head(folder: str | Path, target_model: nn.Module) -> tuple[Eagle3Head, dict]:
    """An Eagle3Head from a checkpoint folder, checked against the target (HF causal LM); also specdemo.json's meta."""
    folder = Path(folder)
    config = read_config(folder)
    if config is None:
        raise Eagle3FormatError(f"{folder} has no config.json")
    c = Eagle3Config.from_json(config)
    tc = target_model.config
    if c.vocab_size != tc.vocab_size or c.target_hidden_size != tc.hidden_size:
        raise Eagle3FormatError(
            f"the EAGLE-3 head in {folder} is for another target: it expects vocab_size {c.vocab_size} and hidden "
            f"size {c.target_hidden_size}, but the target has vocab_size {tc.vocab_size} and hidden size "
            f"{tc.hidden_size}")
    aux = c.resolve_aux(tc.num_hidden_layers)
    tensors = read_weights(folder)
    tensors.pop("t2d", None)
    own = "embed_tokens.weight" in tensors
    embed = None if own else weight_of(target_model.get_input_embeddings())
    head = Eagle3Head(c, aux, embed)
    if "d2t" not in tensors:
        if c.draft_vocab_size != c.vocab_size:
            raise Eagle3FormatError(f"{folder}: draft_vocab_size {c.draft_vocab_size} < vocab_size {c.vocab_size} "
                                    f"but the checkpoint has no d2t mapping")
        tensors["d2t"] = torch.zeros(c.draft_vocab_size, dtype=torch.long)
    if "lm_head.weight" not in tensors and c.draft_vocab_size == c.vocab_size:  # vLLM shares the target's then
        tensors["lm_head.weight"] = weight_of(target_model.get_output_embeddings()).detach().cpu()
    missing, unexpected = head.load_state_dict({k: v for k, v in tensors.items()}, strict=False)
    if missing or unexpected:
        raise Eagle3FormatError(f"{folder}: the weights do not match the EAGLE-3 layout (missing {missing}, "
                                f"unexpected {unexpected})")
    ref = weight_of(target_model.get_input_embeddings())
    head = head.to(device=ref.device, dtype=ref.dtype)
    _check_d2t(head)
    try:
        meta = json.loads((folder / META_FILE).read_text())
    except (OSError, ValueError):
        meta = {}
    return head.eval(), meta


HUB_PATTERNS = ("config.json", "*.safetensors", "pytorch_model*.bin", SPEC_FILE, META_FILE)


def locate_eagle3(spec: str, runtime: Runtime = Runtime()) -> Path | None:
    """The local folder of the EAGLE-3 head `spec` names (a folder, or a hub id whose config.json says so; its
    weights are downloaded once), or None when it is not one (or the hub is unreachable: the caller's usual loading
    then says so)."""
    if Path(spec).is_dir():
        return Path(spec) if is_eagle3(Path(spec)) else None
    return hub_folder(spec, is_eagle3, HUB_PATTERNS, runtime)


def eagle3_export(path: str | Path | None) -> bool:
    """A folder holding an EAGLE-3 checkpoint vLLM can load: `python -m specdemo export` writes speculative_config.json
    beside it; a checkpoint from elsewhere names an Eagle3 architecture in config.json."""
    if not path or not Path(path).is_dir():
        return False
    folder = Path(path)
    for name, key in (("speculative_config.json", "method"), ("config.json", "architectures")):
        try:
            value = json.loads((folder / name).read_text()).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if "eagle3" in json.dumps(value).lower():
            return True
    return False
