"""The EAGLE-3 head as a torch module (Eagle3Head: fc, midlayer, norm, lm_head, d2t under the checkpoint's parameter
names), built fresh for a target or loaded from a checkpoint folder; models.eagle3 holds its config and files.

Its computation is vLLM 0.32's Eagle3LlamaForCausalLM (one decoder layer over the embedding and the combined target
hidden states), checked against SGLang's LlamaForCausalLMEagle3; the training-time unroll runs the same layer.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .eagle3 import META_FILE, Eagle3Config, Eagle3FormatError, read_config, read_weights
from .placement import weight_of


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
    """cos, sin (..., D) for integer positions (...,): (T,) or each row's (B, T); `scale` is the rope type's attention
    scaling (1 for the default)."""
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           past_k: torch.Tensor | None, past_v: torch.Tensor | None, mask: torch.Tensor | None,
           write: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped attention of q (B, NH, T, D) over past keys (B, KV, L, D) and the new k, v (B, KV, T, D), RoPE applied
    here; `mask` (T, L+T) bool, or None for causal aligned to the end. Returns (B, T, NH * D) and the rotated k.

    With `write` (B, T), past_k and past_v are static buffers (B, KV, capacity, D): the new entries are written into
    them at those slots, in place, and attention reads the whole buffers under `mask` (B, 1, T, capacity)."""
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    if write is not None:
        index = write[:, None, :, None].expand_as(k)  # (B, KV, T, D): row r's j-th entry goes to slot write[r, j]
        keys, values = past_k.scatter_(2, index, k), past_v.scatter_(2, index, v)
    else:
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

    def forward(self, x, cos, sin, past_k=None, past_v=None, mask=None, write=None):
        """x (B, T, W) -> (out (B, T, H), new k (B, KV, T, D), new v); `write`: see attend."""
        b, t, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)  # (B, NH, T, D)
        k = self.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)  # (B, KV, T, D)
        v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        att, k = attend(q, k, v, cos, sin, past_k, past_v, mask, write)
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

    def forward(self, embeds, hidden, cos, sin, past_k=None, past_v=None, mask=None, write=None):
        normed = self.hidden_norm(hidden)
        residual = normed if self.c.norm_before_residual else hidden
        att, k, v = self.self_attn(torch.cat([self.input_layernorm(embeds), normed], dim=-1), cos, sin,
                                   past_k, past_v, mask, write)
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

    def spread(self, q: torch.Tensor) -> torch.Tensor:
        """(..., draft_vocab) draft probabilities -> (..., target vocab), zero outside the draft vocabulary (where
        rejection sampling then never accepts and always leaves the target's mass)."""
        return q.new_zeros(*q.shape[:-1], self.c.vocab_size).index_copy_(-1, self.subset, q)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens) if self.own_embed else self.target_embed[tokens]

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """(..., n_aux * target_hidden) target hidden states, in aux_layer_ids order -> (..., H) (vLLM's
        combine_hidden_states)."""
        return self.fc(aux)

    def prepare(self, features: torch.Tensor) -> torch.Tensor:
        """The engine's features (the final hidden state, then the aux layers': engine.kv.target_features) ->
        (..., H)."""
        return self.combine(features[..., self.c.target_hidden_size:])

    def forward(self, hidden, tokens, positions, past_k=None, past_v=None, mask=None, write=None):
        """hidden (B, T, H), tokens (B, T) = the token after each hidden state's position, positions (T,) or each
        row's (B, T) -> (the pre-norm output (B, T, H) the next step reads back, new k, new v); `write`: see attend."""
        cos, sin = rope_tables(positions, self.inv_freq, hidden.dtype, self.rope_scale)
        if positions.dim() == 2:  # (B, T, D) -> (B, 1, T, D), broadcast over heads
            cos, sin = cos[:, None], sin[:, None]
        return self.midlayer(self.embed(tokens).to(hidden.dtype), hidden, cos, sin, past_k, past_v, mask, write)

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
