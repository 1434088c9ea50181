"""The app's event handlers: widget values in, {component: value} dicts out. The runs themselves are the CLI's
(compare.iter_compare, sweep.iter_sweep_summaries); both are computed one after the other, then replayed side by side
at their measured pace. Limits (token cap, model allowlist, device) and the Runtime come from app.py. No layout here.
"""

from __future__ import annotations

import logging
import threading
import time
from bisect import bisect_right
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import gradio as gr
import torch

from . import charts
from .compare import iter_compare, load_pair
from .config import (BUNDLED_ID, DRAFTER_KINDS, MAX_K, MIN_K, PRESETS, TRAINED_DRAFT_ID, GenerationConfig, Runtime,
                     SamplingConfig)
from .engine import GenerationError, StepEvent, encode_prompt
from .hybrid import describe_hybrid_cap
from .loading import BUNDLED_ALIASES, ModelLoadError, TokenizerMismatchError
from .metrics import run_stats
from .render import Segment, event_segments, panel_stats, segments_html
from .sweep import Sweep, iter_sweep_summaries

log = logging.getLogger(__name__)

TEXT_EVERY = 0.1  # seconds between text updates
PLOTS_EVERY = 0.5  # seconds between plot updates
OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
RUN_NAMES = {"ar": "autoregressive", "sd": "speculative"}

Component = Any  # a gradio component; the handlers use it only as a key of the dicts they return


class UserError(ValueError):
    """A request the app refuses; the message says what to change."""


@dataclass(frozen=True)
class AppLimits:
    """Guards for a public deployment, read from the environment by app.py."""

    max_new_tokens: int = 256  # cap on max new tokens
    allowlist: tuple[str, ...] = ()  # model ids users may load (the bundled ones always); empty: any id
    device: str | None = None  # None: CUDA when present, else CPU


# ---- the components the handlers update, built by ui.build_demo; field order is each event's outputs order ----

class _Ordered:
    def order(self) -> list[Component]:
        """The components in field order: the event's outputs list."""
        return [getattr(self, f.name) for f in fields(self)]


@dataclass(frozen=True)
class RaceOutputs(_Ordered):
    """The Race tab, in the /compare event's outputs order (API clients read result_json as outputs[7])."""

    ar_html: Component
    sd_html: Component
    tokens_plot: Component
    speedup_plot: Component
    hist_plot: Component
    stats: Component
    status: Component
    result_json: Component
    segments_state: Component  # the finished run's segments, so hiding rejected drafts needs no new run


@dataclass(frozen=True)
class SweepOutputs(_Ordered):
    """The Tune-k tab, in the /sweep_k event's outputs order."""

    plot: Component
    table: Component  # status line, then the sweep table
    best: Component  # state: the best measured k, for the apply button
    apply: Component  # the "Use best k" button


@dataclass(frozen=True)
class SettingsOutputs:
    """The settings a preset fills (target, drafter, draft) and "Use best k" sets (k)."""

    target: Component
    drafter: Component
    draft: Component
    k: Component


@dataclass(frozen=True)
class Outputs:
    """Everything the handlers update, by tab."""

    race: RaceOutputs
    sweep: SweepOutputs
    settings: SettingsOutputs


# ---- requests ----

@dataclass(frozen=True)
class RunRequest:
    """Widget values for one comparison, as plain data."""

    prompt: str
    target: str
    drafter: str  # one of config.DRAFTER_KINDS
    draft: str | None
    k: int
    dynamic_k: bool
    temperature: float
    top_p: float
    max_new_tokens: int

    def config(self) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=self.max_new_tokens, num_draft_tokens=self.k, dynamic_k=self.dynamic_k,
                                sampling=SamplingConfig(temperature=self.temperature, top_p=self.top_p))


