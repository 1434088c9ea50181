"""A target and its drafter (a Pair), built from user-facing names; both decoders on one prompt; the JSON result.

The two runs take turns and never overlap: each one's clock counts only its own compute (see engine.StepEvent.elapsed).
make_drafter builds drafters from names, through the registry; the CLI, the app, the sweep and the benchmark use it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from ..config import BUNDLED_ID, GenerationConfig, Placement, Runtime
from ..drafters import Drafter
from ..drafters.base import Calibration, SharedState
from ..drafters.registry import BuildOptions, get
from ..engine import (
    StepEvent,
    autoregressive,
    decode,
    encode_prompt,
    generated_ids,
    graphs,
    speculative,
)
from ..engine.loop import auto_costs, tree_plan
from ..models.loading import LoadedModel, load_model
from ..models.placement import draft_head, draft_lm, drafter_device
from .metrics import (
    PassCosts,
    RunStats,
    pass_costs,
    run_stats,
    speedup,
    step_ms_by_width,
    tree_passes,
    tree_steps,
    tree_summary,
)
from .spec_metrics import speculative_decoding, steps_of


@dataclass
class Pair:
    """A loaded target and a drafter for it."""

    target: LoadedModel
    drafter: Drafter
    drafter_kind: str  # a registry kind's name
    draft_name: str | None  # None for prompt lookup
    calibration: Calibration | None = None  # what the kind measured at load (the hybrid's cap and its costs)


def drafter_k(drafter: Drafter) -> int | None:
    """The drafter's own k (an EAGLE-3 head's recorded num_speculative_tokens; a hybrid's model's), or None."""
    return getattr(drafter, "num_speculative_tokens", None) or getattr(getattr(drafter, "model", None),
                                                                        "num_speculative_tokens", None)


def make_drafter(target: LoadedModel, kind: str, draft: str | None, device=None, dtype=None,
                 trust_remote_code: bool = False, runtime: Runtime = Runtime(), *,
                 drafter_options: Mapping | None = None, shared: SharedState | None = None
                 ) -> tuple[Drafter, str | None, Calibration | None]:
    """Build a drafter of a registered kind (registry.get(kind).factory): prompt lookup, a draft (the shipped trained
    draft, an EAGLE-3 head, any causal LM sharing the tokenizer: drafters.resolve.resolve_draft says which), the
    hybrid of the two, or any kind registered since. `device` is a draft LM's (None: the default device); an EAGLE-3
    head computes where the target's embeddings are. `drafter_options` holds kinds' options by name
    (registry.options_from; a kind not named: its defaults); `shared` is what drafters keep across requests (suffix
    decoding's earlier answers), owned by the caller (None: nothing kept past this drafter). Returns (drafter, draft
    name or None, the kind's calibration (the hybrid's) or None)."""
    options = BuildOptions(device, dtype, trust_remote_code, runtime, drafter_options or {}, shared, speculative)
    return get(kind).factory(target, draft, options)


def load_pair(target: str, kind: str = "model", draft: str | None = None, device=None, dtype=None,
              draft_device=None, trust_remote_code: bool = False, runtime: Runtime = Runtime(),
              placement: Placement = Placement(), *, drafter_options: Mapping | None = None,
              shared: SharedState | None = None) -> Pair:
    """Load a target (with accelerate's device map when `placement` names one) and its drafter, on draft_device when
    given (else `device`; an EAGLE-3 head: where the target's embeddings are). Models are cached between calls."""
    loaded = load_model(target or BUNDLED_ID, device=device, dtype=dtype, trust_remote_code=trust_remote_code,
                        runtime=runtime, placement=placement)
    graphs.attach(loaded.model, runtime.graphs)
    draft_device = draft_device or (None if placement.active else device)  # `device` names no device under a map
    drafter, draft_name, calibration = make_drafter(loaded, kind, draft, draft_device, dtype, trust_remote_code,
                                                    runtime, drafter_options=drafter_options, shared=shared)
    if draft_lm(drafter) is not None:
        graphs.attach(draft_lm(drafter), runtime.graphs)
    return Pair(loaded, drafter, kind, draft_name, calibration)


def pair_placement(pair: Pair) -> dict:
    """Where the target's parts and the drafter live: the result JSON's `placement`."""
    return {"target": pair.target.where(),
            "draft": {"name": pair.draft_name, "kind": type(pair.drafter).__name__,
                      "device": drafter_device(pair.drafter)}}


def runner_info(pair: Pair) -> dict:
    """How the target's passes (and a draft LM's or an EAGLE-3 head's) run: CUDA graphs, the static cache
    uncaptured, or eager, and why (engine.graphs.describe); the result JSON's `runner`."""
    out = {"target": graphs.describe(pair.target.model)}
    draft = draft_lm(pair.drafter)
    draft = draft_head(pair.drafter) if draft is None else draft
    if draft is not None:
        out["draft"] = graphs.describe(draft)
    return out


WARMUP_TOKENS = 4


def warmup(pair: Pair, rows: Sequence[list[int]], config: GenerationConfig) -> None:
    """A few untimed steps of both runs, at this batch shape (the rows of a batch; one prompt's ids in a list), so
    one-off allocation costs land on no clock. The one warm-up: compare, the sweeps and the bench call it. It leaves
    nothing in what the drafter keeps across requests (a suffix drafter's answers: the timed run would draft its own
    start from it)."""
    short = GenerationConfig(max_new_tokens=WARMUP_TOKENS, num_draft_tokens=config.num_draft_tokens,
                             sampling=config.sampling, tree=config.tree)
    with pair.drafter.paused():
        for drafter in (None, pair.drafter):
            for _ in decode(pair.target.model, pair.target.tokenizer, rows, short, drafter, text=False):
                pass


def stream_pair(pair: Pair, prompt_ids: list[int], config: GenerationConfig) -> Iterator[tuple[str, StepEvent]]:
    """("ar" | "sd", event)s of both decoders taking turns: the next step is always the one of the run whose own clock
    is behind (the autoregressive run first on a tie), so both advance side by side from the first token.

    The steps never overlap, and each clock counts only its own steps; taking turns spreads whatever else the machine
    does (a browser drawing the race, another process) over both runs alike, where one run after the other would let
    a busy spell land on one of them only."""
    tok = pair.target.tokenizer
    runs = {"ar": autoregressive(pair.target.model, tok, prompt_ids, config),
            "sd": speculative(pair.target.model, tok, pair.drafter, prompt_ids, config)}
    clocks = dict.fromkeys(runs, 0.0)
    try:
        while runs:
            which = min(runs, key=clocks.__getitem__)
            event = next(runs[which], None)
            if event is None:
                del runs[which]
                continue
            clocks[which] = event.elapsed
            yield which, event
    finally:
        for run in runs.values():
            run.close()


def first_mismatch(target: LoadedModel, prompt_ids: list[int], a: list[int], b: list[int]) -> dict | None:
    """Where two greedy outputs first differ, the target's top-2 logit gap there (a near-tie means numerics)."""
    i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is None:
        return None
    with torch.inference_mode():
        x = torch.tensor([prompt_ids + a[:i]], device=target.device)
        logits = target.model(input_ids=x, logits_to_keep=1).logits[0, -1].float()
    top = torch.topk(logits, 2)
    return {"index": i, "ar_token": a[i], "sd_token": b[i], "top2_logit_gap": float(top.values[0] - top.values[1]),
            "top2_tokens": [int(t) for t in top.indices]}


def result_dict(pair: Pair, config: GenerationConfig, ar_events: list[StepEvent], sd_events: list[StepEvent],
                prompt_ids: list[int] | None = None) -> dict:
    """The CLI's `generate --json` object (the app's API returns the same keys)."""
    ar, sd = run_stats(ar_events), run_stats(sd_events)
    ar_ids, sd_ids = generated_ids(ar_events), generated_ids(sd_events)
    out = {
        "target": pair.target.name,
        "draft": pair.draft_name,
        "drafter": pair.drafter_kind,
        "k": config.num_draft_tokens,
        "dynamic_k": config.dynamic_k,
        "temperature": config.sampling.temperature,
        "top_p": config.sampling.top_p,
        "verification": config.sampling.rule,
        "max_new_tokens": config.max_new_tokens,
        "device": str(pair.target.device),
        "dtype": str(pair.target.dtype).replace("torch.", ""),
        "placement": pair_placement(pair),
        "runner": runner_info(pair),
        "ar": _run_json(ar_events, ar),
        "sd": {**_run_json(sd_events, sd), "acceptance_rate": sd.acceptance_rate, "mean_accepted": sd.mean_accepted,
               "steps": sd.steps, "drafted": sd.drafted, "accepted": sd.accepted,
               "per_position_acceptance": sd.per_position_acceptance, "accepted_histogram": sd.accepted_histogram,
               "draft_seconds": sd.draft_seconds, "verify_seconds": sd.verify_seconds},
        "speedup": speedup(ar, sd),
        "identical": ar_ids == sd_ids,
        "speculative_decoding": speculative_decoding(steps_of(sd_events), config.num_draft_tokens),  # vLLM's names
        "tree": {"setting": config.tree, **tree_result(pair, config, sd_events)},
    }
    if pair.calibration is not None:  # the hybrid model's cap, and the measured pass costs it came from
        out.update(pair.calibration.as_dict())
    out.update(pair.drafter.settings())  # the options it drafted under (the bench's report records the same)
    if config.sampling.greedy and ar_ids != sd_ids and prompt_ids is not None:
        out["mismatch"] = first_mismatch(pair.target, prompt_ids, ar_ids, sd_ids)
    return out


def tree_result(pair: Pair, config: GenerationConfig, sd_events: list[StepEvent]) -> dict:
    """How the run drafted trees (metrics.tree_summary): the plan, the steps that verified one, what auto did (with
    the costs it sized trees by at the end: the load-time ones corrected by the steps timed so far), tokens per pass
    with the trees and, greedy, from their first branches alone (metrics.tree_passes), and the steps' times by width
    (metrics.step_ms_by_width)."""
    plan = tree_plan(config, pair.drafter)
    return {**tree_summary(plan, *tree_steps(sd_events), sizing_costs(plan, pair.drafter, config),
                           config.num_draft_tokens), **tree_passes(sd_events, config.sampling.greedy),
            "step_ms_by_width": {str(w): v for w, v in step_ms_by_width(sd_events).items()}}  # JSON keys: strings


def sizing_costs(plan, drafter: Drafter, config: GenerationConfig) -> dict[int, float] | None:
    """The costs a run's trees were sized by: under --tree auto those its single-row runs ended on (the load-time
    pass costs corrected by the steps timed so far, engine.loop.auto_costs), else the load-time ones."""
    return auto_costs(drafter, 1, config).costs() if plan.by_cost else drafter.pass_costs


def _run_json(events: list[StepEvent], stats: RunStats) -> dict:
    return {"text": "".join(e.text for e in events), "tokens": stats.tokens, "seconds": stats.seconds,
            "tokens_per_s": stats.tokens_per_s}


def calibrate(pair: Pair, prompt_ids: list[int], config: GenerationConfig, tokens: int = 16) -> PassCosts:
    """Untimed: a warm-up, then both decoders on `tokens` new tokens taking turns; the medians of their passes (what a
    run's passes are compared with, metrics.cost_drift)."""
    warmup(pair, [prompt_ids], config)
    runs: dict[str, list[StepEvent]] = {"ar": [], "sd": []}
    for which, event in stream_pair(pair, prompt_ids, replace(config, max_new_tokens=tokens)):
        runs[which].append(event)
    return pass_costs(runs["ar"], runs["sd"])


def iter_compare(pair: Pair, prompt_ids: list[int], config: GenerationConfig,
                 do_warmup: bool = True) -> Iterator[tuple[str, StepEvent | dict]]:
    """Warm up, then the ("ar" | "sd", event)s of both runs taking turns (stream_pair), then ("result", result_dict).
    Closing the generator stops the run in progress."""
    config.validate()
    if do_warmup:
        warmup(pair, [prompt_ids], config)
    runs: dict[str, list[StepEvent]] = {"ar": [], "sd": []}
    stream = stream_pair(pair, prompt_ids, config)
    try:
        for which, event in stream:
            runs[which].append(event)
            yield which, event
    finally:
        stream.close()
    yield "result", result_dict(pair, config, runs["ar"], runs["sd"], prompt_ids)


def compare(pair: Pair, prompt: str, config: GenerationConfig, do_warmup: bool = True,
            on_event: Callable[[str, StepEvent], None] | None = None) -> dict:
    """Both runs on one prompt, taking turns on the hardware (stream_pair); returns result_dict."""
    prompt_ids = encode_prompt(pair.target.tokenizer, prompt, config.use_chat_template)
    result: dict = {}
    for which, item in iter_compare(pair, prompt_ids, config, do_warmup):
        if which == "result":
            result = item
        elif on_event:
            on_event(which, item)
    return result
