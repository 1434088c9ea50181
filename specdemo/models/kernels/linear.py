"""A faster matrix product for the few-token forward passes of decoding on a float32 CPU model, and the attention
setting that keeps CUDA decoding timings independent of run order. Reads no environment: callers decide whether to
use either (enabled_for, plan_free_attention's keep_cudnn) from their runtime settings, and whether to use the
compiled kernel (native.build) where one builds.
"""

# Why (the measurements are in docs/notes/kernels.md): on a CPU, `F.linear` on 1-3 rows takes a slow small-matrix path,
# while `W @ x.T` (made row-major again) is several times faster there; from 3 rows on, a copy of each weight packed
# once into oneDNN's blocked layout is faster still, so a verify pass of 3-9 tokens costs about what a 3-token one does,
# which is what makes drafting more than one token worth it on a CPU. Where the caller passes the compiled kernel
# (native.py), it serves every row count instead, 1-9 rows at about one weight stream's cost. Both decoders and
# transformers' `generate` run the same patched model object, so every timed comparison stays like for like; the
# result differs from `F.linear` only by float rounding.

from __future__ import annotations

import logging
import types

import torch
from torch import nn

MAX_ROWS = 8  # without a packed weight, F.linear's own kernel is as fast above this
PACK_BATCH_HINT = 8  # the batch size oneDNN's reorder is tuned for

log = logging.getLogger(__name__)


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's reordered copy of a float32 CPU weight, or None where this torch build cannot make or use one."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    try:
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
            probe = torch.ones(3, weight.shape[1])
            ok = torch.allclose(_packed_linear(probe, packed, None), probe @ weight.detach().T, rtol=1e-4, atol=1e-4)
    except (AttributeError, RuntimeError, NotImplementedError):
        return None
    return packed if ok else None


class Packed:
    """A weight's packed copy, made again when the weight is replaced or changed in place (its version counter moves:
    load_state_dict, `p.add_` under no_grad; not writes through `.data`). A deepcopy starts empty, so a copied model
    whose weights are then changed packs its own. With `native` (a native.Native), the copy is in that kernel's
    layout (`is_native`), else oneDNN's, whichever this weight allows."""

    __slots__ = ("key", "tensor", "native", "is_native")

    def __init__(self, native=None) -> None:
        self.key: tuple[int, int] | None = None
        self.tensor: torch.Tensor | None = None
        self.native = native
        self.is_native = False

    def __deepcopy__(self, memo) -> "Packed":
        return Packed(self.native)

    def get(self, weight: torch.Tensor) -> torch.Tensor | None:
        key = (weight.data_ptr(), weight._version)
        if key != self.key:
            tensor = self.native.pack(weight) if self.native is not None else None
            self.is_native = tensor is not None
            self.key, self.tensor = key, tensor if tensor is not None else pack(weight)
        return self.tensor


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: Packed | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for float32 CPU rows without gradient: the compiled kernel's packed copy for any rows
    where `packed` holds one (Packed with native); else (weight @ x.T).T for 1-2 rows, oneDNN's packed copy of weight
    (see pack) for 3 or more, (weight @ x.T).T up to MAX_ROWS without one, else F.linear.

    Whether to use it at all (enabled_for) is decided by the callers, once: at load time, or per draft token.
    """
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if not rows or torch.is_grad_enabled() or x.device.type != "cpu" or x.dtype != torch.float32:
        return nn.functional.linear(x, weight, bias)
    # the packed copy is looked up by the weight's address, which torch.compile (--graphs compiled) does not trace
    if packed is not None and not torch.compiler.is_compiling() and (copy := packed.get(weight)) is not None:
        if packed.is_native:
            return packed.native.linear(x, copy, bias)
        if rows >= 3:
            return _packed_linear(x, copy, bias)
    if rows > MAX_ROWS:
        return nn.functional.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    if rows == 1:  # two identical rows: the matrix-matrix kernel, much faster than the matrix-vector one here
        flat = torch.cat([flat, flat])
    y = (weight @ flat.T).T[:rows].contiguous()  # row-major, as F.linear returns: later kernels want it
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _patched_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias, self._specdemo_packed)


def enabled_for(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the few-row product applies to a model on this device in this dtype: float32 on the CPU. Whether to
    use it at all is the caller's (config.Runtime.fast_linear, from SPECDEMO_FAST_LINEAR at the edge)."""
    return device.type == "cpu" and dtype == torch.float32


def available_memory() -> int | None:
    """Bytes of memory available to new allocations (Linux MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def patch_linears(model: nn.Module, packed: bool | None = None, native=None) -> int:
    """Route the model's nn.Linear forwards through the few-row product; returns how many were patched. With `native`
    (native.build's kernel), packed copies are in its layout where a weight's shape allows.

    packed=None packs the weights when the copies take at most a quarter of the available memory (they double the
    weights' memory); the copies are made now, and again on first
    use after a weight changes (see Packed). Under accelerate's hooks (a device map) the patch goes under the hook
    (`_old_forward`), which still moves inputs and loads offloaded weights first; offloaded linears, whose weights are
    read back for every pass, get the few-row product without a packed copy (it would be rebuilt every pass).
    """
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and not getattr(m, "_specdemo_fast", False)]
    offloaded = {id(m) for m in linears if getattr(getattr(m, "_hf_hook", None), "offload", False)}
    if packed is None:
        need = sum(m.weight.numel() * m.weight.element_size() for m in linears if id(m) not in offloaded)
        free = available_memory()
        packed = free is None or need <= free // 4
    for module in linears:
        pack_it = packed and id(module) not in offloaded
        module._specdemo_packed = Packed(native) if pack_it else None
        if pack_it:
            module._specdemo_packed.get(module.weight)
        forward = types.MethodType(_patched_forward, module)
        if hasattr(module, "_old_forward"):  # accelerate's hook wraps forward and calls _old_forward inside
            module._old_forward = forward
        else:
            module.forward = forward
        module._specdemo_fast = True
    if offloaded:
        log.info("fast linears: %d of %d are offloaded by accelerate and run without packed copies",
                 len(offloaded), len(linears))
    return len(linears)


def plan_free_attention(device: torch.device, keep_cudnn: bool = False) -> bool:
    """On CUDA, take cuDNN out of torch's attention backends (flash and memory-efficient attention remain),
    process-wide, unless keep_cudnn (config.Runtime.cudnn_sdpa, from SPECDEMO_CUDNN_SDPA=1 at the edge). Returns
    whether it did.

    torch 2.11 on an H200 sends `scaled_dot_product_attention` to cuDNN first, and cuDNN builds an execution plan for
    every shape it has not seen. Decoding meets a new shape at every step (the KV cache grows by one), so the first run
    over a range of lengths pays that build at every step and any later run over the same lengths does not: a timing
    that favours whichever decoder runs second, which no comparison here may have (the GPU check's figures:
    docs/gpu.md)."""
    if device.type != "cuda" or keep_cudnn:
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    return True