def make_request(prompt, target, drafter, draft, k, dynamic_k, temperature, top_p, max_new_tokens,
                 limits: AppLimits) -> RunRequest:
    """Validate widget (or API) values against the limits; raise UserError with a readable message."""
    if not prompt or not str(prompt).strip():
        raise UserError("The prompt is empty: type something, or pick an example.")
    if drafter not in DRAFTER_KINDS:
        raise UserError(f"Unknown drafter '{drafter}': choose one of {', '.join(DRAFTER_KINDS)}.")
    try:
        k, max_new_tokens = int(k), int(max_new_tokens)
        temperature, top_p = float(temperature), float(top_p)
    except (TypeError, ValueError) as exc:
        raise UserError(f"k, temperature, top-p and max new tokens must be numbers ({exc}).") from exc
    if not MIN_K <= k <= MAX_K:
        raise UserError(f"k must be between {MIN_K} and {MAX_K}, got {k}.")
    if not 1 <= max_new_tokens <= limits.max_new_tokens:
        raise UserError(f"max new tokens must be between 1 and {limits.max_new_tokens} here, got {max_new_tokens}.")
    target = (target or "").strip() or BUNDLED_ID
    draft = ((draft or "").strip() or None) if drafter != "ngram" else None
    for name in (target, draft):
        if name and not allowed(name, limits):
            raise UserError(f"'{name}' is not allowed on this server; allowed: {', '.join(limits.allowlist)} "
                            f"and the bundled {BUNDLED_ID}.")
    request = RunRequest(str(prompt), target, drafter, draft, k, bool(dynamic_k), temperature, top_p, max_new_tokens)
    try:
        request.config().validate()
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    return request


def allowed(name: str, limits: AppLimits) -> bool:
    """Whether a model id may be loaded: always the bundled model and its trained draft."""
    return not limits.allowlist or name in limits.allowlist or name.lower() in BUNDLED_ALIASES | {TRAINED_DRAFT_ID}


def preset_fields(label: str) -> tuple[str, str, str] | None:
    """(target, drafter kind, draft id) of a preset; None for Custom."""
    preset = next((p for p in PRESETS if p.label == label), None)
    if preset is None:
        return None
    return preset.target, preset.drafter or ("ngram" if preset.draft is None else "model"), preset.draft or ""


# ---- the compute steps: wrapped in spaces.GPU on ZeroGPU, so what goes in and comes out is picklable data ----

@dataclass
class Computed:
    """Both runs, finished: events, display segments per event, and the CLI's JSON result."""

    ar_events: list[StepEvent]
    sd_events: list[StepEvent]
    ar_segments: list[list[Segment]]
    sd_segments: list[list[Segment]]
    result: dict = field(default_factory=dict)


def compute(request: RunRequest, limits: AppLimits, runtime: Runtime) -> Iterator[str | Computed]:
    """compare.iter_compare on the request (load, untimed warm-up, AR then SD, never overlapping): status lines,
    then a Computed."""
    label = "prompt lookup" if request.drafter == "ngram" else request.draft or "the default draft"
    label += " + prompt lookup" if request.drafter == "hybrid" else ""
    yield f"Loading {request.target} with {label} (cached after the first load)…"
    pair = load_pair(request.target, request.drafter, request.draft, device=limits.device, runtime=runtime)
    config = request.config()
    prompt_ids = encode_prompt(pair.target.tokenizer, request.prompt, config.use_chat_template)
    yield f"Warming up on {pair.target.device} (untimed)…"
    runs: dict[str, list[StepEvent]] = {"ar": [], "sd": []}
    result, last = {}, 0.0
    with closing(iter_compare(pair, prompt_ids, config)) as steps:  # closing it stops the engine loop
        for which, item in steps:
            if which == "result":
                result = item
                continue
            runs[which].append(item)
            if time.monotonic() - last >= TEXT_EVERY:  # a yield is also where a Stop takes effect
                last = time.monotonic()
                yield f"Timing the {RUN_NAMES[which]} run: {item.num_generated}/{config.max_new_tokens} tokens…"
    tok = pair.target.tokenizer
    yield Computed(runs["ar"], runs["sd"], [event_segments(e, tok, False) for e in runs["ar"]],
                   [event_segments(e, tok, True) for e in runs["sd"]], result)


def sweep_k(request: RunRequest, limits: AppLimits, runtime: Runtime, k_max: int) -> Iterator[str | Sweep]:
    """sweep.iter_sweep_summaries on the current prompt, k = 1..k_max: status lines, then the Sweep after each k."""
    yield f"Loading {request.target}…"
    pair = load_pair(request.target, request.drafter, request.draft, device=limits.device, runtime=runtime)
    config = request.config()
    prompt_ids = encode_prompt(pair.target.tokenizer, request.prompt, config.use_chat_template)
    yield "Timing the autoregressive baseline, then one speculative run per k…"
    yield from iter_sweep_summaries(pair, [prompt_ids], range(MIN_K, k_max + 1), config, k_max)


