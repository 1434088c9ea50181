"""The k sweep: autoregressive once per prompt, speculative at each k (under each draft-tree setting asked for),
measured speedups beside the theory.

Shared by `python -m specdemo bench` and the app's "Tune k" tab. Knows decoders and metrics; no text, no UI.
Pass costs are measured by specdemo.engine.timing.
Theory: Leviathan et al. 2023 (metrics.expected_speedup) with alpha fitted from the measured mean accepted length.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace

import torch

from ..config import MAX_K, GenerationConfig
from ..engine import (
    StepEvent,
    autoregressive,
    encode_prompt,
    generated_ids,
    speculative,
)
from ..engine.loop import tree_plan
from ..engine.timing import timed_call, verify_costs_for
from .compare import Pair, warmup
from .metrics import (
    RunStats,
    alpha_from_mean_accepted,
    best_k,
    expected_speedup,
    run_stats,
    tree_steps,
)


@dataclass
class Run:
    """One decoder run: its events and the wall time around the whole call (perf_counter, CUDA-synchronized)."""

    events: list[StepEvent]
    wall_seconds: float

    @property
    def stats(self) -> RunStats:
        return run_stats(self.events)

    @property
    def ids(self) -> list[int]:
        return generated_ids(self.events)

    @property
    def tokens(self) -> int:
        return self.events[-1].num_generated if self.events else 0



def timed(events: Iterator[StepEvent], device: torch.device | str | None = None) -> Run:
    """Drain a decoder, timing the whole call with the same clock as the transformers anchors."""
    return Run(*timed_call(lambda: list(events), device))


def run_ar(pair: Pair, prompt_ids: list[int], config: GenerationConfig) -> Run:
    """Our autoregressive decoder on the pair's target."""
    t = pair.target
    return timed(autoregressive(t.model, t.tokenizer, prompt_ids, config), t.device)


def run_sd(pair: Pair, prompt_ids: list[int], config: GenerationConfig) -> Run:
    """Our speculative decoder with the pair's drafter."""
    t = pair.target
    return timed(speculative(t.model, t.tokenizer, pair.drafter, prompt_ids, config), t.device)


@dataclass
class SweepPoint:
    """Speculative decoding at one k, pooled over prompts (each prompt's autoregressive run is the baseline)."""

    k: int
    ar_seconds: float
    sd_seconds: float
    ar_tokens: int
    sd_tokens: int
    speedup: float  # total autoregressive seconds / total speculative seconds
    acceptance_rate: float  # accepted drafts / drafted tokens
    mean_accepted: float  # tokens per verify pass, bonus/correction included
    mean_drafted: float  # drafted tokens per verify pass (prompt lookup may propose fewer than k, or none)
    alpha: float  # metrics.alpha_from_mean_accepted(mean_accepted, k)
    c: float  # draft seconds per drafted token / seconds per 1-token target pass
    verify_cost: float  # seconds per verify step (target pass + acceptance + rollback) / seconds per AR step
    expected_speedup: float  # theory at this point's alpha, c and verify_cost
    identical: bool  # every prompt's speculative tokens equal its autoregressive tokens
    tree: str = "off"  # the draft-tree setting of the runs (GenerationConfig.tree)
    tree_steps: int = 0  # verify passes that verified a draft tree (0: the runs drafted chains)


@dataclass
class Sweep:
    """Measured points (each k under each tree setting), the alpha and c pooled over the points that drafted chains,
    and the theoretical speedup curve over k for chains."""

    points: list[SweepPoint]
    alpha: float  # verify-step-weighted mean of the points' alphas
    c: float
    verify_costs: dict[int, float]  # k -> seconds of a (k+1)-token target pass / a 1-token pass
    theory: dict[int, float] = field(default_factory=dict)  # k -> metrics.expected_speedup
    best_k: int = 1  # metrics.best_k(alpha, c, k_max, verify_costs)
    best_measured_k: int = 1
    best_measured_tree: str = "off"  # the tree setting of the fastest point
    trees: dict[str, str] = field(default_factory=dict)  # each tree setting asked for -> what it drafts (or which
    # setting it ran as, when it drafts chains as another does)

    def as_dict(self) -> dict:
        out = asdict(self)
        out["verify_costs"] = {str(k): v for k, v in self.verify_costs.items()}
        out["theory"] = {str(k): v for k, v in self.theory.items()}
        return out


