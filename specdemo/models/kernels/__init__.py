"""Faster kernels for decoding: the few-row CPU linear product (linear.py; compiled for the CPU in native.py),
batched one-token decoding (decode.py),
merged q/k/v and gate/up products (merge.py), q and k's RoPE together (rope.py) and CUDA's fused RMSNorm
(norm.py).
They read no environment; whether to use them is the caller's. Note that `kernels.linear` is the function; its
module is `specdemo.models.kernels.linear` in sys.modules (importlib.import_module gives it).
"""

from .decode import decode_cache, grouped_attention, grouped_attention_on, left_pad
from .linear import (
           MAX_ROWS,
           Packed,
           available_memory,
           enabled_for,
           linear,
           pack,
           patch_linears,
           plan_free_attention,
)
from .merge import merge_projections
from .native import build as native_kernel
from .norm import fuse_norms
from .rope import fuse_rope, unfuse_rope

__all__ = ["MAX_ROWS", "Packed", "available_memory", "decode_cache", "enabled_for", "fuse_norms", "fuse_rope",
           "grouped_attention", "grouped_attention_on", "left_pad", "linear", "merge_projections", "native_kernel",
           "pack", "patch_linears", "plan_free_attention", "unfuse_rope"]