# ---- the replay and the text around it ----

def replay_frames(ar_times: list[float], sd_times: list[float], pace: bool = True,
                  clock: Callable[[], float] = time.monotonic,
                  sleep: Callable[[float], None] = time.sleep) -> Iterator[tuple[int, int, bool]]:
    """(events of AR shown, events of SD shown, plots due) as each run's events come due at their measured times.

    Text frames come at most every TEXT_EVERY seconds, plot refreshes every PLOTS_EVERY; the last frame shows all.
    """
    end = max(ar_times[-1:] + sd_times[-1:] + [0.0])
    if not pace:
        yield len(ar_times), len(sd_times), True
        return
    start, last_plot, shown = clock(), float("-inf"), None
    while True:
        t = clock() - start
        final = t >= end
        n = (len(ar_times), len(sd_times)) if final else (bisect_right(ar_times, t), bisect_right(sd_times, t))
        if n != shown or final:
            plots = final or t - last_plot >= PLOTS_EVERY
            last_plot = t if plots else last_plot
            shown = n
            yield n[0], n[1], plots
        if final:
            return
        sleep(min(TEXT_EVERY, end - t))


def _points(events: list[StepEvent]) -> charts.Points:
    return [(0.0, 0)] + [(e.elapsed, e.num_generated) for e in events]


def _panel(events: list[StepEvent], segments: list[list[Segment]], n: int, hide_rejected: bool) -> str:
    stats = panel_stats(events[n - 1].num_generated, events[n - 1].elapsed) if n else "waiting for the first token…"
    return segments_html([s for step in segments[:n] for s in step], hide_rejected, stats)


def final_stats_markdown(result: dict) -> str:
    """The summary under the panels: speedup, acceptance, mean accepted length, where the speculative time went."""
    sd, ar = result["sd"], result["ar"]
    spent = max(sd["seconds"], 1e-9)
    prefill = max(sd["seconds"] - sd["draft_seconds"] - sd["verify_seconds"], 0.0)
    same = "identical" if result["identical"] else "different (expected when sampling; see the JSON when greedy)"
    return "\n".join([
        f"**Speedup {result['speedup']:.2f}×** — speculative {sd['tokens_per_s']:.1f} tokens/s vs "
        f"autoregressive {ar['tokens_per_s']:.1f} tokens/s",
        f"- acceptance rate: **{sd['acceptance_rate']:.0%}** ({sd['accepted']} of {sd['drafted']} drafted tokens)",
        f"- mean accepted length: **{sd['mean_accepted']:.2f}** tokens per target pass (bonus/correction included), "
        f"{sd['steps']} target passes",
        f"- speculative time: drafting {sd['draft_seconds']:.2f} s ({sd['draft_seconds'] / spent:.0%}), "
        f"verifying {sd['verify_seconds']:.2f} s ({sd['verify_seconds'] / spent:.0%}), "
        f"prefill {prefill:.2f} s ({prefill / spent:.0%})",
        f"- outputs: {same}; {result['target']} on {result['device']} ({result['dtype']}), "
        f"drafter {result['drafter']} ({result['draft'] or 'prompt lookup'}), k={result['k']}"
        + (" (dynamic)" if result["dynamic_k"] else ""),
    ] + _hybrid_lines(result))


def _hybrid_lines(result: dict) -> list[str]:
    if "hybrid_model_k" not in result:
        return []
    cap = describe_hybrid_cap(result["hybrid_model_k"], result.get("hybrid_verify_costs") or {},
                              result.get("hybrid_draft_cost"))
    return [f"- hybrid: {cap}; prompt lookup up to k where the text repeats"]


def sweep_table(result: Sweep) -> str:
    """Markdown: one line per measured k, then the fitted alpha and c and the theory's best k."""
    lines = ["| k | speedup | acceptance | mean accepted | theory |", "|---|---|---|---|---|"]
    lines += [f"| {p.k} | {p.speedup:.2f}× | {p.acceptance_rate:.0%} | {p.mean_accepted:.2f} | "
              f"{result.theory.get(p.k, 0.0):.2f}× |" for p in result.points]
    lines.append(f"\nFitted α = {result.alpha:.2f} (from mean accepted length), c = {result.c:.3f} (draft cost per "
                 f"token / target cost per token), verify cost per k as measured; theory's best k = {result.best_k}.")
    return "\n".join(lines)


