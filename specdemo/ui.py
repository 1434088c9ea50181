"""The Gradio app. Handlers map widgets to compare.stream_pair: both runs are computed one after the other, then
replayed side by side at their measured pace. Limits (token cap, model allowlist, device) come from the caller.
"""

from __future__ import annotations

import logging
import threading
import time
from bisect import bisect_right
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import asdict, dataclass, field

import gradio as gr
import torch

from . import charts
from .compare import load_pair, result_dict, stream_pair, trained_draft_path, warmup
from .config import BUNDLED_ID, DRAFTER_KINDS, MAX_K, MIN_K, PRESETS, TRAINED_DRAFT_ID, GenerationConfig, SamplingConfig
from .hybrid import describe_hybrid_cap
from .engine import GenerationError, StepEvent, encode_prompt
from .loading import BUNDLED_ALIASES, ModelLoadError, TokenizerMismatchError
from .metrics import run_stats
from .render import CSS, Segment, event_segments, legend_html, panel_stats, segments_html
from .sweep import Sweep, SweepPoint, iter_sweep, summarize

log = logging.getLogger(__name__)

TEXT_EVERY = 0.1  # seconds between text updates
PLOTS_EVERY = 0.5  # seconds between plot updates
CUSTOM = "Custom (type the ids below)"
OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)

TIMING_NOTE = (
    "**How the timing works.** The autoregressive run is computed first, then the speculative run, never at the "
    "same time, after a short untimed warm-up; each clock counts only that run's own compute. Both runs are then "
    "replayed side by side at their measured pace, so the race you watch is the real one. Runs from different "
    "users queue for the hardware rather than share it."
)

EXAMPLES = [  # (category, prompt): prompts written for this app
    ("summarize", "Summarize the following paragraph in two sentences:\n\nThe city council met on Tuesday to discuss "
     "the new bike lane proposal. Supporters argued that protected lanes along Main Street would reduce accidents and "
     "encourage commuters to leave their cars at home. Shop owners worried that removing forty parking spaces would "
     "hurt business during the holiday season. After three hours of debate, the council voted to build the lanes but "
     "to delay construction until February."),
    ("rewrite", "Rewrite this note so it sounds friendly but professional. Keep every fact:\n\nhey, the report you "
     "sent is missing the march numbers again. i need them by friday or the budget meeting is pointless. also the "
     "chart on page 4 has the wrong labels on the axes. fix it."),
    ("code", "Write a Python function `chunk(items, size)` that splits a list into consecutive chunks of the given "
     "size. Include a docstring and two doctest examples."),
    ("structured output", 'Convert this list into a JSON array of objects with the keys "name", "city" and "age":\n\n'
     "Alice, Paris, 31\nBob, Berlin, 45\nChen, Shanghai, 28\nDana, Toronto, 39\nEmeka, Lagos, 52"),
    ("open chat", "What are some good habits for staying focused while working from home?"),
    ("creative", "Write a short poem about a lighthouse keeper who befriends a seagull."),
]


class UserError(ValueError):
    """A request the app refuses; the message says what to change."""


@dataclass(frozen=True)
class AppLimits:
    """Guards for a public deployment, read from the environment by app.py."""

    max_new_tokens: int = 256  # cap on max new tokens
    allowlist: tuple[str, ...] = ()  # model ids users may load (the bundled ones always); empty: any id
    device: str | None = None  # None: CUDA when present, else CPU


@dataclass(frozen=True)
class RunRequest:
    """Widget values for one comparison, as plain data."""

    prompt: str
    target: str
    drafter: str  # "model", "ngram" or "hybrid"
    draft: str | None
    k: int
    dynamic_k: bool
    temperature: float
    top_p: float
    max_new_tokens: int

    def config(self) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=self.max_new_tokens, num_draft_tokens=self.k, dynamic_k=self.dynamic_k,
                                sampling=SamplingConfig(temperature=self.temperature, top_p=self.top_p))


