"""Every clock in the project: the engine's compute clock, wall time around a call, forward-pass hooks, and the one
pass-cost model (verify cost by width, at any batch size) that compare, the sweeps, bench and the drafters that time
the target at load (the hybrid, cost-aware suffix decoding) share.

All readings are `time.perf_counter` after a CUDA synchronise, so queued GPU work is counted where it ran.
Knows models only as callables with a KV cache; no decoding, no metrics.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from ..config import MAX_K

T = TypeVar("T")
log = logging.getLogger(__name__)

# the text whose ids the load-time timings run after (the hybrid's calibration, cost-aware suffix decoding)
PROBE_TEXT = "Speculative decoding lets a small draft propose tokens that the target checks in one pass."


def _on_cuda(device: torch.device | str | None) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def sync(device: torch.device | str | None) -> None:
    """Wait for queued GPU work, so that perf_counter readings mean something (on every GPU: a device map may
    spread one pass over several)."""
    if _on_cuda(device):
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)


def now(device: torch.device | str | None = None) -> float:
    """perf_counter after the device's queued work is done."""
    sync(device)
    return time.perf_counter()


class Clock:
    """Accumulates compute time between `start` and `stop`; the decoders stop it before each `yield`, so time spent
    by whoever consumes their events (a UI, a benchmark) is never counted. `split` marks where a step's first phase
    (its drafting) ends without waiting for the device; after `stop`, `first` is that phase's seconds."""

    def __init__(self, device: torch.device):
        self.device = device
        self.total = 0.0
        self.first = 0.0  # the seconds before the last split, known at stop (0 without one)
        self._t0 = 0.0
        self._split: float | None = None  # when the host marked the split (None: no split since start)
        # on CUDA: events recorded on the stream at start and at the split, read once stop has waited for the device
        self._events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(2)) if _on_cuda(device) else None

    def start(self) -> None:
        self._t0 = now(self.device)
        self._split = None
        if self._events is not None:
            self._events[0].record(torch.cuda.current_stream(self.device))

    def split(self) -> None:
        """The first phase ends here: on CUDA where its queued work ends on the stream (no wait: a step synchronises
        once more, at stop, not here), elsewhere now."""
        if self._events is not None:
            self._events[1].record(torch.cuda.current_stream(self.device))
        self._split = time.perf_counter()

    def stop(self) -> float:
        dt = now(self.device) - self._t0
        self.total += dt
        if self._split is None:
            self.first = 0.0
        elif self._events is None:
            self.first = self._split - self._t0
        else:
            self.first = min(max(self._events[0].elapsed_time(self._events[1]) / 1e3, 0.0), dt)
        self._split = None
        return dt


def timed_call(fn: Callable[[], T], device: torch.device | str | None = None) -> tuple[T, float]:
    """(fn(), wall seconds around it), synchronised on both sides."""
    t0 = now(device)
    out = fn()
    return out, now(device) - t0


class ForwardTimer:
    """Seconds spent inside a model's outermost forward calls, and how many calls; hooks on the given modules.

    Nested calls (CausalLM -> base model -> lm_head) count once, so hooking every entry point is safe. Compiled
    passes (--graphs compiled) and CUDA graph replays run no hooks: a pass compiled while they are on traces them as
    nothing (dynamo cannot trace the clock), so the runner stays compiled and those passes go uncounted.
    """

    def __init__(self, modules: Sequence[torch.nn.Module], device: torch.device | str | None = None):
        self.device = device
        self.seconds = 0.0
        self.calls = 0
        self._depth = 0
        self._t0 = 0.0
        self._handles = []
        for m in modules:
            self._handles.append(m.register_forward_pre_hook(self._enter))
            self._handles.append(m.register_forward_hook(self._exit))

    def _enter(self, module, args) -> None:
        if torch.compiler.is_compiling():
            return
        if self._depth == 0:
            self._t0 = now(self.device)
        self._depth += 1

    def _exit(self, module, args, output) -> None:
        if torch.compiler.is_compiling():
            return
        self._depth -= 1
        if self._depth == 0:
            self.seconds += now(self.device) - self._t0
            self.calls += 1

    def read(self) -> tuple[float, int]:
        return self.seconds, self.calls

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