def point(k: int, ar_runs: Sequence[Run], sd_runs: Sequence[Run], tree: str = "off") -> SweepPoint:
    """Pool one k's runs under one tree setting (ar_runs[i] and sd_runs[i] are the same prompt)."""
    ar_s = sum(r.wall_seconds for r in ar_runs)
    sd_s = sum(r.wall_seconds for r in sd_runs)
    spec = [e for r in sd_runs for e in r.events if e.kind == "spec"]
    steps = len(spec)
    drafted = sum(len(e.drafted) for e in spec)
    accepted = sum(e.num_accepted for e in spec)
    mean_accepted = sum(len(e.tokens) for e in spec) / steps if steps else 0.0
    ar_steps = [e.verify_seconds for r in ar_runs for e in r.events if e.kind == "ar"]
    t_ar = sum(ar_steps) / len(ar_steps) if ar_steps else 0.0
    draft_s = sum(e.draft_seconds for e in spec)
    c = draft_s / drafted / t_ar if drafted and t_ar else 0.0
    verify_cost = sum(e.verify_seconds for e in spec) / steps / t_ar if steps and t_ar else 1.0
    alpha = alpha_from_mean_accepted(mean_accepted, k)
    return SweepPoint(
        k=k, ar_seconds=ar_s, sd_seconds=sd_s,
        ar_tokens=sum(r.tokens for r in ar_runs), sd_tokens=sum(r.tokens for r in sd_runs),
        speedup=ar_s / sd_s if sd_s > 0 else 0.0,
        acceptance_rate=accepted / drafted if drafted else 0.0,
        mean_accepted=mean_accepted, mean_drafted=drafted / steps if steps else 0.0,
        alpha=alpha, c=c, verify_cost=verify_cost,
        expected_speedup=expected_speedup(alpha, c, k, verify_cost),
        identical=all(a.ids == s.ids for a, s in zip(ar_runs, sd_runs)),
        tree=tree, tree_steps=sum(tree_steps(r.events)[0] for r in sd_runs),
    )


def summarize(points: Sequence[SweepPoint], verify_costs: dict[int, float], k_max: int = MAX_K,
              trees: dict[str, str] | None = None) -> Sweep:
    """Pool alpha and c over the points that drafted chains (all points when none did) and draw the theoretical
    curve for k = 1..k_max; the fastest point gives the best measured k and tree setting.

    verify_costs maps k to the cost of its (k+1)-token verify pass; k missing there costs 1 (the paper's GPU case).
    """
    chains = [p for p in points if not p.tree_steps] or list(points)  # Leviathan et al.'s theory is of chains
    weights = [p.sd_tokens / p.mean_accepted if p.mean_accepted else 0.0 for p in chains]  # ~ verify steps
    total = sum(weights)
    alpha = sum(w * p.alpha for w, p in zip(weights, chains)) / total if total else 0.0
    c = sum(w * p.c for w, p in zip(weights, chains)) / total if total else 0.0
    k_max = max([k_max] + [p.k for p in points])
    theory = {k: expected_speedup(alpha, c, k, verify_costs.get(k, 1.0)) for k in range(1, k_max + 1)}
    best = max(points, key=lambda p: p.speedup) if points else None
    return Sweep(
        points=list(points), alpha=alpha, c=c, verify_costs=dict(verify_costs), theory=theory,
        best_k=best_k(alpha, c, k_max, verify_costs),
        best_measured_k=best.k if best else 1, best_measured_tree=best.tree if best else "off",
        trees=dict(trees or {}),
    )


