"""The graph runner: a model's passes over static KV storages (engine.static), captured as CUDA graphs per batch size
(padded to a ladder) and pass width, replayed with their inputs copied into static buffers. Chosen at load by
`--graphs auto|on|off|compiled` (config.Runtime.graphs; compiled: each pass through torch.compile first); anything it
cannot take runs the eager engine (engine.kv), with one log line saying why. On a CPU, `on` runs the same static code
uncaptured (what the tests check).

The engine never knows which runner serves a model: it asks `new_kv` for a cache.
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..config import GRAPH_MODES
from ..models.placement import execution_device
from .kv import PAD, BatchKV
from .static import StaticKV, Storage

log = logging.getLogger(__name__)

BATCH_LADDER = (1, 2, 4, 8, 16, 32, 64)  # captured batch sizes; a batch runs as the next one up (vLLM's way)
MAX_GRAPH_WIDTH = 33  # the widest pass captured (k = 32 and the pending token); wider ones run eagerly
# the pass widths captured: every width of a chain up to k = 8, then wider passes (trees, long chains) padded up to
# the next of these (as vLLM pads batch sizes), so that a tree budget of 32 costs 13 graphs a batch size, not 33
WIDTH_BUCKETS = (*range(1, 10), 12, 17, 25, MAX_GRAPH_WIDTH)
PAD_WIDTHS = "capture"  # pad widths up to WIDTH_BUCKETS: "capture" (where the runner captures), "always" (the tests)
MAX_STORAGES = 4  # free storages a runner keeps for reuse (each holds its graphs)
# --graphs compiled: torch.compile's backend for the passes (the tests trace with "aot_eager": no code generated)
COMPILE_BACKEND = "inductor"
# --graphs compiled: traces of Storage.run one process may keep (dynamo's default is 8, and each batch or width of 1,
# each kept width and each set of feature layers is one; past the limit a fullgraph compile fails)
RECOMPILE_LIMIT = 64


class CaptureBroken(RuntimeError):
    """A capture failed after it began: torch may leave its allocator believing a capture is under way (torch 2.11:
    capture_end skips ending the pool's allocation when it raises, pytorch#180395), so no runner in this process
    captures again."""


_broken: list[str] = []  # why capture stopped for the whole process, once it has
_release_order = itertools.count(1)


@dataclass
class Captured:
    """One captured pass: the graph and the output tensors its replays overwrite (None where the pass gives none)."""

    graph: object
    outputs: tuple[torch.Tensor | None, ...]

    def replay(self, b: int) -> tuple[torch.Tensor | None, ...]:
        """Replay; the first b rows of each output, the caller's own (the next replay overwrites the graph's)."""
        self.graph.replay()
        return tuple(None if o is None else o[:b].clone() for o in self.outputs)


@dataclass
class Runner:
    """How one model's passes run: `capture` (CUDA graphs) or not (the static code, eagerly), over storages it pools
    (one per live decode: the race's two runs and a draft LM each hold their own). `reason` says why it captures
    nothing, where it does not; capture_seconds and graphs count what capture cost."""

    model: object
    capture: bool
    mode: str = "on"  # the --graphs setting it was attached with
    reason: str = ""
    capture_seconds: float = 0.0
    graphs: int = 0
    storages: list[Storage] = field(default_factory=list)
    pool: object = None  # the CUDA graphs' shared memory pool
    compile: bool = False  # --graphs compiled: passes through torch.compile (one dynamic-shape trace) first
    compiled: object = None  # Storage.run compiled, made at the first pass

    @staticmethod
    def refusal(model, mode: str) -> str | None:
        """Why `mode` gives `model` no runner of this kind (None: it can have one)."""
        return why_not(model, mode)

    def acquire(self, rows: int, capacity: int) -> Storage:
        """A free storage with room for `rows` rows (padded to the ladder) of `capacity` positions, the one released
        last first (a warm-up's, whose graphs the decode then replays); made if none."""
        rows = padded_batch(rows) if self.capture else rows
        for s in sorted(self.storages, key=lambda s: -s.released):
            if not s.busy and s.rows >= rows and s.capacity >= capacity:
                s.busy = True
                return s
        free = [s for s in self.storages if not s.busy]
        if len(free) >= MAX_STORAGES:  # the smallest free one goes, with its graphs
            self.storages.remove(min(free, key=lambda s: s.rows * s.capacity))
        storage = self.new_storage(rows, capacity)
        storage.busy = True
        self.storages.append(storage)
        return storage

    def new_storage(self, rows: int, capacity: int) -> Storage:
        return Storage(self.model, rows, capacity)

    def release(self, storage: Storage) -> None:
        storage.busy = False
        storage.released = next(_release_order)

    def width(self, t: int, keep: int, graph: bool = True) -> int:
        """The width a pass of t entries runs at: padded up to WIDTH_BUCKETS where widths are padded, for a pass
        that keeps every entry's logits (a verify or a draft LM's step; an autoregressive step keeps one) and is not
        a prefill; else t."""
        pad = PAD_WIDTHS == "always" or (PAD_WIDTHS == "capture" and self.capture)
        if not (pad and graph and keep == t and t <= MAX_GRAPH_WIDTH):
            return t
        return next(w for w in WIDTH_BUCKETS if w >= t)

    def replay(self, storage: Storage, tokens: torch.Tensor, keep: int, layers: tuple[int, ...] | None,
               graph: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One pass over `tokens` (b, T): a graph replay where it captures (b padded to the ladder, T to the next of
        WIDTH_BUCKETS, at most MAX_GRAPH_WIDTH; `graph` False for a prefill, which runs once), else the same code
        eagerly. A padded pass's extra entries come after the real ones, which never see them (Storage.set_layout),
        and their outputs are dropped. Outputs are the caller's own (copied off a graph, whose next replay
        overwrites its own)."""
        b, t = tokens.shape
        if (width := self.width(t, keep, graph)) > t:
            tokens = torch.cat([tokens, tokens.new_full((b, width - t), PAD)], 1)
            logits, features = self.replay(storage, tokens, width, layers, graph)
            return logits[:, :t], None if features is None else features[:, :t]
        if not (self.capture and graph and t <= MAX_GRAPH_WIDTH):
            storage.input_view(b, t).copy_(tokens)
            return self.run(storage, b, t, keep, layers) if graph else storage.run(b, t, keep, layers)
        bp = padded_batch(b)
        storage.input_view(bp, t)[:b].copy_(tokens)
        done = self._captured(storage, (bp, t, keep, layers))
        if done is None:  # capture failed: this runner now runs eagerly
            return self.run(storage, b, t, keep, layers)
        return done.replay(b)

    def run(self, storage: Storage, b: int, t: int, keep: int, layers: tuple[int, ...] | None,
            offset: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """storage.run, compiled where the runner compiles (--graphs compiled: one trace with dynamic batch and width,
        inductor's fused kernels, which capture as any others). A pass that fails to compile runs uncompiled from then
        on, with one log line saying why."""
        if self.compile:
            try:
                if self.compiled is None:
                    _install_output_hooks(self.model)
                    _allow_recompiles(RECOMPILE_LIMIT)
                    self.compiled = torch.compile(Storage.run, fullgraph=True, dynamic=True, backend=COMPILE_BACKEND)
                return self.compiled(storage, b, t, keep, layers, offset)
            except Exception as exc:  # noqa: BLE001 - the uncompiled pass computes the same
                self.compile = False
                said = " ".join(line.strip() for line in str(exc).splitlines()
                                if line.strip() and not line.startswith("Set TORCH"))  # dynamo's advice
                self.reason = f"its passes did not compile ({type(exc).__name__}: {said[:200]})"
                log.warning("graph runner: passes of %s uncompiled: %s", type(self.model).__name__, self.reason)
        return storage.run(b, t, keep, layers, offset)

    def _captured(self, storage, key: tuple) -> Captured | None:
        """The graph for key (the arguments of _capture after the storage), captured now if new; None once capture
        has failed."""
        if key not in storage.graphs and self.capture:
            try:
                storage.graphs[key] = self._capture(storage, *key)
            except Exception as exc:  # noqa: BLE001 - whatever the forward does under capture, eager still works
                self.capture, self.reason = False, f"its forward did not capture ({type(exc).__name__}: {exc})"[:400]
                log.warning("graph runner: running %s eagerly: %s", type(self.model).__name__, self.reason)
                storage.graphs.clear()
        return storage.graphs.get(key)

    def call(self, storage, key: tuple, b: int, fn, what: str) -> tuple:
        """fn() (device code over the storage's fixed buffers and static inputs, its outputs' first rows those of the b
        rows asked for) as one CUDA graph per key (under the storage's graphs) where this runner captures, replayed;
        else fn() eagerly. One that will not capture runs eagerly from then on, with one log line, and the runner's
        other graphs stay. Returns the first b rows of each output, the caller's own."""
        if self.capture and key not in storage.graphs:
            try:
                storage.graphs[key] = self.record(storage.device, fn, what)
            except CaptureBroken as exc:  # said once, where it broke
                self.capture, self.reason = False, str(exc)
            except Exception as exc:  # noqa: BLE001 - the same code runs eagerly
                storage.graphs[key] = None
                log.warning("graph runner: %s runs eagerly: it did not capture (%s: %s)", what, type(exc).__name__, exc)
        done = storage.graphs.get(key) if self.capture else None
        if done is not None:
            return done.replay(b)
        return tuple(None if o is None else o[:b] for o in fn())

    def _capture(self, storage: Storage, b: int, t: int, keep: int, layers) -> Captured:
        """Capture storage.run for this shape. The runs write only past each row's length, which no row reads, so
        capturing mid-decode changes nothing."""
        return self.record(storage.device, lambda: self.run(storage, b, t, keep, layers), f"a {b} x {t} pass")

    def record(self, device: torch.device, fn, what: str) -> Captured:
        """fn() captured as a CUDA graph in this runner's pool, after warm-up runs on a side stream (as CUDA graphs
        need); its outputs are the tensors the replays overwrite. Counts the graph and the seconds spent.

        A failure inside the capture restores the stream and stops capture for the whole process (CaptureBroken). The
        warm-up runs are not checked for host synchronisations (torch.cuda.set_sync_debug_mode): code may take
        another path while a stream captures (transformers' mask checks do), and such a check would send a pass
        that captures well to the eager path."""
        if _broken:
            raise CaptureBroken(_broken[0])
        start = time.perf_counter()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.current_stream(device)
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                outputs = fn()
        except Exception as exc:
            torch.cuda.set_stream(stream)  # torch.cuda.graph leaves its capture stream current when capture_end raises
            _broken.append(f"capturing {what} failed ({type(exc).__name__}: {str(exc)[:200]}); no graphs from then on")
            log.warning("graph runner: %s", _broken[0])
            raise CaptureBroken(_broken[0]) from exc
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        self.capture_seconds += seconds
        self.graphs += 1
        log.debug("captured %s in %.3fs", what, seconds)
        return Captured(graph, outputs)

    def warm(self, kv: StaticKV, rows: int, widths: Sequence[int], layers: tuple[int, ...] | None = None) -> float:
        """Capture the passes a decode of `rows` rows will run (one graph per width and batch size, down the ladder:
        as rows finish the batch runs as a smaller rung), before it is timed; returns the seconds spent. Nothing to do
        without capture, but where passes are compiled: each width runs once, so compiling stays out of the timing."""
        passes = sorted({self.width(w, w) for w in widths if w <= MAX_GRAPH_WIDTH}, reverse=True)
        if not self.capture:
            if not self.compile:
                return 0.0
            start = time.perf_counter()
            for b in sorted({rows, 1}, reverse=True):  # 1 row is a shape of its own to the compiler
                for t in passes:
                    self.run(kv.storage, b, t, t, layers)  # writes only past each row's length, as a capture does
            return time.perf_counter() - start
        before = self.capture_seconds
        for bp in rungs(rows):  # the largest first: the pool then fits the rest
            for t in passes:
                self._captured(kv.storage, (bp, t, t, layers))
        spent = self.capture_seconds - before
        if spent:
            log.info("graph runner: captured %d graphs (batches %s, widths %s) in %.2fs", self.graphs,
                     ",".join(map(str, rungs(rows))), ",".join(map(str, sorted(set(widths)))), spent)
        return spent

    def describe(self) -> str:
        """One line for the app's machine check and the logs."""
        passes = " of compiled passes" if self.compile else ""
        if self.capture:
            extra = self.reason or capture_broken()
            why = f"; {extra}" if extra else ""
            return f"CUDA graphs{passes} ({self.graphs} captured in {self.capture_seconds:.1f}s{why})"
        return f"static KV cache{', compiled passes' if self.compile else ''}, no graphs ({self.reason})"


def capture_broken() -> str | None:
    """Why no runner in this process captures any more (a capture failed after it began), or None."""
    return _broken[0] if _broken else None


def _allow_recompiles(limit: int) -> None:
    """Let dynamo keep at least `limit` traces of a code object (process-wide: recompile_limit, cache_size_limit in
    older torch)."""
    import torch._dynamo.config as dynamo

    for name in ("recompile_limit", "cache_size_limit"):
        if getattr(dynamo, name, limit) < limit:
            setattr(dynamo, name, limit)


def _install_output_hooks(model) -> None:
    """transformers (5.x) installs the hooks that collect hidden states on the first forward asking for them, under a
    threading lock torch.compile cannot trace (the head's features ask): install them before compiling."""
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:  # a transformers without them collects hidden states another way
        return
    maybe_install_capturing_hooks(getattr(model, "model", model))


def padded_batch(rows: int) -> int:
    """The captured batch size a batch of `rows` runs as: the next rung of BATCH_LADDER (beyond it: itself)."""
    return next((b for b in BATCH_LADDER if b >= rows), rows)


def rungs(rows: int) -> list[int]:
    """The captured batch sizes a batch of `rows` runs as while its rows finish, largest first."""
    top = padded_batch(rows)
    return sorted({b for b in BATCH_LADDER if b <= top} | {top}, reverse=True)


_RUNNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> Runner
_WHY_EAGER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> why the eager engine serves it


def why_not_here(model, mode: str) -> str | None:
    """Why `mode` gives a model on its device no runner at all (None: it may have one)."""
    if mode == "off":
        return "--graphs off"
    dev = execution_device(model)
    if mode == "auto" and dev.type != "cuda":
        return f"the model computes on {dev.type}: graphs are for CUDA (--graphs on runs the static cache uncaptured)"
    return None


def why_not(model, mode: str) -> str | None:
    """Why `mode` gives this causal LM no static runner (None: it can have one)."""
    if (reason := why_not_here(model, mode)) is not None:
        return reason
    if getattr(model, "hf_device_map", None):
        return "a device map spreads the model over devices (offloaded parts stream in at every pass)"
    types = set(getattr(model.config, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"}:
        return f"{type(model).__name__} has {sorted(types)} layers (the static cache is for full attention)"
    if model.config._attn_implementation not in ("sdpa", "eager"):
        return f"attention '{model.config._attn_implementation}' takes no custom mask (sdpa or eager do)"
    if not hasattr(model, "lm_head"):
        return f"{type(model).__name__} has no lm_head"
    return None


def attach(model, mode: str = "auto", kind: type[Runner] = Runner) -> Runner | None:
    """Choose how `model`'s passes run (at load), logging one line: a Runner (captured on CUDA) or None (eager). The
    same mode again keeps what was chosen, and the graphs captured so far. `kind`: another model's runner class (an
    EAGLE-3 head's, drafters.eagle3_static.HeadRunner), whose `refusal` says why a model cannot have one."""
    if mode not in GRAPH_MODES:
        raise ValueError(f"--graphs must be one of {', '.join(GRAPH_MODES)}, not {mode!r}")
    if model in _RUNNERS and _RUNNERS[model].mode == mode:
        return _RUNNERS[model]
    if _WHY_EAGER.get(model, ("",))[0] == mode:
        return None
    reason = kind.refusal(model, mode)
    if reason is not None:
        _RUNNERS.pop(model, None)
        _WHY_EAGER[model] = (mode, reason)
        log.info("graph runner off for %s: %s", type(model).__name__, reason)
        return None
    capture = execution_device(model).type == "cuda"
    runner = kind(model, capture, mode, "" if capture else "the model computes on the CPU")
    runner.compile = mode == "compiled" and kind is Runner  # a target's or draft LM's passes (not a head's)
    _RUNNERS[model] = runner
    _WHY_EAGER.pop(model, None)
    log.info("graph runner on for %s: %s", type(model).__name__, runner.describe())
    return runner


def detach(model) -> None:
    """Back to the eager engine (tests attach and detach a runner around a run)."""
    _RUNNERS.pop(model, None)
    _WHY_EAGER.pop(model, None)


def runner_of(model) -> Runner | None:
    return _RUNNERS.get(model)


def describe(model) -> str:
    """How the model's passes run, in one line: the runner's description, or why the eager engine serves it."""
    runner = runner_of(model)
    if runner is not None:
        return runner.describe()
    return f"eager ({_WHY_EAGER.get(model, ('', 'no runner attached'))[1]})"


def new_kv(model, rows: int, capacity: int) -> BatchKV | StaticKV:
    """A KV cache for a decode of `rows` rows up to `capacity` positions: the model's runner's static storage when it
    has one (release it when done), else the eager engine's BatchKV."""
    runner = runner_of(model)
    if runner is None:
        return BatchKV(model, rows)
    return StaticKV(runner, runner.acquire(rows, capacity), rows)


def release(kv) -> None:
    """Return a static storage to its runner (a BatchKV holds nothing to return)."""
    if isinstance(kv, StaticKV):
        kv.release()
