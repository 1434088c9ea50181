"""The app's event handlers: widget values in, {component: value} dicts out. The runs are the CLI's
(compare.iter_compare, sweep.iter_sweep_summaries). The two decoders take turns on the hardware by their own clocks,
so both panels fill side by side as the tokens are computed; frames carry text only, and the plots are drawn when the
timed work is over. "Replay race" plays both again from t = 0 at their measured pace. The compute steps they run are
in specdemo.app.compute; request checks and pacing in specdemo.app.race and the text in specdemo.app.summary (no
gradio); the layout is in specdemo.app.ui.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import asdict

import gradio as gr

from .. import checks
from ..config import MAX_K, MIN_K, Runtime
from ..drafters.resolve import starting_k
from ..engine import StepEvent
from ..measure import charts
from ..measure.metrics import run_stats
from ..serve.export import serve_hint
from .compute import compute, sweep_k
from .outputs import Outputs, RaceOutputs, SettingsOutputs, SweepOutputs
from .race import (
    KNOWN_ERRORS,
    AppLimits,
    RunRequest,
    Runs,
    Throttle,
    UserError,
    check_prompt_tokens,
    drafted_at,
    flag,
    free_memory,
    friendly_error,
    make_request,
    matching_preset,
    passes,
    points,
    preset_fields,
    preset_k,
    replay_frames,
    run_point,
)
from .render import Segment, panel_stats, segments_html
from .sessions import Forgetting
from .summary import drift_warning, final_stats_markdown, sweep_table

log = logging.getLogger(__name__)

RACING = ("Racing, timed: the two runs take turns on the hardware, one step at a time, and each clock counts only its "
          "own run's compute…")
CLEARED = ("Suffix cache cleared: this session's next run drafts from no earlier answer (each browser session has a "
           "cache of its own).")

__all__ = ["AppLimits", "Handlers", "Outputs", "RaceOutputs", "SettingsOutputs", "SweepOutputs", "UserError",
           "compute", "sweep_k"]


def blank_plots(out: RaceOutputs) -> dict:
    """Blank figures for the race's plots, as on page load."""
    names = {out.tokens_plot: "tokens", out.speedup_plot: "speedup", out.hist_plot: "histogram",
             out.timeline_plot: "timeline", out.position_plot: "positions"}
    return {component: charts.blank(name) for component, name in names.items()}


def _panel(events: list[StepEvent], segments: list[list[Segment]], n: int, hide_rejected: bool,
           waiting: str = "waiting for the first token…", inspect: bool = True) -> str:
    stats = panel_stats(events[n - 1].num_generated, events[n - 1].elapsed) if n else waiting
    return segments_html([s for step in segments[:n] for s in step], hide_rejected, stats, inspect)


def hold_hardware(lock: threading.Lock, stopped: Callable[[], bool] = lambda: False) -> Iterator[str]:
    """Wait for the hardware, yielding so a Stop can end the wait."""
    while not lock.acquire(timeout=0.25):
        if stopped():
            raise Stopped
        yield "Waiting for another run to finish: timed runs never share the hardware…"


class Stopped(Exception):
    """The visitor pressed Stop: the run ends at the next decoder step and says so itself."""


def visitor_id(visitor: gr.Request | None) -> str | None:
    """The visitor's gradio session (one browser tab, or one API client), None when gradio names none."""
    return getattr(visitor, "session_hash", None)