@torch.inference_mode()
def forward_seconds(model, prompts: Sequence[list[int]], widths: Sequence[int],
                    repeats: int = 3) -> dict[int, float]:
    """{w: the best seconds of a B x w forward after the B prompts' cache} for each width and 1 (B = 1: one prompt's
    ids in a list). The pass-cost model every k choice reads: verify passes of k + 1 tokens per row.

    The widths take turns (a warm-up round, then `repeats` rounds of one pass each), so a slow spell of a shared
    machine slows one pass of every width rather than all of one width's (measured one width after the other, a busy
    spell could make a wider pass look cheaper than a 1-token one)."""
    from .kv import BatchKV, left_padded

    kv = BatchKV(model, len(prompts))
    tokens, real = left_padded(prompts, kv.device)
    kv.forward(tokens, real, 1)
    counts = list(kv.counts)
    order = sorted(set(widths) | {1})
    seconds = {w: float("inf") for w in order}
    last = torch.tensor([p[-1] for p in prompts], device=kv.device)[:, None]
    for round_ in range(repeats + 1):  # round 0 warms up each shape and is not counted
        for w in order:
            x = last.expand(-1, w).contiguous()  # the content does not change the cost
            _, dt = timed_call(lambda: kv.forward(x, torch.ones_like(x, dtype=torch.bool), w), kv.device)
            if round_:
                seconds[w] = min(seconds[w], dt)
            kv.keep(counts)
    return seconds


def forward_costs(model, prompts: Sequence[list[int]], widths: Sequence[int],
                  repeats: int = 3) -> dict[int, float]:
    """Seconds of a `w`-token forward after the prompts' cache, over a 1-token forward: {w: ratio}.

    A (k+1)-token verify pass costs forward_costs[k+1]; on a GPU this is ~1, on a CPU it grows with w.
    """
    seconds = forward_seconds(model, prompts, widths, repeats)
    return {w: s / seconds[1] for w, s in seconds.items()}


def cost_widths(k_max: int) -> list[int]:
    """The widths measured for k up to k_max: 2..5, then at roughly doubling steps, and k_max + 1."""
    return sorted({w for w in (2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 49, 65) if w <= k_max + 1} | {k_max + 1})


def verify_costs(costs: dict[int, float], k_max: int) -> dict[int, float]:
    """{k: a (k+1)-wide pass over a 1-wide one} for k = 1..k_max from measured {width: seconds or ratio} (width 1
    among them), linear between the measured widths."""
    known = sorted((w, s / costs[1]) for w, s in costs.items())
    out = {}
    for k in range(1, k_max + 1):
        w = k + 1
        lo = max((x for x in known if x[0] <= w), key=lambda x: x[0])
        hi = min((x for x in known if x[0] >= w), key=lambda x: x[0], default=lo)
        out[k] = lo[1] if hi[0] == lo[0] else lo[1] + (hi[1] - lo[1]) * (w - lo[0]) / (hi[0] - lo[0])
    return out


