"""Numbers from step events, and the theory of Leviathan et al. 2023 (expected tokens per pass, speedup, best k).

"Mean accepted length" here is tokens committed per speculative target pass, bonus/correction token included;
the first token (from the prefill pass) is counted in tokens/s but not in per-step figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from statistics import median

from ..config import MAX_K
from ..engine import BatchEvent, StepEvent


@dataclass
class RunStats:
    """What one decoder run achieved."""

    tokens: int
    seconds: float
    tokens_per_s: float
    steps: int = 0  # speculative target passes (verify steps), prefill excluded
    drafted: int = 0
    accepted: int = 0
    acceptance_rate: float = 0.0  # accepted drafts / drafted tokens
    mean_accepted: float = 0.0  # tokens per verify pass, bonus/correction included
    per_position_acceptance: list[float] = field(default_factory=list)  # P(draft i accepted), over steps that drafted i
    accepted_histogram: list[int] = field(default_factory=list)  # steps with 0, 1, ..., k accepted drafts
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def draft_depth(event: StepEvent) -> int:
    """How deep a step drafted: a chain's length, a tree's deepest node (StepEvent.parents; -1 is the root)."""
    if event.parents is None:
        return len(event.drafted)
    depth: list[int] = []
    for parent in event.parents:
        depth.append(1 if parent < 0 else depth[parent] + 1)
    return max(depth, default=0)


def run_stats(events: list[StepEvent]) -> RunStats:
    """Summarize a finished (or stopped) run."""
    if not events:
        return RunStats(0, 0.0, 0.0)
    tokens = events[-1].num_generated
    seconds = events[-1].elapsed
    spec = [e for e in events if e.kind == "spec"]
    drafted = sum(len(e.drafted) for e in spec)
    accepted = sum(e.num_accepted for e in spec)
    depths = [draft_depth(e) for e in spec]  # a tree's positions are its depths, not its node indices
    width = max(depths, default=0)
    proposed_at = [sum(1 for d in depths if d > i) for i in range(width)]
    accepted_at = [sum(1 for e in spec if e.num_accepted > i) for i in range(width)]
    histogram = [0] * (width + 1)
    for e in spec:
        histogram[e.num_accepted] += 1
    return RunStats(
        tokens=tokens,
        seconds=seconds,
        tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
        steps=len(spec),
        drafted=drafted,
        accepted=accepted,
        acceptance_rate=accepted / drafted if drafted else 0.0,
        mean_accepted=sum(len(e.tokens) for e in spec) / len(spec) if spec else 0.0,
        per_position_acceptance=[a / p if p else 0.0 for a, p in zip(accepted_at, proposed_at)],
        accepted_histogram=histogram if spec else [],
        draft_seconds=sum(e.draft_seconds for e in spec),
        verify_seconds=sum(e.verify_seconds for e in spec),
    )


def tree_steps(events: Sequence[StepEvent]) -> tuple[int, int]:
    """(speculative steps that verified a draft tree, speculative steps that drafted anything) of one run."""
    spec = [e for e in events if e.kind == "spec" and e.drafted]
    return sum(e.parents is not None for e in spec), len(spec)


def step_ms_by_width(events: Sequence[StepEvent]) -> dict[int, list[float]]:
    """{verify width: [steps, their median milliseconds (drafting and verifying)]} of one row's speculative steps:
    what --tree auto's cost model reads (engine.timing.StepCosts)."""
    by: dict[int, list[float]] = {}
    for e in events:
        if e.kind == "spec":
            by.setdefault(1 + len(e.drafted), []).append(1e3 * (e.draft_seconds + e.verify_seconds))
    return {w: [len(s), round(median(s), 2)] for w, s in sorted(by.items())}


def tree_summary(plan, trees: int, drafted_steps: int, pass_costs: dict[int, float] | None, k: int) -> dict:
    """The result's `tree`: the plan (engine.loop.TreePlan: the node budget, whether auto cut it by pass costs, why)
    and how many drafting steps verified a tree; under auto with none, that it fell back to chains, and the costs
    that made it (a pass one node wider than the chain's); under auto, `sized_by`: the costs (string keys, for
    JSON)."""
    note = plan.why
    if plan.by_cost and drafted_steps and not trees:
        note = "auto fell back to chains: no branch paid for the wider pass it needs"
        if pass_costs and k in pass_costs and k + 1 in pass_costs:
            note += (f" (here a {k + 2}-token pass costs {pass_costs[k + 1]:.2f}x a 1-token one, a {k + 1}-token "
                     f"pass {pass_costs[k]:.2f}x)")
    return {"nodes": plan.nodes, "by_cost": plan.by_cost, "tree_steps": trees, "drafted_steps": drafted_steps,
            "note": note, **({"sized_by": {str(n): c for n, c in pass_costs.items()}} if plan.by_cost else {})}


