"""An EAGLE-style draft head: one llama decoder layer that reads the target's final hidden states and predicts the next.

Tokens come from the target's own output head restricted to a frequent-token subset (FR-Spec), so the draft's q is
zero outside the subset and rejection sampling stays exact. The target's embeddings and head are borrowed, frozen and
never saved; the asset holds only the layer, the input projection and the subset ids. Training lives in specdemo/distill.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .drafters import Drafter, DraftRequest, Proposal, Verdict
from .placement import module_device, weight_of
from .verify import generator_on, logits_to_probs

CONFIG_FILE = "eagle_config.json"
WEIGHTS_FILE = "eagle.safetensors"


@dataclass(frozen=True)
class EagleConfig:
    """Shapes of the head; copied from the target's config except the subset size."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    vocab_size: int
    subset_size: int
    fuse_layers: tuple[int, ...] = ()  # extra target layers read beside the final features (EAGLE-3 fusion)
    num_layers: int = 1  # decoder layers in the head

    def __post_init__(self):
        object.__setattr__(self, "fuse_layers", tuple(int(i) for i in self.fuse_layers))

    @property
    def feature_width(self) -> int:
        """Width of the target features the head reads: the final hidden state, then each fused layer's."""
        return self.hidden_size * (1 + len(self.fuse_layers))

    @classmethod
    def from_target(cls, config, subset_size: int, fuse_layers: tuple[int, ...] = (), num_layers: int = 1) -> EagleConfig:
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.hidden_size, config.intermediate_size, config.num_attention_heads,
                   config.num_key_value_heads, head_dim, float(theta), float(config.rms_norm_eps),
                   config.vocab_size, subset_size, fuse_layers, num_layers)


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


class DecoderLayer(nn.Module):
    """A llama decoder layer (GQA attention with RoPE, SwiGLU MLP) that returns its new keys and values."""

    def __init__(self, c: EagleConfig):
        super().__init__()
        self.c = c
        h, d = c.hidden_size, c.head_dim
        self.input_norm = RMSNorm(h, c.rms_norm_eps)
        self.q_proj = nn.Linear(h, c.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, c.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, c.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(c.num_heads * d, h, bias=False)
        self.post_norm = RMSNorm(h, c.rms_norm_eps)
        self.gate_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, h, bias=False)
        self.dropout = 0.0  # training only (distill --dropout): on the attention and MLP outputs; eval() turns it off

    def forward(self, x, cos, sin, past_k=None, past_v=None, mask=None):
        """x (B, T, H) attends to past keys (B, KV, L, D) and its own under `mask` (T, L+T) bool or None (causal)."""
        b, t, _ = x.shape
        c = self.c
        y = self.input_norm(x)
        q = self.q_proj(y).view(b, t, c.num_heads, c.head_dim).transpose(1, 2)  # (B, NH, T, D)
        k = self.k_proj(y).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)  # (B, KV, T, D)
        v = self.v_proj(y).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        att, k = attend(q, k, v, cos, sin, past_k, past_v, mask)
        x = x + F.dropout(self.o_proj(att), self.dropout, self.training)
        y = self.post_norm(x)
        x = x + F.dropout(self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y)), self.dropout, self.training)
        return x, k, v