def nondecreasing(values: list[float], weights: list[float] | None = None) -> list[float]:
    """The closest non-decreasing sequence in (weighted) least squares (pool adjacent violators): a wider pass never
    costs less than a narrower one, so a dip in a few noisy timings is noise."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values, weights or [1.0] * len(values)):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, w2, n2), (m1, w1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return [m for m, _, n in blocks for _ in range(n)]


def verify_costs_for(model, prompts: Sequence[list[int]], k_max: int = MAX_K,
                     repeats: int = 2) -> dict[int, float]:
    """{k: cost of a (k+1)-token pass / a 1-token pass} for k = 1..k_max (a micro-benchmark, see forward_seconds)."""
    return verify_costs(forward_seconds(model, prompts, cost_widths(k_max), repeats), k_max)


# pass costs timed at load, per loaded model: they belong to the model on this machine, not to a run
_AT_LOAD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def load_time_verify_costs(model, probe: list[int], k_max: int) -> dict[int, float]:
    """{n: an (n+1)-token pass over a 1-token one} for n = 1..k_max after `probe` (PROBE_TEXT's ids): timed at the
    first call for this model (a few dozen short passes), made non-decreasing, remembered for the model (cost-aware
    suffix decoding)."""
    memo = _AT_LOAD.setdefault(model, {})
    if k_max not in memo:
        measured = verify_costs_for(model, [probe], k_max, repeats=3)
        memo[k_max] = {n: round(c, 3) for n, c in zip(measured, nondecreasing(list(measured.values())))}
        log.info("verify pass costs at load: %s", memo[k_max])
    return memo[k_max]


class StepCosts:
    """What steps cost by their verify width as a run goes, the costs that size draft trees under --tree auto.

    Each speculative step's seconds (drafting and verifying: a wider tree costs the drafter more too) are kept by
    width, the last WINDOW per width, and so is the ratio of each step's seconds to the step before it in the same
    run where the two widths differ (by pair of widths). `costs()` is the load-time pass costs (`prior`, {n: an
    (n+1)-token pass over a 1-token one}) with the measured widths' costs put in their place: once two widths have
    MIN_SAMPLES steps and MIN_PAIRS ratios join them to the rest, their costs relative to each other are the
    least-squares fit of those ratios' medians (in logs); a width between measured ones keeps the prior's ratio to its
    measured neighbours, one beyond the widest costs at least the line through the two widest measured. So a tree is
    sized by what steps of its width cost on this machine, not by a few passes timed at load (on a shared 2-core
    machine those put a 9-token pass at 1.08x a 2-token one where the runs measured 1.28x:
    docs/notes/trees-cpu-2026-12-04.md).
    Ratios of neighbouring steps, 40 ms apart, leave out the machine's pace: it drifted by 40% within one bench run on
    that machine, where the widths' own costs differ by 5%, so comparing each width's latest steps (what this did
    before, 2026-12-06) priced widths by when they were last timed."""

    WINDOW = 24
    MIN_SAMPLES = 5  # steps before a width counts (at 3, a slow spell at a rarely used width skewed auto)
    MIN_VALUED = 3  # tokens the branches must be valued at before extra_scale says what they gave
    MIN_PAIRS = 3  # ratios to its neighbours' steps before a width's cost counts

    def __init__(self, prior: dict[int, float]):
        self.prior = prior
        self.seconds: dict[int, deque] = {}
        self.pairs: dict[tuple[int, int], deque] = {}  # (a, b), a < b: log(seconds at b / seconds at a), next steps
        self._last: tuple[int, float] | None = None  # this run's last step: (width, seconds)
        self.extras: deque = deque(maxlen=4 * self.WINDOW)  # per tree step: (off-chain value, off-chain tokens)
        self._costs: tuple[dict, dict] | None = None  # (the prior, costs()) until a step is added: asked every step

    def add_extras(self, valued: float, gave: int) -> None:
        """A tree step's nodes off its chain of first children: what the drafter valued them at, and how many of them
        the accepted path took (TokenTree.off_chain)."""
        self.extras.append((valued, gave))

    def extra_scale(self) -> float:
        """What the recent trees' nodes off their chains gave over what they were valued at (1 until they were
        valued at MIN_VALUED tokens in all; within 0.1..2): a drafter whose estimates run high (the trained head's
        joint q did by 17% on the dev prompts) then sizes its trees by what such nodes give."""
        valued = sum(v for v, _ in self.extras)
        if valued < self.MIN_VALUED:
            return 1.0
        return round(min(2.0, max(0.1, sum(g for _, g in self.extras) / valued)), 3)

    def add(self, width: int, seconds: float) -> None:
        """One step that verified `width` tokens per row took `seconds`."""
        self.seconds.setdefault(width, deque(maxlen=self.WINDOW)).append(seconds)
        if self._last is not None and self._last[0] != width and seconds > 0 and self._last[1] > 0:
            (a, sa), (b, sb) = sorted([self._last, (width, seconds)])
            self.pairs.setdefault((a, b), deque(maxlen=self.WINDOW)).append(math.log(sb / sa))
        self._last = (width, seconds)
        self._costs = None

    def restart(self) -> None:
        """A new run: its first step is not compared with the last run's (other work may have run between them)."""
        self._last = None

    def relative(self) -> dict[int, float]:
        """{width: its steps' cost over the narrowest such width's}, for the widths with MIN_SAMPLES steps joined to
        it by ratios (least squares over the median ratio of each pair of widths, weighed by how many it has)."""
        ready = {w for w, s in self.seconds.items() if len(s) >= self.MIN_SAMPLES}
        edges = [(a, b, statistics.median(d), len(d)) for (a, b), d in self.pairs.items() if a in ready and b in ready]
        joined = {w: sum(n for a, b, _, n in edges if w in (a, b)) for w in ready}
        edges = [e for e in edges if joined[e[0]] >= self.MIN_PAIRS and joined[e[1]] >= self.MIN_PAIRS]
        if not edges:
            return {}
        anchor = min(w for a, b, _, _ in edges for w in (a, b))
        linked = {anchor}
        while grown := {w for a, b, _, _ in edges for w in (a, b) if (a in linked) != (b in linked)} - linked:
            linked |= grown  # the widths joined to the anchor by ratios
        index = {w: i for i, w in enumerate(sorted(linked - {anchor}))}
        lap, rhs = [[0.0] * len(index) for _ in index], [0.0] * len(index)
        for a, b, d, n in edges:  # the normal equations of sum n (log b - log a - d)^2, the anchor's log held at 0
            for w, sign in ((a, -1.0), (b, 1.0)):
                if w in index:
                    lap[index[w]][index[w]] += n
                    rhs[index[w]] += sign * n * d
            if a in index and b in index:
                lap[index[a]][index[b]] -= n
                lap[index[b]][index[a]] -= n
        logs = {anchor: 0.0}
        if index:
            solved = torch.linalg.solve(torch.tensor(lap, dtype=torch.float64),
                                        torch.tensor(rhs, dtype=torch.float64)).tolist()
            logs.update({w: solved[i] for w, i in index.items()})
        return {w: math.exp(v) for w, v in sorted(logs.items())}

    def costs(self) -> dict[int, float]:
        """{n: what a step verifying n drafted tokens costs, over a 1-token pass}: the prior with the run's measured
        ratios between widths in place (see the class), non-decreasing. Worked out once per step added."""
        if self._costs is None or self._costs[0] is not self.prior:
            self._costs = (self.prior, self._worked_out())
        return self._costs[1]

    def _worked_out(self) -> dict[int, float]:
        prior = self.prior
        timed = [(w - 1, s, len(self.seconds[w])) for w, s in self.relative().items() if w - 1 in prior or w == 1]
        if len(timed) < 2:
            return prior
        # a wider step never costs less: dips pooled, each width weighed by its steps (a width timed a few times in
        # a slow spell moves its neighbours less than one timed in every step)
        pooled = nondecreasing([s for _, s, _ in timed], [c for _, _, c in timed])
        measured = {n: s for (n, _, _), s in zip(timed, pooled)}
        base = {0: 1.0, **prior}
        scale = {n: s / base[n] for n, s in measured.items()}  # relative cost per unit of prior cost, where measured
        first = min(scale)
        known = sorted((n, v / scale[first]) for n, v in scale.items())  # corrections, 1 at the narrowest
        (a, ca), (b, cb) = [(n, base[n] * c) for n, c in known[-2:]]  # the two widest measured, as costs
        out = []
        for n in sorted(prior):
            lo = max((x for x in known if x[0] <= n), key=lambda x: x[0], default=known[0])
            hi = min((x for x in known if x[0] >= n), key=lambda x: x[0], default=known[-1])
            corr = lo[1] if hi[0] == lo[0] else lo[1] + (hi[1] - lo[1]) * (n - lo[0]) / (hi[0] - lo[0])
            out.append(max(prior[n] * corr, cb + (cb - ca) * (n - b) / (b - a)) if n > b else prior[n] * corr)
        return {n: round(c, 3) for n, c in zip(sorted(prior), nondecreasing(out))}


# steps' costs measured by runs, per drafter (built for one target) and (batch size, k, greedy): its next run of the
# same setting starts from what the last one measured, as a server keeps its own timings
_BY_RUNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def step_costs(drafter, key: tuple, prior: dict[int, float]) -> StepCosts:
    """The StepCosts this drafter's runs of `key` share in this process, over `prior` (a newer one replaces it: a
    recalibration)."""
    costs = _BY_RUNS.setdefault(drafter, {}).setdefault(key, StepCosts(prior))
    costs.prior = prior
    return costs
