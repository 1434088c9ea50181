"""The head distill trains: specdemo.models.eagle3's EAGLE-3 head (vLLM's and SGLang's checkpoint format), built and
initialised from the target and saved; Eagle3Trainee is what training.train and evaluate read (the head behind a
fixed per-channel input scale, with the target's distribution for the soft loss). Knows nothing of the loop.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import nn

from .config import TrainConfig


def default_layers(config: TrainConfig, num_target_layers: int) -> str:
    """config.fuse_layers, or without them vLLM's default aux layers (2, L // 2, L - 3)."""
    if config.fuse_layers:  # the head reads them sorted, as vLLM captures them
        return ",".join(map(str, sorted(set(config.layers))))
    from ..models.eagle3 import default_aux_layer_ids

    return ",".join(map(str, default_aux_layer_ids(num_target_layers)))


def load_drafter(folder: str, target_loaded):
    """A trained draft folder's drafter (an EAGLE-3 head: drafters.eagle3.load_eagle3)."""
    from ..drafters.eagle3 import load_eagle3

    return load_eagle3(folder, target_loaded)


def evaluable(head: nn.Module, target_model: nn.Module) -> nn.Module:
    """A loaded Eagle3Head (fc already folded) as training.evaluate reads it: through an Eagle3Trainee."""
    return Eagle3Trainee(head, target_model.get_output_embeddings().weight)


class Eagle3Trainee(nn.Module):
    """An Eagle3Head as training.train and evaluate read it. Features are the target's final hidden state followed by
    the aux layers' states (engine.kv.target_features' layout), of which the head reads the aux ones. The state its
    lm_head reads (the normed output) is regressed to the target's final hidden state: lm_head starts as the target's
    own rows and stays frozen, so that state plays the final hidden state's part. The target's distribution over the
    draft vocabulary (the soft loss) comes from the target's head rows.

    The aux states are raw residual streams, whose channels differ in scale by orders of magnitude (SmolLM2: a few
    near 1e4 beside most near 1), so `fc` trains on them divided by a fixed per-channel scale (their RMS over the
    training data) and `folded()` writes fc.weight / scale back: the same function, in vLLM's format.
    """

    def __init__(self, head: nn.Module, target_head: torch.Tensor, aux_scale: torch.Tensor | None = None):
        super().__init__()
        self.head = head
        self.c = head.c
        self.hidden_size = head.c.target_hidden_size
        rows = target_head.detach()[head.subset.to(target_head.device)].clone()
        self.register_buffer("target_rows", rows, persistent=False)
        width = head.c.num_aux * self.hidden_size
        scale = torch.ones(width) if aux_scale is None else aux_scale.float()
        self.register_buffer("aux_scale", scale.to(device=rows.device, dtype=rows.dtype), persistent=False)

    @property
    def subset(self) -> torch.Tensor:
        return self.head.subset

    @property
    def input_scale(self) -> torch.Tensor:
        """(H * (1 + n_aux),) the unit of each feature channel as fc reads it: training's noise is in these units."""
        return torch.cat([torch.ones_like(self.aux_scale[: self.hidden_size]), self.aux_scale])

    def unrolled(self, features: torch.Tensor, tokens: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """features (B, T, H * (1 + n_aux)) -> `depth` normed outputs (B, T, H): Eagle3Head.unrolled's pre-norm
        states (what each next step reads back) through the head's final norm, the state its lm_head reads."""
        aux = features[..., self.hidden_size :] / self.aux_scale.to(features.dtype)
        return [self.head.norm(g) for g in self.head.unrolled(aux, tokens, depth)]

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """(..., H) normed outputs (unrolled's) -> (..., S): Eagle3Head.logits after its norm."""
        return self.head.lm_head(normed)

    def teacher_logits(self, final: torch.Tensor) -> torch.Tensor:
        """The target's logits over the draft vocabulary from its final hidden state (..., H) -> (..., S)."""
        return final @ self.target_rows.T.to(final.dtype)

    @contextmanager
    def folded(self):
        """The head with the scale folded into fc (what the drafter and vLLM run), restored afterwards."""
        weight = self.head.fc.weight
        kept = weight.detach().clone()
        with torch.no_grad():
            weight.div_(self.aux_scale.to(weight.dtype))
        try:
            yield self.head
        finally:
            with torch.no_grad():
                weight.copy_(kept)


def aux_scale(data: dict, hidden_size: int, samples: int = 256) -> torch.Tensor:
    """(n_aux * H,) the RMS of each aux channel over the first `samples` sequences' positions after the first (at
    least 1e-3). The first position is left out: its inner states are an attention sink's, far larger
    (in SmolLM2-135M by two orders of magnitude; docs/eagle3.md), and would set the scale."""
    feats = torch.cat([f[1:, hidden_size:].float() for f in data["features"][:samples]])
    return feats.pow(2).mean(0).sqrt().clamp(min=1e-3)


def build_eagle3_head(target_model: nn.Module, subset: torch.Tensor, layers: tuple[int, ...]) -> nn.Module:
    """A fresh EAGLE-3 head (eagle3_head.build_head) over the draft vocabulary `subset` (sorted target ids): the
    target's embeddings borrowed, lm_head the target's head rows, frozen (but saved: vLLM reads it from the
    checkpoint), norm starting as the target's final norm."""
    from ..models.eagle3_head import build_head

    head = build_head(target_model, subset, tuple(layers))
    with torch.no_grad():
        head.norm.weight.copy_(target_model.model.norm.weight)
    head.lm_head.weight.requires_grad_(False)
    return head


def init_eagle3_from_target_layer(head: nn.Module, target_model: nn.Module, index: int) -> None:
    """Start the head's midlayer as a copy of the target's layer `index` (negative: from the end): its attention reads
    [input_layernorm(embedding), hidden_norm(hidden)] (2H), so q/k/v take the layer's weights on the hidden half and
    start at zero on the embedding half; both norms start as the layer's input norm."""
    layer, mid = target_model.model.layers[index], head.midlayer
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            w = getattr(mid.self_attn, name).weight  # (out, 2H)
            w.zero_()
            w[:, w.shape[1] // 2 :].copy_(getattr(layer.self_attn, name).weight)
        mid.self_attn.o_proj.weight.copy_(layer.self_attn.o_proj.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(mid.mlp, name).weight.copy_(getattr(layer.mlp, name).weight)
        mid.input_layernorm.weight.copy_(layer.input_layernorm.weight)
        mid.hidden_norm.weight.copy_(layer.input_layernorm.weight)
        mid.post_attention_layernorm.weight.copy_(layer.post_attention_layernorm.weight)


def build(config: TrainConfig, target_model: nn.Module, subset: torch.Tensor, data: dict
          ) -> tuple[nn.Module, Callable[[str, dict], None]]:
    """(the Eagle3Trainee training.train trains, save(out, meta) writing its checkpoint with the scale folded in)."""
    from ..models.eagle3 import save_eagle3

    head = build_eagle3_head(target_model, subset, config.layers)
    if config.init_layer is not None:
        init_eagle3_from_target_layer(head, target_model, config.init_layer)
    trainee = Eagle3Trainee(head, target_model.get_output_embeddings().weight,
                            aux_scale(data, head.c.target_hidden_size))

    def save(out: str, meta: dict) -> None:
        with trainee.folded() as folded:
            save_eagle3(folded, out, meta)

    return trainee, save
