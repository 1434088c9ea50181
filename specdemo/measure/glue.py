"""A decode's work outside what CUDA graphs replace: the host seconds and the aten calls between the captured regions
(engine.static.CAPTURED: the target's and a draft LM's passes, an EAGLE-3 head's passes and greedy chains). On a GPU
each such call is an eager kernel launch or a host op between replays, where the GPU may sit idle; on the CPU
(`--graphs on`, uncaptured) the same code runs, so the calls can be counted there (scripts/step_glue.py,
tests/test_step_glue.py).
"""

from __future__ import annotations

import collections
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

from torch.utils._python_dispatch import TorchDispatchMode

from ..engine import static

FREE = {"view", "_unsafe_view", "as_strided", "slice", "select", "unsqueeze", "squeeze", "expand", "t", "transpose",
        "permute", "alias", "detach", "detach_", "reshape", "lift_fresh", "_reshape_alias", "to", "_to_copy",
        "numpy_T", "resolve_conj", "resolve_neg", "contiguous"}  # no kernel, or none where nothing changes


class Outside:
    """While `watching()`: the seconds spent inside the captured regions (each outermost call of one of
    engine.static.CAPTURED, as registered when it starts) and whether a call is inside one now (depth)."""

    def __init__(self):
        self.seconds, self.depth = 0.0, 0

    @contextmanager
    def watching(self) -> Iterator[Outside]:
        originals = [(cls, name, getattr(cls, name)) for cls, name in static.CAPTURED]
        for cls, name, original in originals:
            setattr(cls, name, self._timed(original))
        try:
            yield self
        finally:
            for cls, name, original in originals:
                setattr(cls, name, original)

    def _timed(self, original):
        def timed(*args, **kwargs):
            self.depth += 1
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.depth -= 1
                if not self.depth:
                    self.seconds += time.perf_counter() - start

        return timed


class Calls(TorchDispatchMode):
    """Inside `outside.watching()`: the aten calls made outside the captured regions (FREE ones aside), by op and by
    the innermost specdemo function on the stack."""

    def __init__(self, outside: Outside):
        super().__init__()
        self.outside, self.ops, self.where = outside, collections.Counter(), collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if not self.outside.depth and name not in FREE:
            self.ops[name] += 1
            frames = [f for f in traceback.extract_stack() if "/specdemo/" in f.filename and f.filename != __file__]
            self.where[f"{frames[-1].filename.split('specdemo/')[-1]}:{frames[-1].name}" if frames else "?"] += 1
        return func(*args, **(kwargs or {}))