@dataclass
class Computed:
    """Both runs, finished: events, display segments per event, and the CLI's JSON result."""

    ar_events: list[StepEvent]
    sd_events: list[StepEvent]
    ar_segments: list[list[Segment]]
    sd_segments: list[list[Segment]]
    result: dict = field(default_factory=dict)


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


def compute(request: RunRequest, limits: AppLimits) -> Iterator[str | Computed]:
    """Load the pair, warm up, time AR then SD (never overlapping); yield status lines, then a Computed.

    Wrapped in spaces.GPU on ZeroGPU, so everything it yields is plain picklable data.
    """
    label = "prompt lookup" if request.drafter == "ngram" else request.draft or "the default draft"
    label += " + prompt lookup" if request.drafter == "hybrid" else ""
    yield f"Loading {request.target} with {label} (cached after the first load)…"
    pair = load_pair(request.target, request.drafter, request.draft, device=limits.device)
    config = request.config()
    prompt_ids = encode_prompt(pair.target.tokenizer, request.prompt, config.use_chat_template)
    yield f"Warming up on {pair.target.device} (untimed)…"
    warmup(pair, prompt_ids, config)
    runs: dict[str, list[StepEvent]] = {"ar": [], "sd": []}
    names = {"ar": "autoregressive", "sd": "speculative"}
    stream = stream_pair(pair, prompt_ids, config)
    last = 0.0
    try:
        for which, event in stream:
            runs[which].append(event)
            if time.monotonic() - last >= TEXT_EVERY:  # a yield is also where a Stop takes effect
                last = time.monotonic()
                yield f"Timing the {names[which]} run: {event.num_generated}/{config.max_new_tokens} tokens…"
    finally:
        stream.close()
    tok = pair.target.tokenizer
    yield Computed(runs["ar"], runs["sd"], [event_segments(e, tok, False) for e in runs["ar"]],
                   [event_segments(e, tok, True) for e in runs["sd"]],
                   result_dict(pair, config, runs["ar"], runs["sd"], prompt_ids))


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


# ---- k sweep: specdemo.sweep, shared with `python -m specdemo bench` ----

def sweep_k(request: RunRequest, limits: AppLimits, k_max: int) -> Iterator[str | Sweep]:
    """specdemo.sweep on the current prompt, k = 1..k_max: a status line, then the Sweep so far after each k."""
    yield f"Loading {request.target}…"
    pair = load_pair(request.target, request.drafter, request.draft, device=limits.device)
    config = request.config()
    prompt_ids = encode_prompt(pair.target.tokenizer, request.prompt, config.use_chat_template)
    yield "Timing the autoregressive baseline, then one speculative run per k…"
    points: list[SweepPoint] = []
    for point in iter_sweep(pair, [prompt_ids], range(MIN_K, k_max + 1), config):
        points.append(point)
        # each k's verify cost as measured in its own runs (no extra micro-benchmark)
        yield summarize(points, {p.k: p.verify_cost for p in points}, k_max)


def sweep_table(result: Sweep) -> str:
    """Markdown: one line per measured k, then the fitted alpha and c and the theory's best k."""
    lines = ["| k | speedup | acceptance | mean accepted | theory |", "|---|---|---|---|---|"]
    lines += [f"| {p.k} | {p.speedup:.2f}× | {p.acceptance_rate:.0%} | {p.mean_accepted:.2f} | "
              f"{result.theory.get(p.k, 0.0):.2f}× |" for p in result.points]
    lines.append(f"\nFitted α = {result.alpha:.2f} (from mean accepted length), c = {result.c:.3f} (draft cost per "
                 f"token / target cost per token), verify cost per k as measured; theory's best k = {result.best_k}.")
    return "\n".join(lines)


# ---- the Blocks ----

