"""Drafters: one batch-shaped seam (base), the built-in kinds (prompt lookup, suffix decoding, a draft model, an
EAGLE-3 head, the hybrid), the registry every layer reads them from, and resolve_draft, the one place that decides
what a draft is.

A new drafter is one module here and one registry entry. The model-backed drafters import the engine's KV cache, so
they load on first use: the engine imports this package's seam.
"""

from __future__ import annotations

import importlib

from .base import Drafter, DraftRequest, Proposal, Verdict, cut_at_eos
from .ngram import NgramDrafter

_LAZY = {"ModelDrafter": ".model", "Eagle3Drafter": ".eagle3", "HybridDrafter": ".hybrid",
         "SuffixDrafter": ".suffix", "SuffixCache": ".suffix"}

__all__ = ["Drafter", "DraftRequest", "Proposal", "Verdict", "cut_at_eos", "NgramDrafter", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
