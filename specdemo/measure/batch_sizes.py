"""The batch-size sweep: batched autoregressive and speculative decoding, and transformers' generate on the same
padded batch, at each batch size; the measured costs behind auto k; the batch size where speculation stops paying.

Shared by `python -m specdemo bench --batch-size ...` and the app's Batch tab. How prompts form batches: every batch
size runs the same rows, the prompt set in order cut to a whole number of the largest batch (cycled when the set is
smaller than that batch), B at a time, so no batch is partial and every size sees the same prompts. Runs never
overlap: per batch, autoregressive, then generate, then speculative. No UI, no text.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace

import torch

from ..config import AUTO_K_MAX, GenerationConfig
from ..drafters import Drafter
from ..drafters.base import SharedState
from ..engine import decode, eos_ids, row_outputs
from ..engine.kv import left_padded
from ..engine.timing import cost_widths, forward_seconds, timed_call, verify_costs
from .compare import WARMUP_TOKENS, Pair, first_mismatch, pair_placement, warmup
from .metrics import (
    BatchStats,
    alpha_from_mean_accepted,
    batch_stats,
    best_k,
    expected_speedup,
    ratio,
)

PROBE_K = 4  # k of the short speculative run that measures acceptance and draft cost for auto k
PROBE_TOKENS = 24
@dataclass
class BatchRun:
    """One decoder over one batch: each row's new tokens and the wall time around the whole call."""

    outputs: list[list[int]]
    seconds: float
    stats: BatchStats | None = None  # our decoders only

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


def run_batch_ar(pair: Pair, rows: Sequence[list[int]], config: GenerationConfig) -> BatchRun:
    """Our batched autoregressive decoder."""
    t = pair.target
    events, seconds = timed_call(lambda: list(decode(t.model, t.tokenizer, rows, config, text=False)), t.device)
    return BatchRun(row_outputs(events, len(rows)), seconds, batch_stats(events))


def run_batch_sd(pair: Pair, drafter: Drafter, rows: Sequence[list[int]], config: GenerationConfig,
                 k_policy: Callable[[int], int] | None = None) -> BatchRun:
    """Our batched speculative decoder (k from config, or from k_policy at every step)."""
    t = pair.target
    events, seconds = timed_call(
        lambda: list(decode(t.model, t.tokenizer, rows, config, drafter, k_policy=k_policy, text=False)), t.device)
    return BatchRun(row_outputs(events, len(rows)), seconds, batch_stats(events))


