"""Llama-style attention's q, k and v projections as one product, and its MLP's gate and up projections as one: a
layer's seven products become four. On CUDA each is a kernel fewer for a captured pass to replay; on the 2-core CPU
a 3-17-token pass of the bundled model took 8-10% less (each product costs a call and a thread fork beside its
arithmetic), but a prefill more, and our loop's lead over transformers' `generate` shrank, so models load with it on
CUDA only unless the runtime says otherwise (docs/notes/kernels.md).

The parts' weights become row blocks (views) of the merged weight, so nothing is duplicated and a write into a
part (load_state_dict) is a write into the merged weight. transformers' attention forward calls q_proj, k_proj and
v_proj on the same hidden states in turn: q_proj computes all three and leaves k's and v's outputs for the next two
calls on that same tensor; any other call computes its own part. Where the parts no longer lie in the merged weight
(the model moved or cast after loading), and wherever gradients are on (training), each part computes its own
product again.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from .linear import Packed, linear

ATTENTIONS = frozenset({"LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention"})
MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})


class Merged:
    """Linears that read the same input, as one weight whose row blocks are theirs (and one bias, if they have
    biases): `outputs(x)` is their outputs, one product. A part's own forward stays as it was (its fallback)."""

    def __init__(self, parts: list[nn.Linear]) -> None:
        self.parts = parts
        self.sizes = [p.out_features for p in parts]
        self.weight = torch.cat([p.weight.detach() for p in parts])
        biased = parts[0].bias is not None
        self.bias = torch.cat([p.bias.detach() for p in parts]) if biased else None
        for p, w in zip(parts, self.weight.split(self.sizes)):
            p.weight.data = w  # the same Parameter, now a view of the merged weight
        if biased:
            for p, b in zip(parts, self.bias.split(self.sizes)):
                p.bias.data = b
        self.ptrs = [p.weight.data_ptr() for p in parts]
        # the few-row CPU product where the parts had it (kernels.patch_linears), packed where they were packed
        self.fast = all(getattr(p, "_specdemo_fast", False) for p in parts)
        packs = [getattr(p, "_specdemo_packed", None) for p in parts]
        self.packed = Packed(packs[0].native) if self.fast and all(packs) else None
        for p, pack in zip(parts, packs):
            if pack is not None:
                p._specdemo_packed = None  # a fallback part computes unpacked rather than pack a copy of its view
        if self.packed is not None:
            self.packed.get(self.weight)

    def intact(self) -> bool:
        """Whether the merged product stands for the parts: no gradient wanted (the merged weight is a plain tensor,
        which training would not reach) and every part's weight still its block of the merged weight (not after a
        move or a cast)."""
        if torch.is_grad_enabled():
            return False
        if torch.compiler.is_compiling():
            return True
        return all(p.weight.data_ptr() == ptr for p, ptr in zip(self.parts, self.ptrs))

    def outputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.fast:
            y = linear(x, self.weight, self.bias, self.packed)
        else:
            y = F.linear(x, self.weight, self.bias)
        return y.split(self.sizes, dim=-1)


def _mergeable(parts: list[nn.Module]) -> bool:
    first = parts[0]
    return (all(type(p) is nn.Linear for p in parts)
            and all(getattr(p, "_hf_hook", None) is None for p in parts)
            and len({(p.weight.device, p.weight.dtype, p.in_features, p.bias is None) for p in parts}) == 1
            and first.weight.is_contiguous())


def _merge_qkv(attention: nn.Module) -> bool:
    parts = [attention.q_proj, attention.k_proj, attention.v_proj]
    if not _mergeable(parts):
        return False
    merged = Merged(parts)
    own = [p.forward for p in parts]
    left: dict[str, object] = {}  # what q_proj's product left for k_proj and v_proj: the input, then their outputs

    def q_forward(self, x):
        if not merged.intact():
            return own[0](x)
        q, k, v = merged.outputs(x)
        left.update(x=x, k=k, v=v)
        return q

    def part_forward(name: str, i: int):
        def forward(self, x):
            if left.get("x") is x and name in left:
                out = left.pop(name)
                if "k" not in left and "v" not in left:
                    left.clear()  # nothing more to hand out: let go of the input
                return out
            return own[i](x)
        return forward

    parts[0].forward = types.MethodType(q_forward, parts[0])
    parts[1].forward = types.MethodType(part_forward("k", 1), parts[1])
    parts[2].forward = types.MethodType(part_forward("v", 2), parts[2])
    attention._specdemo_merged = merged
    return True


def _merge_gate_up(mlp: nn.Module) -> bool:
    parts = [mlp.gate_proj, mlp.up_proj]
    if not (_mergeable(parts) and isinstance(getattr(mlp, "down_proj", None), nn.Module)
            and getattr(mlp, "_hf_hook", None) is None):
        return False
    merged = Merged(parts)
    own = mlp.forward

    def forward(self, x):
        if not merged.intact():
            return own(x)
        gate, up = merged.outputs(x)
        return self.down_proj(self.act_fn(gate) * up)

    mlp.forward = types.MethodType(forward, mlp)
    mlp._specdemo_merged = merged
    return True


def merge_projections(model: nn.Module) -> int:
    """Merge every Llama-style attention's q/k/v and MLP's gate/up products of `model` (ATTENTIONS, MLPS) whose
    parts are plain linears alike in device, dtype, input and bias, under no accelerate hook (a device map streams a
    part's weight in at its own call); returns how many groups. Run it after kernels.patch_linears, whose few-row
    product and packing the merged products then use."""
    count = 0
    for module in list(model.modules()):
        if getattr(module, "_specdemo_merged", None) is not None:
            continue
        name = type(module).__name__
        if name in ATTENTIONS and all(hasattr(module, n) for n in ("q_proj", "k_proj", "v_proj")):
            count += _merge_qkv(module)
        elif name in MLPS and all(hasattr(module, n) for n in ("gate_proj", "up_proj", "act_fn")):
            count += _merge_gate_up(module)
    return count
