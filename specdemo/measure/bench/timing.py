"""What the benchmark measures inside a timed call: forward seconds and calls of the target and the draft (hooks from
specdemo.engine.timing), the wall time outside them, and the row fields they fill."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ...engine.timing import ForwardTimer
from ..metrics import ratio


def target_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Entry points the engine and generate() call: the CausalLM, its base model and its head."""
    mods = [model]
    for name in ("model", "lm_head"):
        sub = getattr(model, name, None)
        if isinstance(sub, torch.nn.Module):
            mods.append(sub)
    return mods


def drafter_modules(drafter) -> list[torch.nn.Module]:
    """The nn.Modules a drafter holds (a draft model, an EAGLE head); none for prompt lookup."""
    return [v for v in vars(drafter).values() if isinstance(v, torch.nn.Module)]


@dataclass
class Measured:
    """One timed call: new tokens, wall seconds, and target / draft forward seconds and calls inside it."""

    ids: list[int]
    seconds: float
    target_forward_s: float = 0.0
    target_calls: int = 0
    draft_forward_s: float = 0.0
    draft_calls: int = 0
    run: object | None = None  # our decoders: the sweep.Run (events and wall seconds)

    @property
    def tokens(self) -> int:
        return len(self.ids)

    @property
    def every_pass_timed(self) -> bool:
        """Whether the forward hooks saw every target pass of our run (a step or the prefill, each one pass): CUDA
        graph replays and compiled passes (--graphs on on a GPU, compiled) bypass the modules' hooks, and only the
        prefill would count, leaving the rest of the run to look like overhead. An anchor's run: always."""
        return self.run is None or self.target_calls >= len(self.run.events)

    @property
    def overhead_s(self) -> float:
        """Wall time outside every model forward."""
        return max(0.0, self.seconds - self.target_forward_s - self.draft_forward_s)


@contextmanager
def measuring(timers: tuple[ForwardTimer, ForwardTimer | None], out: dict) -> Iterator[None]:
    """Fill out[...] with the forward seconds and calls that happen inside the block."""
    t, d = timers
    t0, d0 = t.read(), d.read() if d else (0.0, 0)
    yield
    t1, d1 = t.read(), d.read() if d else (0.0, 0)
    out.update(target_forward_s=t1[0] - t0[0], target_calls=t1[1] - t0[1],
               draft_forward_s=d1[0] - d0[0], draft_calls=d1[1] - d0[1])


def measure_ours(run_fn, timers) -> Measured:
    """One of our decoder runs (a sweep.Run from run_fn) with the forward time inside it."""
    stats: dict = {}
    with measuring(timers, stats):
        run = run_fn()
    return Measured(run.ids, run.wall_seconds, run=run, **stats)


def put(row: dict, name: str, m: Measured, reference: list[int] | None = None) -> None:
    """Write a measurement into a result row under `name`_... keys (identical: its ids equal `reference`)."""
    row[f"{name}_seconds"] = m.seconds
    row[f"{name}_tokens"] = m.tokens
    row[f"{name}_tokens_per_s"] = ratio(m.tokens, m.seconds)
    if m.every_pass_timed:  # else no forward time or overhead to report (the row's runner says why)
        row[f"{name}_target_forward_s"] = m.target_forward_s
        row[f"{name}_target_calls"] = m.target_calls
        row[f"{name}_draft_forward_s"] = m.draft_forward_s
        row[f"{name}_overhead_s"] = m.overhead_s
    if reference is not None:
        row[f"{name}_identical"] = m.ids == reference