class EagleHead(nn.Module):
    """feature_t ++ embed(token_{t+1}) -> Linear(2H, H) -> decoder layer -> norm = predicted feature_{t+1}.

    `embed` (V, H) and `head` (V, H) are the target's frozen matrices (not saved); `subset` (S,) holds target ids.
    With `fuse_layers` (EAGLE-3), a true target feature is the final hidden state followed by those layers' hidden
    states, and `prepare` mixes them into H with a Linear that starts as "take the final one"; the head's own
    predictions (drafting steps after the first) are already H wide.
    """

    fast_linear = True  # the output head's product through specdemo.kernels on a float32 CPU (off: F.linear)
    input_scale = None  # distill.training's feature noise is in the features' own units

    def __init__(self, c: EagleConfig, embed: torch.Tensor, head: torch.Tensor, subset: torch.Tensor):
        super().__init__()
        self.c = c
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.fuse = None
        if c.fuse_layers:  # inner layers' residual streams are unnormalised (SmolLM2: up to 2e4), so each gets a norm
            self.fuse_norms = nn.ModuleList(RMSNorm(c.hidden_size, c.rms_norm_eps) for _ in c.fuse_layers)
            self.fuse = nn.Linear(c.feature_width, c.hidden_size, bias=False)
            with torch.no_grad():
                self.fuse.weight.zero_()
                self.fuse.weight[:, : c.hidden_size].copy_(torch.eye(c.hidden_size))
        self.layer = DecoderLayer(c)
        # layers after the first (none in a 1-layer head, whose weights keep their names); their keys and values
        # follow the first layer's along the head dimension, so a cache is one tensor pair at any depth
        self.more_layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_layers - 1))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.register_buffer("subset", subset.long(), persistent=True)
        self.register_buffer("embed", embed.detach(), persistent=False)
        self.register_buffer("head_weight", head.detach()[subset.to(head.device)].clone(), persistent=False)
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (T, D) for integer positions (T,)."""
        return rope_tables(positions, self.inv_freq, dtype)

    @property
    def target_layers(self) -> tuple[int, ...]:
        """The target layers whose hidden states the engine passes after the final one."""
        return self.c.fuse_layers

    def prepare(self, features: torch.Tensor) -> torch.Tensor:
        """True target features (..., feature_width) -> head input (..., H)."""
        if self.fuse is None:
            return features
        final, *inner = features.split(self.c.hidden_size, dim=-1)
        return self.fuse(torch.cat([final] + [norm(x) for norm, x in zip(self.fuse_norms, inner)], dim=-1))

    def forward(self, features, tokens, positions, past_k=None, past_v=None, mask=None):
        """features (B, T, H), tokens (B, T) = the token after each feature's position -> (feature (B, T, H), k, v)."""
        x = self.fc(torch.cat([features, self.embed[tokens].to(features.dtype)], dim=-1))
        cos, sin = self.rope(positions, x.dtype)
        layers = self.decoder_layers
        split = lambda past: [None] * len(layers) if past is None else past.chunk(len(layers), dim=1)  # noqa: E731
        join = lambda parts: parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # noqa: E731  (1 layer: no copy)
        ks, vs = [], []
        for layer, pk, pv in zip(layers, split(past_k), split(past_v)):
            x, k, v = layer(x, cos, sin, pk, pv, mask)
            ks.append(k)
            vs.append(v)
        return self.norm(x), join(ks), join(vs)

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        return [self.layer, *self.more_layers]

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """(..., H) -> (..., S) logits over the subset."""
        if self.fast_linear and kernels.enabled_for(features.device, features.dtype):
            return kernels.linear(features, self.head_weight)
        return features @ self.head_weight.T

    def teacher_logits(self, final: torch.Tensor) -> torch.Tensor:
        """The target's logits over the subset from its final hidden state (distill's soft loss): the same head."""
        return self.logits(final)

    def unrolled(self, features: torch.Tensor, tokens: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """Training-time test: `depth` draft steps from every position at once, exactly as propose() runs them.

        features (B, T, W) true target features, tokens (B, T + depth) with tokens[:, i + 1] following position i.
        Row i of step d is the chain that started from the true feature at i; it sits at position i + d - 1, sees the
        true entries at positions <= i and its own chain's earlier steps. Returns d predicted features (B, T, H).
        """
        return unroll(self, self.prepare(features), tokens, depth)


def unroll(head: nn.Module, feat: torch.Tensor, tokens: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """The training-time test loop shared by the heads: `head(feat, tokens, positions, past_k, past_v, mask)` from
    every position at once, `depth` times, each step reading the last one's outputs (see EagleHead.unrolled)."""
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


def save_draft(head: EagleHead, path: str | Path, meta: dict | None = None) -> None:
    """Write the trainable weights (fp16) and the subset ids; the target's embeddings are not saved."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.to(torch.int32) if k == "subset" else v.detach().to(torch.float16)).contiguous().cpu()
               for k, v in head.state_dict().items()}
    save_file(tensors, str(path / WEIGHTS_FILE))
    (path / CONFIG_FILE).write_text(json.dumps({"config": asdict(head.c), **(meta or {})}, indent=2) + "\n")


def build_head(target_model: nn.Module, subset: torch.Tensor, fuse_layers: tuple[int, ...] = (),
               num_layers: int = 1, device: str | torch.device | None = None) -> EagleHead:
    """A fresh head in the target's dtype, borrowing its frozen embeddings and output head, on `device` (None: where
    the target's output head computes; under a device map its weights are read back from any offload)."""
    c = EagleConfig.from_target(target_model.config, len(subset), fuse_layers, num_layers)
    out = target_model.get_output_embeddings()
    embed, head = weight_of(target_model.get_input_embeddings()), weight_of(out)
    device = torch.device(device) if device is not None else module_device(out)
    return EagleHead(c, embed.to(device), head.to(device), subset).to(device=device, dtype=embed.dtype)


def init_from_target_layer(head: EagleHead, target_model: nn.Module, index: int) -> None:
    """Start the head's decoder layer (and its final norm) as a copy of the target's layer `index` (negative: from the
    end) rather than at random: the same shapes, and weights that already model this language."""
    layer = target_model.model.layers[index]
    pairs = {"input_norm": layer.input_layernorm, "post_norm": layer.post_attention_layernorm,
             "q_proj": layer.self_attn.q_proj, "k_proj": layer.self_attn.k_proj, "v_proj": layer.self_attn.v_proj,
             "o_proj": layer.self_attn.o_proj, "gate_proj": layer.mlp.gate_proj, "up_proj": layer.mlp.up_proj,
             "down_proj": layer.mlp.down_proj}
    with torch.no_grad():
        for name, source in pairs.items():
            getattr(head.layer, name).weight.copy_(source.weight)
        head.norm.weight.copy_(target_model.model.norm.weight)


def load_trained_draft(path: str | Path, target_loaded, device: str | torch.device | None = None) -> EagleDrafter:
    """An EagleDrafter from an asset folder, bound to the target in a loading.LoadedModel, computing on `device`
    (None: where the target's output head does)."""
    from safetensors.torch import load_file

    path = Path(path)
    meta = json.loads((path / CONFIG_FILE).read_text())
    tensors = load_file(str(path / WEIGHTS_FILE))
    model = target_loaded.model
    if meta["config"]["vocab_size"] != model.config.vocab_size or meta["config"]["hidden_size"] != model.config.hidden_size:
        raise ValueError(f"the draft in {path} was trained for a different target (config {meta['config']})")
    head = build_head(model, tensors["subset"].long(), meta["config"].get("fuse_layers", ()),
                      meta["config"].get("num_layers", 1), device)
    head.load_state_dict({k: v for k, v in tensors.items()})
    head.fast_linear = getattr(target_loaded, "fast_linear", True)  # the head's products follow the target's (config.Runtime)
    if head.fast_linear and kernels.enabled_for(head.subset.device, head.head_weight.dtype):
        kernels.patch_linears(head)
    chain = meta.get("metrics", {}).get("chain") or []
    return EagleDrafter(head.eval(), min_confidence=float(meta.get("min_confidence", 0.0)),
                        held_out_chain=tuple(chain[:2]) if len(chain) >= 2 else None)


class EagleDrafter(Drafter):
    """Drafts with an EagleHead; its KV cache holds entries from true target features only, between proposals.

    With min_confidence > 0 it stops drafting before a token whose draft probability (the top one under greedy, the
    sampled one's distribution peak under sampling) falls below it, as transformers' assistant_confidence_threshold
    does: on a CPU a wider verify pass costs more, and unsure drafts are rarely accepted. The first token is always
    proposed. The stop depends only on the draft's own state, so rejection sampling stays exact.
    """

    name = "eagle"
    needs_target_hidden = True

    def __init__(self, head: EagleHead, min_confidence: float = 0.0,
                 held_out_chain: tuple[float, float] | None = None):
        self.head = head
        self.target_layers = head.target_layers  # the engine passes these layers' hidden states too
        self.min_confidence = min_confidence
        # from training's last held-out evaluation: the chance its first / first two drafted tokens are the target's
        self.held_out_chain = held_out_chain
        self.confidences: list[float] = []  # the peak draft probability of each token of the last proposal
        self.k = self.v = None
        self.num_true = 0  # cache entries computed from true target features (positions 0 .. num_true - 1)
        self.pending: torch.Tensor | None = None  # true features (m, H) for positions num_true .. num_true + m - 1
        self.last_true: torch.Tensor | None = None  # the last true feature fed, to redo a proposal without update

    @property
    def cache_length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def begin(self, prompt_ids: list[int], target_hidden: torch.Tensor | None = None) -> None:
        if target_hidden is None:
            raise ValueError("EagleDrafter needs the target's hidden states (needs_target_hidden)")
        self.k = self.v = None
        self.num_true = 0
        self.pending = target_hidden
        self.last_true = None

    def _crop(self, length: int) -> None:
        if self.k is not None and self.k.shape[2] > length:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]

    def _step(self, features: torch.Tensor, tokens: list[int], start: int) -> torch.Tensor:
        """Feed features (T, H) and their following tokens at positions start.. ; return the last predicted feature."""
        weight = self.head.norm.weight  # the head's device and dtype (either head class)
        tok = torch.tensor([tokens], device=weight.device)
        pos = torch.arange(start, start + len(tokens), device=weight.device)
        out, k, v = self.head(features[None].to(weight.device, weight.dtype), tok, pos, self.k, self.v)
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return out[0, -1]

    @torch.inference_mode()
    def propose(self, request: DraftRequest) -> Proposal:
        ids, sampling = request.ids, request.sampling
        if request.k <= 0:
            return Proposal([])
        self._crop(self.num_true)
        if self.pending is None or len(self.pending) == 0:  # proposed twice without an update: redo the last entry
            self.num_true -= 1
            self._crop(self.num_true)
            self.pending = self.last_true
        m = len(self.pending)
        if self.num_true + m != len(ids) - 1:
            raise ValueError(f"draft state covers {self.num_true + m} positions but the request has {len(ids) - 1}")
        weight = self.head.norm.weight
        feature = self._step(self.head.prepare(self.pending.to(weight.device, weight.dtype)), ids[self.num_true + 1 :],
                             self.num_true)
        self.num_true += m
        self.last_true, self.pending = self.pending[-1:], None
        tokens, probs, token_probs = [], [], []
        self.confidences = []
        subset = self.head.subset
        gen = None if sampling.greedy else generator_on(request.generator, weight.device)  # once per proposal
        for j in range(request.k):
            logits = self.head.logits(feature)  # (S,)
            q_sub = torch.softmax(logits.float(), -1) if sampling.greedy else logits_to_probs(logits, sampling)
            confidence = float(q_sub.max())
            if j > 0 and confidence < self.min_confidence:
                break
            self.confidences.append(confidence)
            if sampling.greedy:
                token = int(subset[int(torch.argmax(logits))])
                token_probs.append(confidence)  # q(x) of the argmax: the softmax's peak
            else:
                index = int(torch.multinomial(q_sub, 1, generator=gen))
                token = int(subset[index])
                token_probs.append(float(q_sub[index]))
                q = torch.zeros(self.head.c.vocab_size, dtype=q_sub.dtype, device=q_sub.device)
                probs.append(q.index_copy_(0, subset, q_sub))
            tokens.append(token)
            if token in request.eos_token_ids or j == request.k - 1:
                break
            feature = self._step(feature[None], [token], len(ids) - 1 + j)
        return Proposal(tokens, torch.stack(probs) if probs else None, token_probs)

    def update(self, verdict: Verdict) -> None:
        if verdict.target_hidden is None:
            raise ValueError("EagleDrafter needs the target's hidden states in the verdict")
        self._crop(self.num_true)  # drop entries computed from drafted features
        if self.pending is not None:  # no proposal since the last verdict (another drafter proposed): keep both
            self.pending = torch.cat([self.pending, verdict.target_hidden.to(self.pending.dtype)])
        else:
            self.pending = verdict.target_hidden
