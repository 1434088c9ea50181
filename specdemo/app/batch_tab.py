"""The Batch tab's handlers: several prompts decoded together at each batch size (batch_sizes.sweep_batches), AR and
SD throughput and the speedup against batch size, the crossover marked. Same hardware lock as the race, so no timed
run overlaps another. No layout here (ui.batch_tab_layout)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass

import gradio as gr

from .. import checks
from ..config import Runtime
from ..measure import charts
from ..models.placement import placement_line
from .handlers import Handlers, Stopped, hold_hardware, session_key, visitor_id
from .outputs import Component, OrderedOutputs
from .race import (
    KNOWN_ERRORS,
    AppLimits,
    UserError,
    check_fit,
    friendly_error,
    make_request,
    placement_for,
)
from .sessions import Session

log = logging.getLogger(__name__)

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
class BatchOutputs(OrderedOutputs):
    """The Batch tab, in its sweep event's outputs order."""

    throughput_plot: Component
    speedup_plot: Component
    table: Component  # status line, then one row per batch size


def make_batch_request(prompts_text, use_examples, examples, target, drafter, draft, k, auto_k, temperature, top_p,
                       new_tokens, largest, anchors, limits: AppLimits, verification="token", tree=None):
    """Validate the Batch tab's values (make_request's rules for the shared ones, the race's verification rule and
    draft-tree setting among them) into a batch_sizes.BatchRequest."""
    from ..measure.batch_sizes import BatchRequest

    prompts = list(examples) if use_examples else [p.strip() for p in str(prompts_text or "").splitlines() if p.strip()]
    if not prompts:
        raise UserError("No prompts: type one prompt per line, or use the examples.")
    if len(prompts) > BATCH_MAX_PROMPTS:
        raise UserError(f"At most {BATCH_MAX_PROMPTS} prompts here, got {len(prompts)}.")
    single = make_request(prompts[0], target, drafter, draft, k, False, temperature, top_p, new_tokens, limits,
                          verification, tree)
    largest = checks.whole(largest, "the largest batch size", 1, allowed=f"one of {BATCH_SIZES}")
    if largest not in BATCH_SIZES:
        raise checks.refused("the largest batch size", largest, f"one of {BATCH_SIZES}")
    sizes = tuple(b for b in BATCH_SIZES if b <= largest)
    return BatchRequest(single.target, single.drafter, single.draft, tuple(prompts), sizes,
                        None if auto_k else single.k, single.config(), bool(anchors))


def batch_table(sweep) -> str:
    """Markdown: one line per measured batch size, then where speculation stops paying."""
    lines = ["| batch size | AR tok/s | SD tok/s | speedup | k (auto k) | mean accepted | verify cost "
             "| AR / generate |",
             "|---|---|---|---|---|---|---|---|"]
    for p in sweep.points:
        base = f"{p.ar_vs_hf_generate:.2f}" if p.ar_vs_hf_generate is not None else "–"
        lines.append(f"| {p.batch_size} | {p.ar_tokens_per_s:.1f} | {p.sd_tokens_per_s:.1f} | {p.speedup:.2f}× | "
                     f"{p.k} ({p.auto_k}) | {p.mean_accepted:.2f} | {p.verify_cost:.2f} | {base} |")
    cross = sweep.crossover
    lines.append("\n" + (f"Speculation stops paying at batch size **{cross}** on this machine." if cross is not None
                         else "Speculation pays at every batch size measured here."))
    if sweep.placement:
        lines.append(f"\nWhere it ran: {placement_line(sweep.placement)}.")
    return "\n".join(lines)


def batch_sweep(request, device, runtime, placement, draft_device, loading,
                session: Session = Session()) -> Iterator:
    """batch_sizes.sweep_batches with the drafter keeping its state in the session's own (app.sessions: suffix
    decoding drafts from the session's earlier answers and adds none)."""
    from ..measure.batch_sizes import sweep_batches

    yield from sweep_batches(request, device, runtime, placement, draft_device, loading, shared=session.state())


class BatchHandlers:
    """The Batch tab's handlers; they share the race's Handlers: its hardware lock (no timed run overlaps another) and
    its Stop marks (a run ends at its next step and says "Stopped." itself)."""

    def __init__(self, outputs: BatchOutputs, examples: list[str], handlers: Handlers,
                 limits: AppLimits = AppLimits(), runtime: Runtime = Runtime(), gpu: Callable | None = None):
        self.outputs, self.examples, self.handlers = outputs, list(examples), handlers
        self.limits, self.runtime = limits, runtime
        self.step = gpu(batch_sweep) if gpu else batch_sweep

    def run(self, prompts_text, use_examples, target, drafter, draft, k, auto_k, temperature, top_p, new_tokens,
            largest, anchors, verification="token", tree=None, visitor: gr.Request = None) -> Iterator[dict]:
        """Sweep the batch sizes: throughput and speedup against batch size, crossover marked; sampled drafts are
        verified by the race's rule (token-wise or block), and drafts are trees as the race's Tree setting says."""
        out, h = self.outputs, self.handlers
        try:
            request = make_batch_request(prompts_text, use_examples, self.examples, target, drafter, draft, k,
                                         auto_k, temperature, top_p, new_tokens, largest, anchors, self.limits,
                                         verification, tree)
        except KNOWN_ERRORS as exc:
            yield {out.table: f"**Error:** {friendly_error(exc)}"}
            return
        with h.session(visitor, "batch") as stopped:
            try:
                yield from ({out.table: s} for s in hold_hardware(h.hardware, stopped))
                try:
                    yield from self._sweep(request, stopped, h.forgetting.session(visitor_id(visitor)))
                finally:
                    h.hardware.release()
            except Stopped:
                yield {out.table: "Stopped."}
            except KNOWN_ERRORS as exc:
                gr.Warning(friendly_error(exc))
                yield {out.table: f"**Error:** {friendly_error(exc)}"}
            except Exception as exc:  # the app keeps serving; the log has the traceback
                log.exception("batch sweep failed")
                yield {out.table: f"**Error:** unexpected: {exc}"}

    def _sweep(self, request, stopped: Callable[[], bool], session: Session = Session()) -> Iterator[dict]:
        out = self.outputs
        placement = placement_for(request.target, self.limits)  # as the race: the server's or the preset's device map
        estimate = check_fit(request, self.limits, self.runtime, placement) or ""
        with closing(self.step(request, self.limits.device, self.runtime, placement, self.limits.draft_device,
                               estimate, session)) as steps:  # closing stops the decoders
            last = None
            for item in steps:  # the sweep so far after each batch size: drawn only when all are timed
                if stopped():
                    raise Stopped
                if isinstance(item, str):
                    yield {out.table: item}
                else:
                    last = item
        if last is None:
            return
        points = [p.as_dict() for p in last.points]
        yield {out.throughput_plot: charts.batch_throughput(points, last.crossover),
               out.speedup_plot: charts.batch_speedup(points, last.crossover),
               out.table: "Done.\n\n" + batch_table(last)}

    def stop(self, visitor: gr.Request = None) -> None:
        """Ask this visitor's batch sweep to stop; it ends at its next step and says "Stopped." itself."""
        self.handlers.stop(session_key(visitor, "batch"))
