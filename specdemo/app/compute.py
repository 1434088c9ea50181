"""The app's compute steps: what runs on the hardware for a visitor (in the compute process, wrapped in spaces.GPU
on ZeroGPU), so what goes in and comes out is picklable data. The race's runs with their calibration and the k sweep;
the handlers stream what these yield. No gradio."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import closing

from ..config import MIN_K, Runtime
from ..drafters.registry import get
from ..engine import StepEvent, encode_prompt
from ..measure.compare import calibrate, iter_compare, load_pair
from ..measure.metrics import PassCosts, cost_drift, pass_costs
from ..measure.tune_k import Sweep, iter_sweep_summaries, plan_trees
from .race import AppLimits, RunRequest, check_fit, placement_for
from .render import Segment, event_segments
from .sessions import Session

Computed = str | tuple[str, StepEvent, list[Segment]] | dict


def compute(request: RunRequest, limits: AppLimits, runtime: Runtime, recalibrate: bool = False,
            session: Session = Session()) -> Iterator[Computed]:
    """compare.iter_compare on the request (load, untimed warm-up, then AR and SD taking turns, never overlapping):
    status lines, then ("ar" | "sd", event, its display segments) as each decoder yields, then the result dict with
    `pass_costs`: the run's pass costs beside those calibrated when this pair and k first ran (or on `recalibrate`),
    and how far they drifted (metrics.cost_drift; empty when the machine was as it was at calibration). Suffix
    decoding drafts from `session`'s own earlier answers (app.sessions), and the timed run's answer joins them."""
    kind = get(request.drafter)
    label = (request.draft or "the default draft") if kind.needs_draft else kind.label
    label += " + prompt lookup" if request.drafter == "hybrid" else ""
    pair = yield from _load(request, limits, runtime, f"Loading {request.target} with {label} (cached after the first "
                                                      "load)…", session)
    config = request.config()
    prompt_ids = encode_prompt(pair.target.tokenizer, request.prompt, config.use_chat_template)
    key = (request.target, request.drafter, request.draft, request.k, request.dynamic_k, config.sampling.greedy,
           request.tree)
    calibrating = recalibrate or key not in _CALIBRATED
    if calibrating:  # calibrate warms up first, so the run needs no warm-up of its own
        yield f"Measuring what each pass costs on {pair.target.device} while nothing else is drawn (untimed)…"
        with pair.drafter.paused():  # its answer to this very prompt must not be drafted from by the timed run
            _CALIBRATED[key] = calibrate(pair, prompt_ids, config)
    else:
        yield f"Warming up on {pair.target.device} (untimed)…"
    tok, step, events = pair.target.tokenizer, 0, {"ar": [], "sd": []}
    # closing the steps stops the engine loop
    with closing(iter_compare(pair, prompt_ids, config, do_warmup=not calibrating)) as steps:
        for which, item in steps:  # the engine's clock is paused while we are here
            if which == "result":
                run = pass_costs(events["ar"], events["sd"])
                yield item | {"pass_costs": {"calibrated": _CALIBRATED[key].as_dict(), "run": run.as_dict(),
                                             "drift": cost_drift(_CALIBRATED[key], run,
                                                                 judge_draft=kind.steady_draft_cost)}}
                continue
            events[which].append(item)
            step += which == "sd" and item.kind == "spec"
            yield which, item, event_segments(item, tok, which == "sd", step if which == "sd" else 0,
                                              config.sampling.greedy)


# the pass costs measured when a pair and k first ran in this process, by (target, drafter, draft, k, dynamic k,
# greedy, tree setting): what later runs are compared with
_CALIBRATED: dict[tuple, PassCosts] = {}


def _load(request: RunRequest, limits: AppLimits, runtime: Runtime, status: str, session: Session) -> Iterator[str]:
    """Check the pair's memory against the limits (race.check_fit), yield status lines while loading; returns the
    Pair, whose drafter keeps what it keeps across requests in the session's own SharedState (suffix decoding's
    earlier answers). A target that needs a device map gets one (race.placement_for)."""
    shared = session.state()  # first: the marked sessions are forgotten even if this load fails
    placement = placement_for(request.target, limits)
    estimate = check_fit(request, limits, runtime, placement)
    yield status + (f" {estimate}" if estimate else "")
    return load_pair(request.target, request.drafter, request.draft, device=limits.device,
                     draft_device=limits.draft_device, runtime=runtime, placement=placement, shared=shared)


def sweep_k(request: RunRequest, limits: AppLimits, runtime: Runtime, k_max: int,
            session: Session = Session(), trees: tuple[str, ...] | None = None) -> Iterator[str | Sweep]:
    """sweep.iter_sweep_summaries on the current prompt, k = 1..k_max under each tree setting in `trees` (None: the
    request's): status lines, then the Sweep after each point. Suffix decoding drafts from the session's earlier
    answers and adds none: every k runs the same prompt."""
    pair = yield from _load(request, limits, runtime, f"Loading {request.target}…", session)
    config = request.config()
    prompt_ids = encode_prompt(pair.target.tokenizer, request.prompt, config.use_chat_template)
    settings = plan_trees(pair, config, trees or (config.tree,))[0]
    yield (f"Timing the autoregressive baseline, then one speculative run per k up to {k_max} with draft trees "
           f"{', '.join(settings)}; the results are drawn when the timed runs are over…")
    with pair.drafter.paused():
        yield from iter_sweep_summaries(pair, [prompt_ids], range(MIN_K, k_max + 1), config, k_max, trees=trees)
