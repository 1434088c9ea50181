"""transformers' rotary embedding for Llama-style attention, q and k together: one pass over their heads side by side
instead of one each, and rotate_half as a roll against a sine whose first half is negated (made once a forward
pass, not once a layer). A layer's RoPE is 5 kernels instead of 10 (each rotate_half is a neg and a cat, and each of
q and k is two products and a sum), so a captured pass replays fewer. Each output element is the same products and
sum in the same order ((-x) * s and x * (-s) are the same float), so the output is transformers' bit for bit
(tests/test_kernels_rope.py).

transformers' attention forwards call their module's `apply_rotary_pos_emb` by name, so `fuse_rope` replaces that
name in the Llama, Mistral, Qwen2 and Qwen3 modules (process-wide; calls it cannot take go to the original).
"""

from __future__ import annotations

import importlib

import torch

MODULES = ("llama", "mistral", "qwen2", "qwen3")

_original: dict[str, object] = {}
_last: tuple = (None, None)  # the sine last seen and its signed copy: the layers of a pass share one sine tensor


def _signed(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: roll(x) * _signed(sin) == rotate_half(x) * sin. The pair is read and
    replaced whole, so passes in two threads at once each get their own sine's."""
    global _last
    seen, signed = _last
    if seen is not sin:
        half = sin.shape[-1] // 2
        signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        _last = (sin, signed)
    return signed


def joint_rope(original):
    """apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1) over q and k at once; other calls go to `original`."""

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        # unsqueeze_dim by name or as the int among the rest (older transformers put position_ids before it)
        unsqueeze = kwargs.get("unsqueeze_dim", next((a for a in args if isinstance(a, int)), 1))
        if (unsqueeze != 1 or q.dim() != 4 or k.dim() != 4 or q.dtype != k.dtype or q.shape[0] != k.shape[0]
                or q.shape[2:] != k.shape[2:] or torch.compiler.is_compiling()):
            return original(q, k, cos, sin, *args, **kwargs)
        heads, half = q.shape[1], q.shape[-1] // 2
        # (B, Hq + Hk, T, D) laid out as (B, T, Hq + Hk, D), as q and k come from their projections: the outputs keep
        # that layout, which attention's output then has too (else it is copied back to it)
        qk = torch.cat((q.transpose(1, 2), k.transpose(1, 2)), dim=2).transpose(1, 2)
        out = qk * cos.unsqueeze(1) + qk.roll(half, dims=-1) * _signed(sin).unsqueeze(1)
        return out[:, :heads], out[:, heads:]

    apply_rotary_pos_emb._specdemo_original = original
    return apply_rotary_pos_emb


def fuse_rope() -> int:
    """Install joint_rope in each of MODULES whose transformers module is importable; returns how many it installed
    now (0 when already installed)."""
    count = 0
    for name in MODULES:
        try:
            module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        except ImportError:
            continue
        current = getattr(module, "apply_rotary_pos_emb", None)
        if current is None or hasattr(current, "_specdemo_original"):
            continue
        _original[name] = current
        module.apply_rotary_pos_emb = joint_rope(current)
        count += 1
    return count


def unfuse_rope() -> None:
    """Put transformers' own functions back (for comparisons)."""
    for name, original in _original.items():
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        module.apply_rotary_pos_emb = original
    global _last
    _original.clear()
    _last = (None, None)