def friendly_error(exc: Exception) -> str:
    """A one-paragraph message for the status line."""
    if isinstance(exc, OOM):
        return f"Out of memory: {exc}. Try a smaller model pair or fewer new tokens."
    if isinstance(exc, TokenizerMismatchError):
        return f"Tokenizer mismatch: {exc}"
    if isinstance(exc, ModelLoadError):
        return f"Could not load the model: {exc}"
    return str(exc)


KNOWN_ERRORS = (UserError, ModelLoadError, TokenizerMismatchError, GenerationError, ValueError, OOM)


def _hold(lock: threading.Lock) -> Iterator[str]:
    """Wait for the hardware, yielding so a Stop can end the wait."""
    while not lock.acquire(timeout=0.25):
        yield "Waiting for another run to finish: timed runs never share the hardware…"


# ---- the handlers ----

class Handlers:
    """The app's event handlers; they share one hardware lock so timed runs never overlap.

    Each returns or yields {component: value} for components of `outputs` that its event lists; the ones it leaves
    out keep their value.
    """

    def __init__(self, outputs: Outputs, limits: AppLimits = AppLimits(), runtime: Runtime = Runtime(),
                 gpu: Callable | None = None):
        self.outputs = outputs
        self.limits = limits
        self.runtime = runtime
        self.hardware = threading.Lock()
        # spaces.GPU (ZeroGPU) wraps only the compute steps; the replay runs without holding a GPU
        self.compute_step = gpu(compute) if gpu else compute
        self.sweep_step = gpu(sweep_k) if gpu else sweep_k

    def run_compare(self, prompt, target, drafter, draft, k, dynamic_k, temperature, top_p, max_new_tokens,
                    hide_rejected, replay=True) -> Iterator[dict]:
        """The main run (API: /compare): validate, wait for the hardware, compute both runs, replay them."""
        out = self.outputs.race
        try:
            request = make_request(prompt, target, drafter, draft, k, dynamic_k, temperature, top_p,
                                   max_new_tokens, self.limits)
            yield from ({out.status: s} for s in _hold(self.hardware))
            try:
                done = None
                with closing(self.compute_step(request, self.limits, self.runtime)) as steps:
                    for item in steps:
                        if isinstance(item, Computed):
                            done = item
                        else:
                            yield {out.status: item}
            finally:
                self.hardware.release()
        except KNOWN_ERRORS as exc:
            gr.Warning(friendly_error(exc))
            yield self._error(friendly_error(exc))
            return
        except Exception as exc:  # the app keeps serving; the log has the traceback
            log.exception("run failed")
            gr.Warning(f"Unexpected error: {exc}")
            yield self._error(f"Unexpected error: {exc}")
            return
        for n_ar, n_sd, plots in replay_frames([e.elapsed for e in done.ar_events],
                                               [e.elapsed for e in done.sd_events], pace=bool(replay)):
            yield self._frame(done, n_ar, n_sd, plots, hide_rejected)

    def _error(self, text: str) -> dict:
        out = self.outputs.race
        return {out.status: f"**Error:** {text}", out.result_json: {"error": text}}

    def _frame(self, done: Computed, n_ar: int, n_sd: int, plots: bool, hide_rejected: bool) -> dict:
        """One replay frame: the first n_ar / n_sd events of each run; plots when due; the summary at the end."""
        out = self.outputs.race
        final = n_ar == len(done.ar_events) and n_sd == len(done.sd_events)
        frame = {out.ar_html: _panel(done.ar_events, done.ar_segments, n_ar, False),
                 out.sd_html: _panel(done.sd_events, done.sd_segments, n_sd, hide_rejected),
                 out.status: "Done. Replayed at the measured pace." if final else
                 "Replaying both runs at their measured pace…"}
        if plots:
            ar, sd = _points(done.ar_events)[: n_ar + 1], _points(done.sd_events)[: n_sd + 1]
            hist = (done.result["sd"]["accepted_histogram"] if final
                    else run_stats(done.sd_events[:n_sd]).accepted_histogram)
            frame |= {out.tokens_plot: charts.tokens_vs_time(ar, sd), out.speedup_plot: charts.running_speedup(ar, sd),
                      out.hist_plot: charts.accepted_histogram(hist)}
        if final:
            frame |= {out.stats: final_stats_markdown(done.result), out.result_json: done.result,
                      out.segments_state: done.sd_segments}
        return frame

    def rerender(self, segments, hide_rejected, current) -> dict:
        """Show or hide rejected drafts in the finished speculative panel without running again."""
        out = self.outputs.race
        if not segments:
            return {out.sd_html: gr.skip()}
        head = current.split('<div class="tok-panel', 1)[0] if current else ""
        return {out.sd_html: head + segments_html([s for step in segments for s in step], hide_rejected)}

    def stop_race(self) -> dict:
        return {self.outputs.race.status: "Stopped."}

    def run_sweep(self, prompt, target, drafter, draft, k_max, temperature, top_p, max_new_tokens) -> Iterator[dict]:
        """The Tune-k tab (API: /sweep_k): sweep k = 1..k_max on the current prompt; measured and expected speedup."""
        out = self.outputs.sweep
        try:
            request = make_request(prompt, target, drafter, draft, MIN_K, False, temperature, top_p,
                                   max_new_tokens, self.limits)
            k_max = int(k_max)
            if not MIN_K <= k_max <= MAX_K:
                raise UserError(f"the largest k must be between {MIN_K} and {MAX_K}, got {k_max}")
        except KNOWN_ERRORS as exc:
            yield {out.table: f"**Error:** {friendly_error(exc)}"}
            return
        yield from ({out.table: s} for s in _hold(self.hardware))
        try:
            result = None
            with closing(self.sweep_step(request, self.limits, self.runtime, k_max)) as steps:
                for item in steps:
                    if isinstance(item, str):
                        yield {out.table: item}
                        continue
                    result = item
                    best = result.best_measured_k
                    fig = charts.k_sweep([asdict(p) for p in result.points], sorted(result.theory.items()), best,
                                         result.best_k)
                    yield {out.plot: fig, out.table: f"Measured k = {result.points[-1].k} of {k_max}…\n\n"
                           + sweep_table(result), out.best: best,
                           out.apply: gr.update(value=f"Use k = {best}", interactive=True)}
            yield {out.table: f"Done: best measured k = {result.best_measured_k}.\n\n" + sweep_table(result),
                   out.best: result.best_measured_k}
        except KNOWN_ERRORS as exc:
            gr.Warning(friendly_error(exc))
            yield {out.table: f"**Error:** {friendly_error(exc)}"}
        finally:
            self.hardware.release()

    def stop_sweep(self) -> dict:
        return {self.outputs.sweep.table: "Stopped."}

    def apply_preset(self, label: str) -> dict:
        """Fill target, drafter and draft from a preset; Custom leaves them alone."""
        out = self.outputs.settings
        values = preset_fields(label)
        if values is None:
            return {out.target: gr.skip()}
        return dict(zip((out.target, out.drafter, out.draft), values))

    def apply_best_k(self, best) -> dict:
        """Set k to the sweep's best measured k."""
        return {self.outputs.settings.k: best if best else gr.skip()}