def preset_choices(limits: AppLimits) -> list[str]:
    """Preset labels (bundled offline ones first, as in config.PRESETS) that the allowlist permits."""
    ok = [p.label for p in PRESETS if allowed(p.target, limits) and (p.draft is None or allowed(p.draft, limits))]
    return ok + [CUSTOM]


def default_preset() -> str:
    """The bundled target with the trained draft when it is shipped, else with prompt lookup."""
    offline = [p for p in PRESETS if p.offline]
    with_draft = [p for p in offline if p.draft == TRAINED_DRAFT_ID and not p.drafter]
    if with_draft and trained_draft_path(BUNDLED_ID) is not None:
        return with_draft[0].label
    return next(p.label for p in offline if p.draft is None)


def preset_fields(label: str):
    """Fill target, drafter and draft from a preset; Custom leaves them alone."""
    preset = next((p for p in PRESETS if p.label == label), None)
    if preset is None:
        return gr.skip(), gr.skip(), gr.skip()
    return preset.target, preset.drafter or ("ngram" if preset.draft is None else "model"), preset.draft or ""


class Handlers:
    """The app's event handlers; they share one hardware lock so timed runs never overlap."""

    def __init__(self, limits: AppLimits = AppLimits(), gpu: Callable | None = None):
        self.limits = limits
        self.hardware = threading.Lock()
        # spaces.GPU (ZeroGPU) wraps only the compute step; the replay runs without holding a GPU
        self.compute_step = gpu(compute) if gpu else compute
        self.sweep_step = gpu(sweep_k) if gpu else sweep_k

    def run_compare(self, prompt, target, drafter, draft, k, dynamic_k, temperature, top_p, max_new_tokens,
                    hide_rejected, replay=True):
        """The main run (API: /compare): validate, wait for the hardware, compute both runs, replay them."""

        def status(text: str, error: bool = False):
            return (gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(),
                    f"**Error:** {text}" if error else text, {"error": text} if error else gr.skip(), gr.skip())

        try:
            request = make_request(prompt, target, drafter, draft, k, dynamic_k, temperature, top_p,
                                   max_new_tokens, self.limits)
            yield from (status(s) for s in _hold(self.hardware))
            try:
                done = None
                with closing(self.compute_step(request, self.limits)) as steps:  # closing it stops the engine loop
                    for item in steps:
                        if isinstance(item, Computed):
                            done = item
                        else:
                            yield status(item)
            finally:
                self.hardware.release()
        except KNOWN_ERRORS as exc:
            gr.Warning(friendly_error(exc))
            yield status(friendly_error(exc), error=True)
            return
        except Exception as exc:  # the app keeps serving; the log has the traceback
            log.exception("run failed")
            gr.Warning(f"Unexpected error: {exc}")
            yield status(f"Unexpected error: {exc}", error=True)
            return
        ar_points, sd_points = _points(done.ar_events), _points(done.sd_events)
        hist = done.result["sd"]["accepted_histogram"]
        for n_ar, n_sd, plots in replay_frames([e.elapsed for e in done.ar_events],
                                               [e.elapsed for e in done.sd_events], pace=bool(replay)):
            final = n_ar == len(done.ar_events) and n_sd == len(done.sd_events)
            figs = (charts.tokens_vs_time(ar_points[: n_ar + 1], sd_points[: n_sd + 1]),
                    charts.running_speedup(ar_points[: n_ar + 1], sd_points[: n_sd + 1]),
                    charts.accepted_histogram(run_stats(done.sd_events[:n_sd]).accepted_histogram if not final
                                              else hist)) if plots else (gr.skip(),) * 3
            yield (_panel(done.ar_events, done.ar_segments, n_ar, False),
                   _panel(done.sd_events, done.sd_segments, n_sd, hide_rejected),
                   *figs,
                   final_stats_markdown(done.result) if final else gr.skip(),
                   "Done. Replayed at the measured pace." if final else "Replaying both runs at their measured pace…",
                   done.result if final else gr.skip(),
                   done.sd_segments if final else gr.skip())

    def rerender(self, segments, hide_rejected, current):
        """Show or hide rejected drafts in the finished speculative panel without running again."""
        if not segments:
            return gr.skip()
        head = current.split('<div class="tok-panel', 1)[0] if current else ""
        return head + segments_html([s for step in segments for s in step], hide_rejected)

    def run_sweep(self, prompt, target, drafter, draft, k_max, temperature, top_p, max_new_tokens):
        """The Tune-k tab: sweep k = 1..k_max on the current prompt; plot measured and expected speedup."""
        try:
            request = make_request(prompt, target, drafter, draft, MIN_K, False, temperature, top_p,
                                   max_new_tokens, self.limits)
            k_max = int(k_max)
            if not MIN_K <= k_max <= MAX_K:
                raise UserError(f"the largest k must be between {MIN_K} and {MAX_K}, got {k_max}")
        except KNOWN_ERRORS as exc:
            yield gr.skip(), f"**Error:** {friendly_error(exc)}", gr.skip(), gr.skip()
            return
        for s in _hold(self.hardware):
            yield gr.skip(), s, gr.skip(), gr.skip()
        try:
            result = None
            with closing(self.sweep_step(request, self.limits, k_max)) as steps:
                for item in steps:
                    if isinstance(item, str):
                        yield gr.skip(), item, gr.skip(), gr.skip()
                        continue
                    result = item
                    fig = charts.k_sweep([asdict(p) for p in result.points], sorted(result.theory.items()),
                                         result.best_measured_k, result.best_k)
                    best = result.best_measured_k
                    yield (fig, f"Measured k = {result.points[-1].k} of {k_max}…\n\n" + sweep_table(result), best,
                           gr.update(value=f"Use k = {best}", interactive=True))
            yield (gr.skip(), f"Done: best measured k = {result.best_measured_k}.\n\n" + sweep_table(result),
                   result.best_measured_k, gr.skip())
        except KNOWN_ERRORS as exc:
            gr.Warning(friendly_error(exc))
            yield gr.skip(), f"**Error:** {friendly_error(exc)}", gr.skip(), gr.skip()
        finally:
            self.hardware.release()