def first_branch_tokens(event: StepEvent) -> int:
    """Under greedy, the tokens a step would have committed had it verified only its tree's first branch (the chain of
    first children the tree drafters grow from): the accepted path's prefix along first children, plus the target's
    token; a chain step's own tokens. Exact for that step's context (a wrong first child is never the target's top
    token, since siblings differ); a chain run's later steps start elsewhere."""
    if event.parents is None:
        return len(event.tokens)
    kept, node = 0, -1
    for j in event.accepted_path or []:
        if j != event.first_child(node):
            break
        kept, node = kept + 1, j
    return min(kept + 1, len(event.tokens))


def tree_passes(events: Sequence[StepEvent], greedy: bool) -> dict:
    """Tokens per verify pass (bonus or correction included) of a run, over its passes that verified a tree, and,
    greedy only, what their first branches alone would have given on the same passes (first_branch_tokens; None
    when sampling, where a pass cannot be replayed as a chain, or when no pass verified a tree)."""
    spec = [e for e in events if e.kind == "spec"]
    trees = [e for e in spec if e.parents is not None]
    return {"tokens_per_pass": ratio(sum(len(e.tokens) for e in spec), len(spec)),
            "tree_tokens_per_pass": ratio(sum(len(e.tokens) for e in trees), len(trees)) if trees else None,
            "first_branch_tokens_per_pass": (ratio(sum(map(first_branch_tokens, spec)), len(spec))
                                             if greedy and trees else None)}


def verify_by_nodes(events: Sequence[StepEvent]) -> dict[str, list[float]]:
    """{nodes verified: [passes, their verify seconds]} over a run's speculative steps (a pass of n nodes is n + 1
    tokens wide); JSON keys, so the nodes are strings."""
    out: dict[str, list[float]] = {}
    for e in events:
        if e.kind == "spec":
            entry = out.setdefault(str(len(e.drafted)), [0, 0.0])
            entry[0] += 1
            entry[1] += e.verify_seconds
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def ratio(a: float, b: float) -> float:
    """a / b, 0 when b is 0: every ratio of sums in the results (tokens/s, speedups, fractions)."""
    return a / b if b > 0 else 0.0


def speedup(ar: RunStats, sd: RunStats) -> float:
    """Speculative tokens/s over autoregressive tokens/s."""
    return ratio(sd.tokens_per_s, ar.tokens_per_s)


def expected_tokens(alpha: float, k: int) -> float:
    """E[tokens per target pass] = (1 - alpha^(k+1)) / (1 - alpha)  (Leviathan et al., eq. 1)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, c: float, k: int, verify_cost: float = 1.0) -> float:
    """Expected walltime improvement E[tokens] / (k*c + verify_cost)  (Leviathan et al., Thm 3.8).

    c is the draft's cost per token relative to one target pass; verify_cost is the cost of a (k+1)-token
    target pass relative to a 1-token pass (1 on a GPU per the paper; measurably more on a CPU).
    """
    return expected_tokens(alpha, k) / (k * c + verify_cost)


def best_k(alpha: float, c: float, k_max: int = MAX_K, verify_costs: dict[int, float] | None = None,
           min_k: int = 1) -> int:
    """The k in min_k..k_max that maximizes expected_speedup (the smallest on a tie). With min_k = 0, k = 0 (no
    speculation) is worth exactly 1: what auto k picks for a batch where speculation stops paying."""
    costs = verify_costs or {}
    return max(range(min_k, k_max + 1), key=lambda k: expected_speedup(alpha, c, k, costs.get(k, 1.0)) if k else 1.0)


def alpha_from_mean_accepted(mean_accepted: float, k: int) -> float:
    """Invert expected_tokens for alpha, given a measured mean accepted length (bonus included) at fixed k."""
    target = min(max(mean_accepted, 1.0), k + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(60):  # bisection; expected_tokens is increasing in alpha
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < target else (lo, mid)
    return (lo + hi) / 2



# ---- whether a run's passes cost what they cost when the pair was calibrated ----

BUSY_RATIO = 1.5  # a pass median this far from its calibrated value (either way) means the machine was not the same
# a drafted token cheaper than this share of a target pass is too small to judge, and too small to matter: prompt
# lookup's, and the EAGLE-3 head's on a CPU since its weights stream as float16 (0.53-0.70 ms against a 28-31 ms
# pass, 1.8-2.3%: its median once read 1.66x its calibration in a run whose passes kept their cost)
DRAFT_FLOOR = 0.05


@dataclass(frozen=True)
class PassCosts:
    """Median seconds of a run's passes: a 1-token target pass (the autoregressive steps), a verify pass (draft and
    target's checking step, prefill excluded) and a drafted token. None where the run had no such step."""

    target_pass: float | None
    verify_pass: float | None
    draft_token: float | None

    def as_dict(self) -> dict:
        return asdict(self)