# ---- the Batch tab (issue 30): batch_sweep.sweep_batches on several prompts; its own outputs and handlers ----

BATCH_NOTE = (
    "**Why the curve bends.** Decoding one sequence leaves most of the hardware idle: each step reads every weight "
    "to produce one token, so checking k + 1 tokens in one pass costs little more than checking one, and speculation "
    "turns that spare compute into tokens. A batch spends the same spare compute: B rows share one read of the "
    "weights. As B grows the target pass turns from memory-bound to compute-bound, a B × (k + 1) verify pass costs "
    "nearly k + 1 times a B × 1 pass, and every rejected draft is paid for in full. Past the crossover speculation "
    "lowers throughput, which is why serving engines turn it down as the batch grows. A small CPU runs out of spare "
    "compute at a few rows; a GPU much later."
)
BATCH_SIZES = (1, 2, 4, 8, 16)  # the tab's batch sizes: powers of two up to the largest one asked for
BATCH_MAX_PROMPTS = 64


@dataclass(frozen=True)
class BatchOutputs(_Ordered):
    """The Batch tab, in its sweep event's outputs order."""

    throughput_plot: Component
    speedup_plot: Component
    table: Component  # status line, then one row per batch size


def make_batch_request(prompts_text, use_examples, examples, target, drafter, draft, k, auto_k, temperature, top_p,
                       new_tokens, largest, anchors, limits: AppLimits):
    """Validate the Batch tab's values (make_request's rules for the shared ones) into a batch_sweep.BatchRequest."""
    from .batch_sweep import BatchRequest

    prompts = list(examples) if use_examples else [p.strip() for p in str(prompts_text or "").splitlines() if p.strip()]
    if not prompts:
        raise UserError("No prompts: type one prompt per line, or use the examples.")
    if len(prompts) > BATCH_MAX_PROMPTS:
        raise UserError(f"At most {BATCH_MAX_PROMPTS} prompts here, got {len(prompts)}.")
    single = make_request(prompts[0], target, drafter, draft, k, False, temperature, top_p, new_tokens, limits)
    try:
        largest = int(largest)
    except (TypeError, ValueError) as exc:
        raise UserError(f"the largest batch size must be one of {BATCH_SIZES} ({exc})") from exc
    if largest not in BATCH_SIZES:
        raise UserError(f"the largest batch size must be one of {BATCH_SIZES}, got {largest}")
    sizes = tuple(b for b in BATCH_SIZES if b <= largest)
    return BatchRequest(single.target, single.drafter, single.draft, tuple(prompts), sizes,
                        None if auto_k else single.k, single.config(), bool(anchors))


