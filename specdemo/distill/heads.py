"""The head architectures distill trains (`--arch`): specdemo.eagle's EAGLE head and specdemo.eagle3's EAGLE-3 head
(vLLM's and SGLang's checkpoint format), each built and initialised from the target and saved; Eagle3Trainee shows
an Eagle3Head to training.train through the interface an EagleHead has. Knows nothing of data or of the loop.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .config import TrainConfig

ARCHS = ("eagle", "eagle3")


def default_layers(config: TrainConfig, num_target_layers: int) -> str:
    """config.fuse_layers, or for an EAGLE-3 head without them vLLM's default aux layers (2, L // 2, L - 3)."""
    if config.arch != "eagle3" or config.fuse_layers:
        return config.fuse_layers
    from ..eagle3 import default_aux_layer_ids

    return ",".join(map(str, default_aux_layer_ids(num_target_layers)))


class Eagle3Trainee(nn.Module):
    """An Eagle3Head as training.train sees an EagleHead: features are the target's final hidden state followed by
    the aux layers' states (engine.target_features' layout), of which the head reads the aux ones; `subset` holds the
    target id of each draft id; its hidden state is its own (not a target feature), so there is no feature loss, and
    the target's distribution over the draft vocabulary (soft loss) comes from the target's head rows."""

    predicts_features = False
    decoder_layers: list = []  # no dropout in the vLLM layer

    def __init__(self, head: nn.Module, target_head: torch.Tensor):
        super().__init__()
        self.head = head
        self.c = head.c
        self.hidden_size = head.c.target_hidden_size
        self.register_buffer("subset", head.to_target(torch.arange(head.c.draft_vocab_size,
                                                                   device=head.d2t.device)), persistent=False)
        self.register_buffer("target_rows", target_head.detach()[self.subset.to(target_head.device)].clone(),
                             persistent=False)

    def unrolled(self, features: torch.Tensor, tokens: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """features (B, T, H * (1 + n_aux)) -> `depth` lists of hidden states (B, T, H), as Eagle3Head.unrolled."""
        return self.head.unrolled(features[..., self.hidden_size :], tokens, depth)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.logits(hidden)

    def teacher_logits(self, final: torch.Tensor) -> torch.Tensor:
        """The target's logits over the draft vocabulary from its final hidden state (..., H) -> (..., S)."""
        return final @ self.target_rows.T.to(final.dtype)


def build_eagle3_head(target_model: nn.Module, subset: torch.Tensor, layers: tuple[int, ...]) -> nn.Module:
    """A fresh EAGLE-3 head over the draft vocabulary `subset` (sorted target ids): d2t from it, the target's embeddings
    borrowed (frozen, not saved), lm_head the target's head rows (frozen, as the EAGLE head's borrowed head, but saved:
    vLLM reads it from the checkpoint), norm starting as the target's final norm."""
    from ..eagle3 import Eagle3Config, Eagle3Head

    c = Eagle3Config.for_target(target_model.config, len(subset), tuple(layers))
    embed = target_model.get_input_embeddings().weight
    head = Eagle3Head(c, embed).to(device=embed.device, dtype=embed.dtype)
    subset = subset.to(embed.device).long()
    with torch.no_grad():
        head.d2t.copy_(subset - torch.arange(len(subset), device=embed.device))
        head.lm_head.weight.copy_(target_model.get_output_embeddings().weight[subset])
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


def build(config: TrainConfig, target_model: nn.Module, subset: torch.Tensor) -> tuple[nn.Module, Callable]:
    """(the module training.train trains, save(out, meta) writing its asset) for config.arch."""
    if config.arch == "eagle3":
        from ..eagle3 import save_eagle3

        head = build_eagle3_head(target_model, subset, config.layers)
        if config.init_layer is not None:
            init_eagle3_from_target_layer(head, target_model, config.init_layer)
        trainee = Eagle3Trainee(head, target_model.get_output_embeddings().weight)
        return trainee, lambda out, meta: save_eagle3(head, out, meta)
    from ..eagle import build_head, init_from_target_layer, save_draft

    head = build_head(target_model, subset, config.layers, config.draft_layers)
    if config.init_layer is not None:
        init_from_target_layer(head, target_model, config.init_layer)
    return head, lambda out, meta: save_draft(head, out, meta)