def hf_generate_batch(model, rows: Sequence[list[int]], kwargs: dict, eos: frozenset[int], seed: int = 0) -> BatchRun:
    """transformers' generate on the same left-padded batch (the honest baseline): each row's tokens up to and
    including its first EOS, and the wall time with the engine's clock."""
    device = next(model.parameters()).device
    tokens, real = left_padded(rows, device)
    tokens = tokens.masked_fill(~real, kwargs["pad_token_id"])
    torch.manual_seed(seed)
    with torch.inference_mode():
        out, seconds = timed_call(lambda: model.generate(input_ids=tokens, attention_mask=real.long(), **kwargs),
                                  device)
    outputs = []
    for row in out[:, tokens.shape[1]:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        outputs.append(row[:end])
    return BatchRun(outputs, seconds)


def shared_rows(prompt_ids: Sequence[list[int]], batch_sizes: Sequence[int]) -> list[list[int]]:
    """The rows every batch size runs: the prompts in order, cut to a multiple of the largest batch size, or cycled
    up to one such batch when there are fewer prompts."""
    if not prompt_ids:
        raise ValueError("no prompts to batch")
    largest = max(batch_sizes)
    n = max(largest, len(prompt_ids) // largest * largest)
    return [list(prompt_ids[i % len(prompt_ids)]) for i in range(n)]


def batches(rows: Sequence[list[int]], size: int) -> list[list[list[int]]]:
    """Consecutive groups of `size` rows (shared_rows makes them all full)."""
    return [list(rows[i:i + size]) for i in range(0, len(rows), size)]


@dataclass
class Calibration:
    """What auto k reads at one batch size: the verify cost by k from the batched micro-benchmark, and the acceptance
    and draft cost of a short probe run."""

    batch_size: int
    verify_costs: dict[int, float]  # k -> a B x (k+1) target pass over a B x 1 pass
    one_pass_seconds: float  # a B x 1 target pass
    alpha: float  # metrics.alpha_from_mean_accepted of the probe's mean accepted length at PROBE_K
    c: float  # the probe's drafting seconds per sequential draft position over one_pass_seconds
    k: int  # metrics.best_k with min_k = 0: 0 means no speculation
    expected_speedup: float

    def as_dict(self) -> dict:
        out = asdict(self)
        out["verify_costs"] = {str(k): v for k, v in self.verify_costs.items()}
        return out


def calibrate(pair: Pair, drafter: Drafter, rows: Sequence[list[int]], config: GenerationConfig,
              k_max: int = AUTO_K_MAX) -> Calibration:
    """Measure one batch size's costs on `rows` (one batch) and choose k from them (untimed for the figures)."""
    model = pair.target.model
    seconds = forward_seconds(model, rows, cost_widths(k_max), repeats=3)
    costs = verify_costs(seconds, k_max)
    probe = replace(config, max_new_tokens=min(config.max_new_tokens, PROBE_TOKENS), num_draft_tokens=PROBE_K,
                    dynamic_k=False)
    stats = run_batch_sd(pair, drafter, rows, probe).stats
    alpha = alpha_from_mean_accepted(stats.mean_accepted, PROBE_K) if stats.row_steps else 0.0
    c = stats.draft_seconds / stats.draft_positions / seconds[1] if stats.draft_positions else 0.0
    k = best_k(alpha, c, k_max, costs, min_k=0)
    expected = expected_speedup(alpha, c, k, costs.get(k, 1.0)) if k else 1.0
    return Calibration(len(rows), costs, seconds[1], alpha, c, k, expected)


@dataclass
class BatchPoint:
    """One batch size, pooled over its batches: the bench.json `by_batch_size` entry."""

    batch_size: int
    batches: int
    rows: int
    k: int  # k the speculative runs used (0: no speculation)
    auto_k: int  # what auto k chose here from the measured costs
    ar_tokens: int
    ar_seconds: float
    sd_tokens: int
    sd_seconds: float
    ar_tokens_per_s: float  # all rows' tokens over the wall seconds of every batch's run
    sd_tokens_per_s: float
    speedup: float  # sd_tokens_per_s / ar_tokens_per_s
    mean_accepted: float  # tokens per row per verify pass, bonus/correction included
    acceptance_rate: float
    identical_fraction: float  # rows whose speculative tokens equal their batched autoregressive tokens
    verify_cost: float  # micro-benchmark: a B x (k+1) target pass over a B x 1 pass, at the k used
    verify_cost_measured: float  # in the runs: seconds per speculative step over seconds per autoregressive step
    expected_speedup: float  # theory at the auto k (Calibration)
    calibration: dict = field(default_factory=dict)
    identical_to_single_fraction: float | None = None  # rows equal to their batch-1 autoregressive run (if measured)
    hf_generate_tokens_per_s: float | None = None
    ar_vs_hf_generate: float | None = None  # our batched AR tok/s over generate's on the same padded batches
    hf_generate_identical_fraction: float | None = None
    mismatch_top2_logit_gaps: list[float] = field(default_factory=list)  # greedy SD vs AR, at the first difference

    def as_dict(self) -> dict:
        return asdict(self)


def _per_pass(runs: Sequence[BatchRun]) -> float:
    return ratio(sum(r.stats.pass_seconds for r in runs), sum(r.stats.passes for r in runs))


def point(batch_size: int, k: int, cal: Calibration, ar: Sequence[BatchRun], sd: Sequence[BatchRun],
          hf: Sequence[BatchRun] = (), single: Sequence[list[int]] | None = None,
          gaps: Sequence[float] = ()) -> BatchPoint:
    """Pool one batch size's runs (ar[i], sd[i] and hf[i] ran the same batch; single: each row's batch-1 output)."""
    ar_s, sd_s = sum(r.seconds for r in ar), sum(r.seconds for r in sd)
    ar_tok, sd_tok = sum(r.tokens for r in ar), sum(r.tokens for r in sd)
    stats = [r.stats for r in sd]
    row_steps = sum(s.row_steps for s in stats)
    ar_out = [o for r in ar for o in r.outputs]
    sd_out = [o for r in sd for o in r.outputs]
    out = BatchPoint(
        batch_size=batch_size, batches=len(ar), rows=len(ar_out), k=k, auto_k=cal.k,
        ar_tokens=ar_tok, ar_seconds=ar_s, sd_tokens=sd_tok, sd_seconds=sd_s,
        ar_tokens_per_s=ratio(ar_tok, ar_s), sd_tokens_per_s=ratio(sd_tok, sd_s),
        speedup=ratio(ratio(sd_tok, sd_s), ratio(ar_tok, ar_s)),
        mean_accepted=ratio(sum(s.mean_accepted * s.row_steps for s in stats), row_steps),
        acceptance_rate=ratio(sum(s.accepted for s in stats), sum(s.drafted for s in stats)),
        identical_fraction=ratio(sum(a == b for a, b in zip(ar_out, sd_out)), len(ar_out)),
        verify_cost=cal.verify_costs.get(k, 1.0) if k else 1.0,
        verify_cost_measured=ratio(_per_pass(sd), _per_pass(ar)),
        expected_speedup=cal.expected_speedup, calibration=cal.as_dict(),
        mismatch_top2_logit_gaps=list(gaps),
    )
    if single is not None:
        common = min(len(single), len(sd_out))  # with max_batches, sizes ran different numbers of rows
        out.identical_to_single_fraction = ratio(sum(a == b for a, b in zip(single, sd_out)), common)
    if hf:
        hf_out = [o for r in hf for o in r.outputs]
        out.hf_generate_tokens_per_s = ratio(sum(r.tokens for r in hf), sum(r.seconds for r in hf))
        out.ar_vs_hf_generate = ratio(out.ar_tokens_per_s, out.hf_generate_tokens_per_s)
        out.hf_generate_identical_fraction = ratio(sum(a == b for a, b in zip(ar_out, hf_out)), len(ar_out))
    return out


def _pays(p: BatchPoint) -> float:
    """The speedup that says whether speculation pays at p: at k = 0 (auto k turned speculation off there) both runs
    do the same work, so their measured ratio is only the run's noise, and the answer is 1 (it no longer pays)."""
    return 1.0 if p.k == 0 else p.speedup


def _stopped_paying(p: BatchPoint) -> bool:
    return p.k == 0 or p.speedup < 1.0


def crossover(points: Sequence[BatchPoint]) -> int | None:
    """The smallest measured batch size at which speculation no longer pays (speedup below 1, or auto k chose no
    speculation); None if it pays at every measured size."""
    return next((p.batch_size for p in sorted(points, key=lambda p: p.batch_size) if _stopped_paying(p)), None)


def crossover_interpolated(points: Sequence[BatchPoint]) -> float | None:
    """Where the speedup curve reaches 1, linear in log2(batch size) between the two measured sizes around it (the
    smallest size, if speculation does not pay there already)."""
    ps = sorted(points, key=lambda p: p.batch_size)
    i = next((i for i, p in enumerate(ps) if _stopped_paying(p)), None)
    if i is None:
        return None
    if i == 0:
        return float(ps[0].batch_size)
    a, b = ps[i - 1], ps[i]
    t = (_pays(a) - 1.0) / (_pays(a) - _pays(b)) if _pays(a) != _pays(b) else 1.0
    return 2 ** (math.log2(a.batch_size) + t * (math.log2(b.batch_size) - math.log2(a.batch_size)))


@dataclass
class BatchSweep:
    """Every batch size measured so far, and where speculation stops paying."""

    points: list[BatchPoint]
    k_arg: str  # "auto" or the fixed k
    placement: dict = field(default_factory=dict)  # compare.pair_placement: where the target's parts and the draft live

    @property
    def crossover(self) -> int | None:
        return crossover(self.points)

    def as_dict(self) -> dict:
        """bench.json's `by_batch_size` (keys are batch sizes as strings) and `crossover_batch_size`."""
        return {"by_batch_size": {str(p.batch_size): p.as_dict() for p in self.points},
                "crossover_batch_size": self.crossover,
                "crossover_batch_size_interpolated": crossover_interpolated(self.points),
                "auto_k_by_batch_size": {str(p.batch_size): p.auto_k for p in self.points}}


def warm(pair: Pair, drafter: Drafter, rows: Sequence[list[int]], config: GenerationConfig, k: int,
         anchors: bool, hf_kwargs: dict | None) -> None:
    """Untimed short runs of every decoder at this batch shape (compare.warmup, and generate's), so first-call costs
    land on no clock."""
    warmup(replace(pair, drafter=drafter), rows, replace(config, num_draft_tokens=max(k, 1)))
    if anchors and hf_kwargs is not None:
        model, tok = pair.target.model, pair.target.tokenizer
        hf_generate_batch(model, rows, {**hf_kwargs, "max_new_tokens": WARMUP_TOKENS}, eos_ids(model, tok))


def iter_batch_sweep(pair: Pair, prompt_ids: Sequence[list[int]], batch_sizes: Sequence[int],
                     config: GenerationConfig, k: int | None = None, anchors: bool = False, k_max: int = AUTO_K_MAX,
                     on_run: Callable[[str, int, int], None] | None = None,
                     max_batches: int | None = None) -> Iterator[BatchSweep]:
    """Calibrate every batch size (costs and auto k), then time each one: per batch, our autoregressive run, then
    generate (with anchors), then our speculative run at k (None: auto k, chosen per step for the rows still
    decoding). Yields the sweep after each batch size. on_run(kind, batch_size, batch index) follows every run.
    max_batches: at most that many batches per size (the first ones), so that small sizes on a GPU, where a pass
    costs about the same at any batch size, do not run the whole set one row at a time."""
    from .bench.anchors import hf_kwargs as make_hf_kwargs

    sizes = sorted(set(int(b) for b in batch_sizes))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"batch sizes must be positive integers, got {list(batch_sizes)}")
    rows = shared_rows(prompt_ids, sizes)
    model, tok = pair.target.model, pair.target.tokenizer
    eos = eos_ids(model, tok)
    hf_kw = make_hf_kwargs(config.sampling, config.max_new_tokens, sorted(eos)) if anchors else None
    drafter = pair.drafter
    where = pair_placement(pair)
    calibrations = {}
    for b in sizes:
        first = batches(rows, b)[0]
        warm(pair, drafter, first, config, PROBE_K, False, None)
        calibrations[b] = calibrate(pair, drafter, first, config, k_max)
        if on_run:
            on_run("calibrate", b, 0)
    auto = AutoK({b: c.k for b, c in calibrations.items()})
    points: list[BatchPoint] = []
    single: list[list[int]] | None = None
    for b in sizes:
        k_b = auto(b) if k is None else k
        policy = auto if k is None else None
        sd_config = replace(config, num_draft_tokens=max(k_b, 1), dynamic_k=config.dynamic_k and k is not None)
        warm(pair, drafter, batches(rows, b)[0], config, k_b, anchors, hf_kw)
        ar_runs, sd_runs, hf_runs = [], [], []
        for i, group in enumerate(batches(rows, b)[:max_batches]):
            ar_runs.append(run_batch_ar(pair, group, config))
            if hf_kw is not None:
                hf_runs.append(hf_generate_batch(model, group, hf_kw, eos, config.seed))
            sd_runs.append(run_batch_sd(pair, drafter, group, sd_config, policy))
            if on_run:
                on_run("run", b, i)
        ar_out = [o for r in ar_runs for o in r.outputs]
        sd_out = [o for r in sd_runs for o in r.outputs]
        gaps = []
        if config.sampling.greedy:
            for prompt, a, s in zip(rows, ar_out, sd_out):
                mismatch = first_mismatch(pair.target, prompt, a, s) if a != s else None
                if mismatch:  # None also where one output is a prefix of the other (never under the same rules)
                    gaps.append(mismatch["top2_logit_gap"])
        if b == 1:
            single = ar_out  # rows in order; zip in point() compares the rows both sizes ran
        points.append(point(b, k_b, calibrations[b], ar_runs, sd_runs, hf_runs, single, gaps))
        yield BatchSweep(list(points), "auto" if k is None else str(k), where)


# ---- the app's Batch tab: one request in, status lines and the sweep so far out (picklable, for spaces.GPU) ----

@dataclass(frozen=True)
class BatchRequest:
    """What the Batch tab asks for, as plain data (validated by the handler)."""

    target: str
    drafter: str  # a registry kind's name
    draft: str | None
    prompts: tuple[str, ...]
    batch_sizes: tuple[int, ...]
    k: int | None  # None: auto k per batch size
    config: GenerationConfig
    anchors: bool = False  # also time generate on the same padded batches (the baseline check)


def sweep_batches(request: BatchRequest, device: str | None = None, runtime=None, placement=None,
                  draft_device: str | None = None, loading: str = "", shared: SharedState | None = None
                  ) -> Iterator[str | BatchSweep]:
    """Load the pair (the target under `placement`'s device map when it names one, the draft on draft_device), then
    iter_batch_sweep: a status line before each phase, then the BatchSweep after each size. `loading` adds to the
    loading line (the app's memory estimate). The drafter keeps its cross-request state in `shared` (None: none kept)
    and adds nothing to it: every batch size decodes the same prompts, so none may draft from another's answers."""
    from ..config import Placement, Runtime
    from ..engine import encode_prompt
    from .compare import load_pair

    yield f"Loading {request.target} (cached after the first load)…" + (f" {loading}" if loading else "")
    pair = load_pair(request.target, request.drafter, request.draft, device=device, draft_device=draft_device,
                     runtime=runtime or Runtime(), placement=placement or Placement(), shared=shared)
    ids = [encode_prompt(pair.target.tokenizer, p, request.config.use_chat_template) for p in request.prompts]
    yield (f"Measuring pass costs and acceptance at batch sizes {', '.join(map(str, request.batch_sizes))} "
           f"(untimed), then timing each size: autoregressive, then speculative, never at once…")
    with pair.drafter.paused():
        yield from iter_batch_sweep(pair, ids, request.batch_sizes, request.config, request.k, request.anchors)


@dataclass(frozen=True)
class AutoK:
    """k by batch size, chosen from measured costs (calibrate, above): a KPolicy for engine.decode.

    Between measured batch sizes it takes the largest measured one not above the current size (the smallest if none),
    so as rows finish and the batch shrinks, k follows."""

    by_batch_size: dict[int, int]

    def __call__(self, batch_size: int) -> int:
        sizes = sorted(self.by_batch_size)
        below = [b for b in sizes if b <= batch_size]
        return self.by_batch_size[below[-1] if below else sizes[0]]