def batch_table(sweep) -> str:
    """Markdown: one line per measured batch size, then where speculation stops paying."""
    lines = ["| batch size | AR tok/s | SD tok/s | speedup | k (auto k) | mean accepted | verify cost | AR / generate |",
             "|---|---|---|---|---|---|---|---|"]
    for p in sweep.points:
        base = f"{p.ar_vs_hf_generate:.2f}" if p.ar_vs_hf_generate is not None else "–"
        lines.append(f"| {p.batch_size} | {p.ar_tokens_per_s:.1f} | {p.sd_tokens_per_s:.1f} | {p.speedup:.2f}× | "
                     f"{p.k} ({p.auto_k}) | {p.mean_accepted:.2f} | {p.verify_cost:.2f} | {base} |")
    cross = sweep.crossover
    lines.append("\n" + (f"Speculation stops paying at batch size **{cross}** on this machine." if cross is not None
                         else "Speculation pays at every batch size measured here."))
    return "\n".join(lines)


class BatchHandlers:
    """The Batch tab's handlers; they share the app's hardware lock, so no timed run overlaps another."""

    def __init__(self, outputs: BatchOutputs, examples: list[str], hardware: threading.Lock,
                 limits: AppLimits = AppLimits(), runtime: Runtime = Runtime(), gpu: Callable | None = None):
        from .batch_sweep import sweep_batches

        self.outputs, self.examples, self.hardware = outputs, list(examples), hardware
        self.limits, self.runtime = limits, runtime
        self.step = gpu(sweep_batches) if gpu else sweep_batches

    def run(self, prompts_text, use_examples, target, drafter, draft, k, auto_k, temperature, top_p, new_tokens,
            largest, anchors) -> Iterator[dict]:
        """Sweep the batch sizes: throughput and speedup against batch size, crossover marked."""
        out = self.outputs
        try:
            request = make_batch_request(prompts_text, use_examples, self.examples, target, drafter, draft, k,
                                         auto_k, temperature, top_p, new_tokens, largest, anchors, self.limits)
        except KNOWN_ERRORS as exc:
            yield {out.table: f"**Error:** {friendly_error(exc)}"}
            return
        yield from ({out.table: s} for s in _hold(self.hardware))
        try:
            with closing(self.step(request, self.limits.device, self.runtime)) as steps:
                for item in steps:
                    if isinstance(item, str):
                        yield {out.table: item}
                        continue
                    points = [p.as_dict() for p in item.points]
                    done = len(item.points) == len(request.batch_sizes)
                    yield {out.throughput_plot: charts.batch_throughput(points, item.crossover),
                           out.speedup_plot: charts.batch_speedup(points, item.crossover),
                           out.table: ("Done." if done else f"Measured batch size {item.points[-1].batch_size}…")
                           + "\n\n" + batch_table(item)}
        except KNOWN_ERRORS as exc:
            gr.Warning(friendly_error(exc))
            yield {out.table: f"**Error:** {friendly_error(exc)}"}
        except Exception as exc:  # the app keeps serving; the log has the traceback
            log.exception("batch sweep failed")
            yield {out.table: f"**Error:** unexpected: {exc}"}
        finally:
            self.hardware.release()

    def stop(self) -> dict:
        return {self.outputs.table: "Stopped."}