def pass_costs(ar_events: list[StepEvent], sd_events: list[StepEvent]) -> PassCosts:
    """The medians of PassCosts from two runs' events."""
    spec = [e for e in sd_events if e.kind == "spec" and e.drafted]
    return PassCosts(_median([e.verify_seconds for e in ar_events if e.kind == "ar"]),
                     _median([e.verify_seconds for e in spec]),
                     _median([e.draft_seconds / len(e.drafted) for e in spec]))


def cost_drift(calibrated: PassCosts, run: PassCosts, limit: float = BUSY_RATIO,
               judge_draft: bool = True) -> dict[str, float]:
    """{which pass: run's median / calibrated median} for every pass whose ratio is beyond `limit` either way: empty
    when the run's passes cost what they did at calibration. Drafts cheaper than DRAFT_FLOOR of a target pass are not
    judged (their timer's own noise is larger than they are), nor any draft without `judge_draft` (a hybrid's cost per
    drafted token depends on how much of the text prompt lookup drafted, so it changes with the prompt)."""
    drift = {}
    for name in ("target_pass", "verify_pass") + (("draft_token",) if judge_draft else ()):
        was, now = getattr(calibrated, name), getattr(run, name)
        if not was or not now:
            continue
        if name == "draft_token" and (not calibrated.target_pass or was < DRAFT_FLOOR * calibrated.target_pass):
            continue
        ratio = now / was
        if ratio > limit or ratio < 1 / limit:
            drift[name] = round(ratio, 2)
    return drift


def _median(xs: list[float]) -> float | None:
    return median(xs) if xs else None


@dataclass
class BatchStats:
    """What one batched run achieved, pooled over its rows."""

    tokens: int
    seconds: float
    tokens_per_s: float  # all rows' tokens over the run's compute time
    steps: int = 0  # speculative target passes (prefill excluded)
    row_steps: int = 0  # (row, speculative pass) pairs: each row's own verify passes
    drafted: int = 0
    accepted: int = 0
    acceptance_rate: float = 0.0  # accepted drafts / drafted tokens
    mean_accepted: float = 0.0  # tokens per row per verify pass, bonus/correction included
    mean_width: float = 0.0  # tokens per row in a target pass (1 + the step's longest proposal)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    draft_positions: int = 0  # sum over steps of the longest proposal: sequential draft positions
    passes: int = 0  # target passes after the prefill (autoregressive or speculative steps)
    pass_seconds: float = 0.0  # their seconds (a speculative step's verify part: pass, acceptance, rollback)


def batch_stats(events: Sequence[BatchEvent]) -> BatchStats:
    """Summarize a finished batched run."""
    if not events:
        return BatchStats(0, 0.0, 0.0)
    tokens, seconds = events[-1].num_generated, events[-1].elapsed
    spec = [e for e in events if e.kind == "spec"]
    row_steps = sum(len(e.rows) for e in spec)
    drafted = sum(len(d) for e in spec for d in e.drafted)
    accepted = sum(sum(e.num_accepted) for e in spec)
    return BatchStats(
        tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
        steps=len(spec), row_steps=row_steps, drafted=drafted, accepted=accepted,
        acceptance_rate=accepted / drafted if drafted else 0.0,
        mean_accepted=sum(len(t) for e in spec for t in e.tokens) / row_steps if row_steps else 0.0,
        mean_width=sum(e.width for e in spec) / len(spec) if spec else 0.0,
        draft_seconds=sum(e.draft_seconds for e in spec), verify_seconds=sum(e.verify_seconds for e in spec),
        draft_positions=sum(max((len(d) for d in e.drafted), default=0) for e in spec),
        passes=sum(e.kind != "prefill" for e in events),
        pass_seconds=sum(e.verify_seconds for e in events if e.kind != "prefill"),
    )