def build_demo(limits: AppLimits = AppLimits(), gpu: Callable | None = None) -> gr.Blocks:
    """The app. `gpu` is spaces.GPU on ZeroGPU hardware, else None."""
    h = Handlers(limits, gpu)
    with gr.Blocks(title="Speculative decoding, shown truthfully") as demo:
        gr.Markdown("# Speculative decoding, shown truthfully\nA draft proposes *k* tokens, the target checks them "
                    "all in one pass and keeps the ones it agrees with. Same prompt, same settings: plain "
                    "autoregressive decoding on the left, speculative on the right.")
        with gr.Row():
            with gr.Column(scale=3):
                prompt = gr.Textbox(label="Prompt", lines=5, value=EXAMPLES[1][1], elem_id="prompt")
                gr.Examples([[p] for _, p in EXAMPLES], inputs=[prompt],
                            example_labels=[f"{c}: {p[:40]}…" for c, p in EXAMPLES], label="Examples by category")
            with gr.Column(scale=2):
                preset = gr.Dropdown(preset_choices(limits), value=default_preset(), label="Preset pair")
                first = preset_fields(default_preset())
                with gr.Row():
                    target = gr.Textbox(first[0], label="Target model id")
                    draft = gr.Textbox(first[2], label="Draft model id (same tokenizer)",
                                       placeholder="empty: the target's trained draft")
                drafter = gr.Radio([("draft model", "model"), ("prompt lookup", "ngram"),
                                    ("draft + lookup", "hybrid")], value=first[1],
                                   label="Drafter")
                with gr.Row():
                    k = gr.Slider(MIN_K, MAX_K, value=GenerationConfig.num_draft_tokens, step=1,
                                  label="k (draft tokens per step)")
                    dynamic_k = gr.Checkbox(label="dynamic k", value=False)
                with gr.Row():
                    temperature = gr.Slider(0.0, 2.0, value=SamplingConfig.temperature, step=0.05,
                                            label="temperature (0 = greedy)")
                    top_p = gr.Slider(0.05, 1.0, value=SamplingConfig.top_p, step=0.05, label="top-p")
                max_new_tokens = gr.Slider(1, limits.max_new_tokens, step=1, label="max new tokens",
                                           value=min(GenerationConfig.max_new_tokens, limits.max_new_tokens))
                with gr.Row():
                    hide_rejected = gr.Checkbox(label="hide rejected drafts", value=False)
                    replay = gr.Checkbox(label="replay at measured pace", value=True)
        with gr.Tab("Race"):
            with gr.Row():
                run_btn = gr.Button("Run", variant="primary", elem_id="run")
                stop_btn = gr.Button("Stop", variant="stop", elem_id="stop")
            status = gr.Markdown("Ready.", elem_id="status")
            gr.HTML(legend_html())
            with gr.Row():
                with gr.Column():
                    gr.Markdown("### Autoregressive (target only)")
                    ar_html = gr.HTML(segments_html([]), elem_id="ar-panel")
                with gr.Column():
                    gr.Markdown("### Speculative")
                    sd_html = gr.HTML(segments_html([]), elem_id="sd-panel")
            stats = gr.Markdown(elem_id="stats")
            gr.Markdown(TIMING_NOTE)
            with gr.Row():
                tokens_plot = gr.Plot(label="tokens vs time")
                speedup_plot = gr.Plot(label="running speedup")
                hist_plot = gr.Plot(label="accepted length")
            result_json = gr.JSON(label="result (same keys as `python -m specdemo generate --json`)")
            segments_state = gr.State([])
        with gr.Tab("Tune k"):
            gr.Markdown("Sweeps k on the current prompt and settings: one autoregressive baseline, then one "
                        "speculative run per k. The dashed curve is the expected speedup from the measured "
                        "acceptance α and cost ratio c (Leviathan et al. 2023).")
            with gr.Row():
                k_max = gr.Slider(2, MAX_K, value=8, step=1, label="largest k")
                sweep_btn = gr.Button("Sweep k", variant="primary")
                sweep_stop = gr.Button("Stop", variant="stop")
                apply_btn = gr.Button("Use best k", interactive=False)
            sweep_plot = gr.Plot(label="speedup and acceptance vs k")
            sweep_md = gr.Markdown()
            best_state = gr.State(None)

        preset.change(preset_fields, preset, [target, drafter, draft], api_name=False)
        inputs = [prompt, target, drafter, draft, k, dynamic_k, temperature, top_p, max_new_tokens]
        run_event = run_btn.click(
            h.run_compare, inputs + [hide_rejected, replay],
            [ar_html, sd_html, tokens_plot, speedup_plot, hist_plot, stats, status, result_json, segments_state],
            api_name="compare", show_progress="minimal",
        )
        stop_btn.click(lambda: "Stopped.", None, status, cancels=[run_event], api_name=False)
        hide_rejected.change(h.rerender, [segments_state, hide_rejected, sd_html], sd_html, api_name=False)
        sweep_event = sweep_btn.click(
            h.run_sweep, [prompt, target, drafter, draft, k_max, temperature, top_p, max_new_tokens],
            [sweep_plot, sweep_md, best_state, apply_btn], api_name="sweep_k", show_progress="minimal",
        )
        sweep_stop.click(lambda: "Stopped.", None, sweep_md, cancels=[sweep_event], api_name=False)
        apply_btn.click(lambda best: best if best else gr.skip(), best_state, k, api_name=False)
    return demo


def launch_options() -> dict:
    """Theme and css for demo.launch() (Gradio 6 takes them there, not in Blocks)."""
    return {"css": CSS, "theme": gr.themes.Soft()}