def session_key(visitor: gr.Request | None, tab: str) -> tuple[str | None, str]:
    """Whose run in which tab: what a Stop marks."""
    return visitor_id(visitor), tab


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
        # Stop is cooperative: the button marks the session's run, which ends at its next decoder step and writes
        # "Stopped." as its own last frame, so no frame of the old run can land after it (an API client's
        # job.cancel() still closes the generator through gradio)
        self.running: set[tuple] = set()
        self.stopping: set[tuple] = set()
        # each session's suffix cache lives where the drafters run; the server marks the sessions to forget and the
        # next compute step applies the marks (app.sessions)
        self.forgetting = Forgetting()
        # spaces.GPU (ZeroGPU) wraps only the compute steps; the race replay runs without holding a GPU
        self.compute_step = gpu(compute) if gpu else compute
        self.sweep_step = gpu(sweep_k) if gpu else sweep_k

    @contextmanager
    def session(self, visitor: gr.Request | None, tab: str) -> Iterator[Callable[[], bool]]:
        """A visitor's run in a tab, from its start to its end: yields `stopped()`, true once Stop was pressed for it
        (stop() marks only sessions inside this block, so a Stop with nothing running never stops the next run)."""
        key = session_key(visitor, tab)
        self.running.add(key)
        self.stopping.discard(key)
        try:
            yield lambda: key in self.stopping
        finally:
            self.running.discard(key)
            self.stopping.discard(key)

    def run_compare(self, prompt, target, drafter, draft, k, dynamic_k, temperature, top_p, max_new_tokens,
                    hide_rejected, replay=False, verification="token", tree=None, visitor: gr.Request = None,
                    recalibrate: bool = False) -> Iterator[dict]:
        """The main run (API: /compare): validate, wait for the hardware, race both runs live (then, with `replay`,
        play them again at their measured pace). `verification` is the rule for sampled drafts (token or block),
        `tree` the draft-tree setting (auto, off or a node budget; None: auto); `recalibrate` measures the pass costs
        again first."""
        runs = Runs()
        with self.session(visitor, "race") as stopped:
            yield from self._compare(runs, stopped, prompt, target, drafter, draft, k, dynamic_k, temperature, top_p,
                                     max_new_tokens, hide_rejected, replay, recalibrate, verification,
                                     visitor_id(visitor), tree)

    def _compare(self, runs: Runs, stopped: Callable[[], bool], prompt, target, drafter, draft, k, dynamic_k,
                 temperature, top_p, max_new_tokens, hide_rejected, replay, recalibrate,
                 verification="token", owner: str | None = None, tree=None) -> Iterator[dict]:
        try:
            request = make_request(prompt, target, drafter, draft, k, dynamic_k, temperature, top_p,
                                    max_new_tokens, self.limits, verification, tree)
            hide, pace = flag(hide_rejected, "hide rejected drafts"), flag(replay, "replay")
            yield from ({self.outputs.race.status: s} for s in hold_hardware(self.hardware, stopped))
            try:
                check_prompt_tokens(request, self.limits, self.runtime)  # the tokenizer only: no weights yet
                yield self._reset()
                yield from self._live(request, runs, hide, stopped, recalibrate, owner)
            finally:
                self.hardware.release()
            yield from self._race(runs, hide, pace, stopped)
        except Stopped:
            yield {self.outputs.race.status: "Stopped."}
        except KNOWN_ERRORS as exc:
            free_memory(exc)
            yield self._error(friendly_error(exc))
        except Exception as exc:  # the app keeps serving; the log has the traceback
            log.exception("run failed")
            yield self._error(f"Unexpected error: {exc}")

    def replay_race(self, runs: Runs | None, hide_rejected, visitor: gr.Request = None) -> Iterator[dict]:
        """Race the finished runs again from t = 0, without computing anything."""
        if not isinstance(runs, Runs) or not runs.done:
            yield {self.outputs.race.status: "Nothing to replay yet: press Run first."}
            return
        with self.session(visitor, "race") as stopped:
            try:
                yield from self._race(runs, bool(hide_rejected), True, stopped)
            except Stopped:
                yield {self.outputs.race.status: "Stopped."}

    def _error(self, text: str) -> dict:
        gr.Warning(text)
        out = self.outputs.race
        return {out.status: f"**Error:** {text}", out.result_json: {"error": text}}

    def _reset(self) -> dict:
        """A new run's first frame: empty panels and plots, no summary."""
        out = self.outputs.race
        return {out.ar_html: segments_html([], stats="starts after the untimed warm-up…"),
                out.sd_html: segments_html([], stats="starts after the untimed warm-up…"),
                out.stats: "", out.result_json: None, **blank_plots(out)}

    def remeasure(self, prompt, target, drafter, draft, k, dynamic_k, temperature, top_p, max_new_tokens,
                  hide_rejected, replay=False, verification="token", tree=None,
                  visitor: gr.Request = None) -> Iterator[dict]:
        """The Re-measure button: the pass costs measured again on the machine as it is now, then the same run."""
        yield from self.run_compare(prompt, target, drafter, draft, k, dynamic_k, temperature, top_p, max_new_tokens,
                                    hide_rejected, replay, verification, tree, visitor, recalibrate=True)

    def _live(self, request: RunRequest, runs: Runs, hide: bool, stopped: Callable[[], bool],
              recalibrate: bool = False, owner: str | None = None) -> Iterator[dict]:
        """Both runs' tokens as their decoders take turns producing them (throttled text frames; no plots while a run
        is timed, since drawing them takes the CPU the runs are timed on; the last frame always comes)."""
        out, throttle, shown = self.outputs.race, Throttle(), {"ar": 0, "sd": 0}
        with closing(self.compute_step(request, self.limits, self.runtime, recalibrate,
                                       self.forgetting.session(owner))) as steps:
            for item in steps:
                if stopped():  # closing the steps stops the decoders
                    raise Stopped
                if isinstance(item, str):
                    yield {out.status: item}
                elif isinstance(item, dict):
                    runs.result = item
                else:
                    which, event, segments = item
                    runs.add(which, event, segments)
                    if throttle.due(final=event.finish_reason is not None):
                        yield self._live_frame(runs, shown, hide)

    def _live_frame(self, runs: Runs, shown: dict[str, int], hide: bool) -> dict:
        """The panels that have new tokens since the last frame (`shown` is updated); each panel's stats line counts
        its tokens, so the status line is written once, when the race starts, rather than redrawn with every frame."""
        out = self.outputs.race
        counts = {"ar": len(runs.ar_events), "sd": len(runs.sd_events)}
        frame = {} if any(shown.values()) else {out.status: RACING}
        if counts["ar"] != shown["ar"]:
            frame[out.ar_html] = _panel(runs.ar_events, runs.ar_segments, counts["ar"], False, inspect=False)
        if counts["sd"] != shown["sd"]:
            frame[out.sd_html] = _panel(runs.sd_events, runs.sd_segments, counts["sd"], hide, inspect=False)
        shown.update(counts)
        return frame

    def _plots(self, runs: Runs, n_ar: int, n_sd: int) -> dict:
        """Tokens vs time, running speedup and the histogram for the first n_ar / n_sd events."""
        out = self.outputs.race
        ar, sd = points(runs.ar_events, n_ar), points(runs.sd_events, n_sd)
        return {out.tokens_plot: charts.tokens_vs_time(ar, sd), out.speedup_plot: charts.running_speedup(ar, sd),
                out.hist_plot: charts.accepted_histogram(run_stats(runs.sd_events[:n_sd]).accepted_histogram)}

    def _race(self, runs: Runs, hide: bool, pace: bool, stopped: Callable[[], bool]) -> Iterator[dict]:
        """Both runs from t = 0 at their measured pace (or at once without pace), then the summary."""
        if not runs.done:  # failed before the end
            return
        out = self.outputs.race
        ar_times, sd_times = [e.elapsed for e in runs.ar_events], [e.elapsed for e in runs.sd_events]
        for n_ar, n_sd, plots in replay_frames(ar_times, sd_times, pace=pace):
            if stopped():
                raise Stopped
            if n_ar == len(ar_times) and n_sd == len(sd_times):
                break
            frame = {out.ar_html: _panel(runs.ar_events, runs.ar_segments, n_ar, False),
                     out.sd_html: _panel(runs.sd_events, runs.sd_segments, n_sd, hide),
                     out.status: "Race: both runs from t = 0 at their measured pace…"}
            yield frame | (self._plots(runs, n_ar, n_sd) if plots else {})
        yield self._final(runs, hide)

    def _final(self, runs: Runs, hide: bool) -> dict:
        """Everything at the end: both panels, all plots, where the time went, the summary and the JSON."""
        out, result = self.outputs.race, runs.result
        p = run_point(runs)
        c, verify_cost = (p.c, p.verify_cost) if p else (0.0, 1.0)
        rates = result["sd"]["per_position_acceptance"]
        return {out.ar_html: _panel(runs.ar_events, runs.ar_segments, len(runs.ar_events), False),
                out.sd_html: _panel(runs.sd_events, runs.sd_segments, len(runs.sd_events), hide),
                **self._plots(runs, len(runs.ar_events), len(runs.sd_events)),
                out.timeline_plot: charts.timeline(passes(runs.ar_events), passes(runs.sd_events), c, verify_cost),
                out.position_plot: charts.position_acceptance(rates, drafted_at(runs.sd_events, len(rates)),
                                                              p.alpha if p else None, c, verify_cost),
                out.stats: final_stats_markdown(result, c, verify_cost), out.result_json: result, out.runs_state: runs,
                out.status: f"Done: {result['speedup']:.2f}× the autoregressive speed"
                            f" ({'identical outputs' if result['identical'] else 'outputs differ'}). "
                            "Press Replay race to watch it again." + drift_warning(result)}

    def rerender(self, runs: Runs | None, hide_rejected, current) -> dict:
        """Show or hide rejected drafts in the finished speculative panel without running again."""
        out = self.outputs.race
        if not isinstance(runs, Runs) or not runs.sd_segments:
            return {out.sd_html: gr.skip()}
        head = current.split('<div class="tok-panel', 1)[0] if current else ""
        return {out.sd_html: head + segments_html([s for step in runs.sd_segments for s in step], hide_rejected)}

    def stop_race(self, visitor: gr.Request = None) -> None:
        """Ask this visitor's run or replay to stop; it ends at its next step and says "Stopped." itself."""
        self.stop(session_key(visitor, "race"))

    def stop(self, session: tuple) -> None:
        """Mark a running session's run to stop at its next step (no gradio cancel: the run writes "Stopped.")."""
        if session in self.running:
            self.stopping.add(session)

    def run_sweep(self, prompt, target, drafter, draft, k_max, temperature, top_p, max_new_tokens,
                  verification="token", trees=None, visitor: gr.Request = None) -> Iterator[dict]:
        """The Tune-k tab (API: /sweep_k): sweep k = 1..k_max on the current prompt under each draft-tree setting in
        `trees` (a list or a comma list like off,auto,8; None: auto); measured and expected speedup."""
        out = self.outputs.sweep
        with self.session(visitor, "sweep") as stopped:
            try:
                yield from self._sweep(prompt, target, drafter, draft, k_max, temperature, top_p, max_new_tokens,
                                       stopped, verification, visitor_id(visitor), trees)
            except Stopped:
                yield {out.table: "Stopped."}
            except KNOWN_ERRORS as exc:
                gr.Warning(friendly_error(exc))
                yield {out.table: f"**Error:** {friendly_error(exc)}"}

    def _sweep(self, prompt, target, drafter, draft, k_max, temperature, top_p, max_new_tokens,
               stopped: Callable[[], bool], verification="token", owner: str | None = None,
               trees=None) -> Iterator[dict]:
        out = self.outputs.sweep
        request = make_request(prompt, target, drafter, draft, MIN_K, False, temperature, top_p, max_new_tokens,
                               self.limits, verification)
        k_max = checks.whole(k_max, "the largest k", MIN_K, MAX_K)  # the Tune-k tab's own range
        trees = tuple(checks.trees(trees)) if trees not in (None, "", []) else None
        yield from ({out.table: s} for s in hold_hardware(self.hardware, stopped))
        try:
            check_prompt_tokens(request, self.limits, self.runtime)
            result = None
            with closing(self.sweep_step(request, self.limits, self.runtime, k_max,
                                         self.forgetting.session(owner), trees)) as steps:
                for item in steps:  # the sweep so far after each k: drawn only when every k is timed
                    if stopped():
                        raise Stopped
                    if isinstance(item, str):
                        yield {out.table: item}
                    else:
                        result = item
        finally:
            self.hardware.release()
        best, tree = result.best_measured_k, result.best_measured_tree
        several = len({p.tree for p in result.points}) > 1
        fig = charts.k_sweep([asdict(p) for p in result.points], sorted(result.theory.items()), best, result.best_k,
                             tree if several else None)
        hint = serve_hint(request.target, request.draft, best, self.runtime)  # EAGLE-3 drafts only
        start, source = starting_k(request.drafter, request.target, request.draft, self.runtime)
        trees_said = f", draft trees {tree} (the button sets both)" if several else ""
        yield {out.plot: fig, out.table: f"Done: best measured k = {best}{trees_said} (this pair starts at k = "
               f"{start}: {source})." "\n\n" + sweep_table(result) + (f"\n\n{hint}" if hint else ""),
               out.best: (best, tree) if several else best,
               out.apply: gr.update(value=f"Use k = {best}", interactive=True)}

    def clear_suffix_cache(self, visitor: gr.Request = None) -> dict:
        """Forget this session's earlier answers (suffix decoding's cache; no other session's is touched)."""
        self.forgetting.mark(visitor_id(visitor))
        return {self.outputs.race.status: CLEARED}

    def forget_session(self, visitor: gr.Request = None) -> None:
        """The visitor closed or reloaded the page: their suffix cache goes with the next compute step."""
        self.forgetting.mark(visitor_id(visitor))

    def stop_sweep(self, visitor: gr.Request = None) -> None:
        """Ask this visitor's sweep to stop at its next step."""
        self.stop(session_key(visitor, "sweep"))

    def apply_preset(self, label: str) -> dict:
        """Fill target, drafter, draft and k from a preset; Custom leaves them alone."""
        out = self.outputs.settings
        values = preset_fields(label)
        if values is None:
            return {out.target: gr.skip()}
        return dict(zip((out.target, out.drafter, out.draft), values)) | {out.k: preset_k(label, self.runtime)}

    def apply_drafter(self, kind: str, target: str, draft: str) -> dict:
        """Picking a drafter moves k to the k that drafter starts at for the target (resolve.starting_k: its measured
        best on the bundled pair, as generate and bench take it) and the Preset box to the preset the settings now
        are, else Custom; an unknown kind changes nothing (the run says why)."""
        out = self.outputs.settings
        target, draft = str(target or ""), str(draft or "")
        try:
            k = starting_k(str(kind), target or None, draft or None, self.runtime)[0]
        except ValueError:
            return {out.k: gr.skip(), out.preset: gr.skip()}
        return {out.k: k, out.preset: matching_preset(target, kind, draft, self.limits)}

    def apply_best_k(self, best) -> dict:
        """Set k to the sweep's best measured k (and the Tree setting to its tree setting, when the sweep ran more
        than one)."""
        settings = self.outputs.settings
        if isinstance(best, (list, tuple)) and len(best) == 2:
            return {settings.k: best[0], settings.tree: best[1]}
        return {settings.k: best if best else gr.skip()}