def plan_trees(pair: Pair, config: GenerationConfig, trees: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """The tree settings worth running (engine.loop.tree_plan: the first that drafts chains, and each that drafts
    trees) and what each asked for does, in words."""
    run, notes, chains = [], {}, None
    for setting in dict.fromkeys(trees):
        plan = tree_plan(replace(config, tree=setting), pair.drafter)
        if plan.nodes == 0 and chains is not None:
            notes[setting] = f"runs as {chains}: {plan.why}"
            continue
        chains = setting if plan.nodes == 0 else chains
        run.append(setting)
        notes[setting] = plan.why
    return run, notes


def encode_all(pair: Pair, prompts: str | Sequence[str] | Sequence[list[int]],
               config: GenerationConfig) -> list[list[int]]:
    """Prompt strings (chat-templated per config) or ready id lists, as id lists."""
    if isinstance(prompts, str):
        prompts = [prompts]
    tok = pair.target.tokenizer
    return [p if isinstance(p, list) else encode_prompt(tok, p, config.use_chat_template) for p in prompts]


def iter_sweep(
    pair: Pair,
    prompts: str | Sequence[str] | Sequence[list[int]],
    ks: Sequence[int],
    config: GenerationConfig,
    do_warmup: bool = True,
    on_run: Callable[[str, int | None, int], None] | None = None,
    trees: Sequence[str] | None = None,
) -> Iterator[SweepPoint]:
    """Autoregressive runs on every prompt first, then speculative runs per tree setting and k (`trees`: settings
    like off, auto, 8; None: config.tree; plan_trees drops those that would repeat a chain run); yields each point
    when done.

    on_run(kind, k, prompt_index) is called after every run ("ar" with k None, or "sd"), e.g. for a progress bar.
    Every k sees the same prompts, so the runs leave nothing in what the drafter keeps across requests (Drafter.paused):
    each k drafts from what a suffix drafter's cache held before the sweep, never from another k's answer to the same
    prompt.
    """
    ids = encode_all(pair, prompts, config)
    settings = plan_trees(pair, config, trees or (config.tree,))[0]
    if do_warmup and ids:
        for setting in settings:
            warmup(pair, ids[:1], replace(config, tree=setting))
    ar_runs = []
    for i, p in enumerate(ids):
        ar_runs.append(run_ar(pair, p, config))
        if on_run:
            on_run("ar", None, i)
    for setting in settings:
        for k in ks:
            k_config = replace(config, num_draft_tokens=k, dynamic_k=False, tree=setting)
            sd_runs = []
            for i, p in enumerate(ids):
                with pair.drafter.paused():
                    sd_runs.append(run_sd(pair, p, k_config))
                if on_run:
                    on_run("sd", k, i)
            yield point(k, ar_runs, sd_runs, setting)


def sweep(
    pair: Pair,
    prompts: str | Sequence[str] | Sequence[list[int]],
    ks: Sequence[int] = (1, 2, 4, 8),
    config: GenerationConfig | None = None,
    k_max: int = MAX_K,
    measure_verify_costs: bool = True,
    do_warmup: bool = True,
    on_run: Callable[[str, int | None, int], None] | None = None,
    trees: Sequence[str] | None = None,
) -> Sweep:
    """Run the sweep over k (and tree settings, as iter_sweep) and fit the theory: per-point measured speedup,
    acceptance, alpha, c, verify cost; best k.

    With measure_verify_costs, the theory's verify cost for each k comes from a short forward-pass micro-benchmark
    (CPU passes cost more with width); without it, a verify pass costs one 1-token pass, as in the paper.
    """
    config = config or GenerationConfig()
    points = list(iter_sweep(pair, prompts, ks, config, do_warmup, on_run, trees))
    costs = {}
    if measure_verify_costs:
        first = encode_all(pair, prompts, config)[0]
        costs = verify_costs_for(pair.target.model, [first], max([k_max] + list(ks)))
    return summarize(points, costs, k_max, plan_trees(pair, config, trees or (config.tree,))[1])


def iter_sweep_summaries(pair: Pair, prompts: str | Sequence[str] | Sequence[list[int]], ks: Sequence[int],
                         config: GenerationConfig, k_max: int = MAX_K, do_warmup: bool = True,
                         on_run: Callable[[str, int | None, int], None] | None = None,
                         trees: Sequence[str] | None = None) -> Iterator[Sweep]:
    """The Sweep so far after each point, its theory drawn with each k's verify cost as measured in its own chain runs
    (no micro-benchmark, so a live view can show every point as soon as it is done)."""
    notes = plan_trees(pair, config, trees or (config.tree,))[1]
    points: list[SweepPoint] = []
    for p in iter_sweep(pair, prompts, ks, config, do_warmup, on_run, trees):
        points.append(p)
        chains = [q for q in points if not q.tree_steps] or points
        yield summarize(points, {q.k: q.verify_cost for q in chains}, k_max, notes)
