"""The one decoder: B prompts decoded together, one target pass per step for all of them; B = 1 is the ordinary case
and autoregressive decoding is the engine with no drafter.

Each row drafts with the drafter's state for it, accepts its own number of tokens (verify's rules) and finishes on
its own (EOS, stop string, length). Yields a BatchEvent per step; `speculative` and `autoregressive` give one row's
StepEvents. No UI, no metrics beyond per-step timings.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import torch

from ..config import AUTO_TREE_NODES_GPU, MAX_K_ENGINE, GenerationConfig, SamplingConfig
from ..drafters.base import DeviceTrees, Drafter, DraftRequest, Proposal, Verdict
from ..models.placement import to_device
from . import graphs
from .device_step import Verified, verify_chains_on_device, verify_trees_on_device
from .events import BatchEvent, Committer, StepEvent, check_request, eos_ids
from .kv import check_cache, right_padded
from .static import needed_capacity
from .timing import Clock, StepCosts, step_costs
from .tree import TokenTree, TreeBatch, greedy_tree_accept_batch, tree_accept_batch, tree_accept_each
from .verify import greedy_accept_batch, inspect_verify, logits_to_probs, sample_rows, sampled_accept_batch

KPolicy = Callable[[int], int]  # the current batch size -> k (0: no speculation this step)
# when drafts (greedy chains or trees where the drafter grows them there, sampled chains under either verification
# rule) stay on the device, verified there and read back once a step (Drafter.propose_on_device,
# engine.device_step): "capture" where the target's passes are graph-captured (every row then feeds all its entries:
# nothing more on a GPU, a wider pass on a CPU), "always" (the tests; sampled trees then walked as on a GPU), "never"
ONE_READ = "capture"


def seeded_generator(device: torch.device, seed: int) -> torch.Generator:
    """The explicit torch.Generator a row samples from (its own, so a seed reproduces the run)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


class _Rows:
    """The rows still decoding: their prompt index, committer and generator (row i samples from seed + i)."""

    def __init__(self, tokenizer, prompts: Sequence[list[int]], config: GenerationConfig, eos: frozenset[int],
                 device: torch.device, text: bool):
        self.index = list(range(len(prompts)))
        self.out = [Committer(tokenizer, p, config, eos, text) for p in prompts]
        self.gens = [seeded_generator(device, config.seed + i) for i in range(len(prompts))]
        self.generated = 0

    def __len__(self) -> int:
        return len(self.index)

    def commit(self, tokens: Sequence[list[int]]) -> list[tuple[list[int], str]]:
        """Each row's (kept tokens, text delta)."""
        done = [out.commit(t) for out, t in zip(self.out, tokens)]
        self.generated += sum(len(k) for k, _ in done)
        return done

    def unfinished(self) -> list[int]:
        """Positions of rows that have not finished."""
        return [r for r, out in enumerate(self.out) if out.finish_reason is None]

    def select(self, rows: list[int]) -> None:
        self.index = [self.index[r] for r in rows]
        self.out = [self.out[r] for r in rows]
        self.gens = [self.gens[r] for r in rows]


def _choose(logits: torch.Tensor, sampling: SamplingConfig, gens) -> list[int]:
    """The next token of each row from logits (B, V): one argmax when greedy, else a sample per row from its own
    generator (verify.sample_rows: torch.multinomial's draw), every row read back in one copy."""
    if sampling.greedy:
        return logits.argmax(-1).tolist()
    return sample_rows(logits_to_probs(logits, sampling), gens).tolist()


def _verify(logits: torch.Tensor, tokens: torch.Tensor, drafted: list[list[int]], qs: list[torch.Tensor | None],
            sampling: SamplingConfig, gens, inspect: bool) -> list[Verified]:
    """Each row's acceptance of its chain from the verify pass: logits (B, W, V), tokens (B, W) = pending token +
    drafts, qs each row's draft distributions (None: a deterministic drafter)."""
    lengths = [len(d) for d in drafted]
    if sampling.greedy:
        accepted, nxt = greedy_accept_batch(tokens[:, 1:], to_device(lengths, tokens.device), logits)
        probs = None
    else:  # every row at once on the device, read back once
        probs = logits_to_probs(logits, sampling)  # (B, W, V)
        accepted, nxt = sampled_accept_batch(tokens[:, 1:], lengths, qs, probs, gens, sampling.verification)
    seen = [inspect_verify(logits[r, : n + 1], None if probs is None else probs[r, : n + 1], tokens[r, 1 : 1 + n])
            if inspect else None for r, n in enumerate(lengths)]
    return [Verified(list(range(a)), t, s) for a, t, s in zip(accepted, nxt, seen)]


def _verify_trees(logits: torch.Tensor, tokens: torch.Tensor, trees: list[TokenTree], batch: TreeBatch,
                  qs: list[torch.Tensor | None], sampling: SamplingConfig, gens, inspect: bool) -> list[Verified]:
    """Each row's acceptance of its tree (a chain row's: its chain as a tree) from the verify pass: greedy, the
    longest path the target agrees with; sampling, recursive rejection sampling (engine.tree.tree_accept): on a GPU
    for every row at once, read back once (tree_accept_batch), on a CPU row by row (tree_accept_each: cheaper there,
    where reads cost nothing)."""
    if sampling.greedy:
        paths, nxt = greedy_tree_accept_batch(trees, logits, batch)
        probs = None
    else:
        probs = logits_to_probs(logits, sampling)  # (B, W, V)
        rows = [None if q is None else q[: len(t)].to(probs.device) for t, q in zip(trees, qs)]
        accept = tree_accept_batch if probs.device.type != "cpu" or ONE_READ == "always" else tree_accept_each
        paths, nxt = accept(trees, rows, probs, gens)
    seen = [inspect_verify(logits[r, : len(t) + 1], None if probs is None else probs[r, : len(t) + 1],
                           tokens[r, 1 : 1 + len(t)], list(t.parents)) if inspect else None
            for r, t in enumerate(trees)]
    return [Verified(p, t, s) for p, t, s in zip(paths, nxt, seen)]


def _as_verified(p: Proposal, k: int, nodes: int
                 ) -> tuple[TokenTree | None, list[int], torch.Tensor | None, list[float] | None, list[float] | None]:
    """A row's proposal as it is verified: (its tree, None for a chain; the drafted tokens; their q rows, None for a
    deterministic drafter; q of each kept token, for the inspector; each kept node's value, Proposal.values). A tree
    keeps its first `nodes` nodes no deeper than k (asked for none: the chain of its first children); a tree that is
    a chain is verified as one."""
    if p.parents is None:
        return None, p.tokens[:k], p.probs, None if p.token_probs is None else p.token_probs[:k], None
    tree = TokenTree(p.tokens, p.parents)
    if nodes > 0:
        keep = [j for j, d in enumerate(tree.depths) if d <= k][: min(nodes, MAX_K_ENGINE)]
    else:
        keep, node = [], -1
        while tree.children(node) and len(keep) < k:
            node = tree.children(node)[0]
            keep.append(node)
    tree = tree.select(keep)
    probs = None if p.probs is None else p.probs[to_device(keep, p.probs.device, torch.long)]
    token_probs = None if p.token_probs is None else [p.token_probs[j] for j in keep]
    values = None if p.values is None else [p.values[j] for j in keep]
    return (None if tree.is_chain() else tree), list(tree.tokens), probs, token_probs, values


def _path_features(features: torch.Tensor | None, r: int, path: list[int], tree: TokenTree | None):
    """Row r's target features (num_accepted + 1, W) at the pending token and its accepted drafts, or None."""
    if features is None:
        return None
    if tree is None:
        return features[r, : len(path) + 1]
    return features[r, to_device([0] + [j + 1 for j in path], features.device)]


@dataclass(frozen=True)
class TreePlan:
    """How a decode drafts: each row's node budget for a draft tree (0: chains), whether the drafter cuts each tree
    by what a wider step costs (--tree auto: the target's pass costs timed at load, corrected as the run's steps are
    timed, engine.timing.StepCosts), and why, in words."""

    nodes: int
    by_cost: bool
    why: str


def tree_plan(config: GenerationConfig, drafter: Drafter | None, takes_trees: bool = True) -> TreePlan:
    """--tree N allows N nodes; auto up to the widest pass the drafter's pass costs were timed for (at most
    AUTO_TREE_NODES_GPU: config.auto_tree_nodes), cut by those costs. Chains where trees are off, where the drafter
    drafts none or, under auto, has no pass costs to size one by, under block verification (it judges chains only),
    and where the target's attention takes no tree mask (`takes_trees`)."""
    nodes = config.tree_nodes
    if nodes == 0:
        return TreePlan(0, False, "chains (--tree off)")
    if drafter is None or not drafter.drafts_trees:
        return TreePlan(0, False, "chains: this drafter drafts no trees")
    if config.sampling.rule == "block":
        return TreePlan(0, False, "chains: block verification judges chains only")
    if drafter.greedy_trees_only and not config.sampling.greedy:
        return TreePlan(0, False, "chains: this drafter's trees are greedy only")
    if not takes_trees:
        return TreePlan(0, False, "chains: the target's attention takes no tree mask (sdpa or eager do)")
    if nodes is not None:
        return TreePlan(nodes, False, f"trees of up to {nodes} nodes (--tree {nodes})")
    if not drafter.pass_costs:
        return TreePlan(0, False, "chains: no pass costs timed on the target to size a tree by")
    nodes = min(AUTO_TREE_NODES_GPU, max(drafter.pass_costs))
    return TreePlan(nodes, True, f"trees of up to {nodes} nodes, branches kept where they pay for the wider pass "
                                 f"(--tree auto)")


def auto_width(width: int, kept: int, budget: int) -> int:
    """Under --tree auto with trees verified on the device and read back once with the verdicts, how many nodes the
    next step's pass verifies: it is sized before its tree is read, so it follows auto's cut a step late, at what
    this step's widest tree kept (at least 1), or, where the cut filled the width (it may have kept more), at twice
    the width, up to the budget."""
    return min(budget, 2 * width) if kept >= width else max(1, kept)


def auto_costs(drafter: Drafter, rows: int, config: GenerationConfig) -> StepCosts:
    """The step costs that size this drafter's trees under --tree auto at this batch size, k and sampling: its pass
    costs timed at load, corrected by its runs' steps (engine.timing.StepCosts)."""
    return step_costs(drafter, (rows, config.num_draft_tokens, config.sampling.greedy), drafter.pass_costs)


class _Run:
    """One decode's state: its rows, the target's cache, the clock, the drafter, each row's pending token (chosen,
    not yet in the cache) and k."""

    def __init__(self, target, tokenizer, prompts: Sequence[list[int]], config: GenerationConfig,
                 drafter: Drafter | None, inspect: bool, text: bool):
        check_request(prompts, config)
        check_cache(target, len(prompts))
        self.config, self.sampling, self.drafter, self.inspect = config, config.sampling, drafter, inspect
        self.kv = graphs.new_kv(target, len(prompts), needed_capacity(prompts, config.max_new_tokens, MAX_K_ENGINE + 1))
        self.device = self.kv.device  # where the input ids go, under a device map too
        self.clock = Clock(self.device)
        self.eos = eos_ids(target, tokenizer)
        self.rows = _Rows(tokenizer, prompts, config, self.eos, self.device, text)
        self.layers = tuple(drafter.target_layers) if drafter is not None and drafter.needs_target_hidden else None
        self.chosen: list[int] = []
        self.row_k = [config.num_draft_tokens] * len(prompts)
        self.tree = tree_plan(config, drafter, self.kv.takes_trees)
        runner = getattr(self.kv, "runner", None)
        self.one_read = drafter is not None and (ONE_READ == "always" or (ONE_READ == "capture"
                                                                          and getattr(runner, "capture", False)))
        # under --tree auto: what steps cost by width, as this drafter's runs have measured them so far
        self.costs = auto_costs(drafter, len(prompts), config) if self.tree.by_cost else None
        if self.costs is not None:
            self.costs.restart()
        self.width = self.tree.nodes  # under --tree auto with one read a step: the next pass's nodes (auto_width)

    def warm(self, widths: Sequence[int], prompts: Sequence[list[int]]) -> None:
        """Capture the target's passes of these widths and the drafter's (Drafter.warm) before the clock runs, where
        graph runners serve them."""
        runner = getattr(self.kv, "runner", None)
        if runner is not None:
            runner.warm(self.kv, len(self.rows), widths, self.layers)
        if self.drafter is not None:
            k, nodes = self.config.num_draft_tokens, self.tree.nodes
            costs = self.costs.costs() if self.costs is not None else None
            self.drafter.warm(prompts, DraftRequest(prompts, [k] * len(prompts), self.sampling, self.rows.gens,
                                                    self.eos, [nodes] * len(prompts), costs))

    def retire(self) -> bool:
        """Let finished rows leave the batch (the cache, the drafter, the pending tokens); False when none is left."""
        keep = self.rows.unfinished()
        if keep and len(keep) < len(self.rows):
            self.rows.select(keep)
            self.kv.select(keep)
            if self.drafter is not None:
                self.drafter.select(keep)
            self.row_k = [self.row_k[r] for r in keep]
            self.chosen = [self.chosen[r] for r in keep]
        return bool(keep)

    def event(self, kind: str, done, draft_seconds=0.0, verify_seconds=0.0, k=0, width=1, ks=None, drafted=None,
              verified=None, proposals=None, trees=None, token_probs=None) -> BatchEvent:
        steps = []
        for r, (kept, delta) in enumerate(done):
            out = self.rows.out[r]
            step = StepEvent(kind, kept, delta, self.clock.total, out.num_generated, draft_seconds=draft_seconds,
                             verify_seconds=verify_seconds, finish_reason=out.finish_reason,
                             target_cache_length=self.kv.counts[r])
            if verified is not None:
                d, v, p, tree = drafted[r], verified[r], proposals[r], trees[r]
                full = v.num_accepted == len(d) if tree is None else not tree.children(v.path[-1] if v.path else -1)
                step.drafted, step.num_accepted, step.k = d, v.num_accepted, ks[r]
                step.correction = None if full else v.next_token
                step.bonus = v.next_token if full and d else None
                step.draft_token_probs = token_probs[r]
                step.draft_source, step.verification, step.inspection = p.source, self.sampling.rule, v.inspection
                if tree is not None:
                    step.parents, step.accepted_path = list(tree.parents), v.path
            steps.append(step)
        return BatchEvent(kind, list(self.rows.index), steps, self.clock.total, self.rows.generated, draft_seconds,
                          verify_seconds, k, width)


def _prefill(run: _Run, prompts: Sequence[list[int]]) -> BatchEvent:
    """Each row's first token (the same with or without a drafter); the drafter begins with the prompts' features."""
    run.clock.start()
    last, hidden = run.kv.prefill(prompts, run.layers)
    run.chosen = _choose(last, run.sampling, run.rows.gens)
    if run.drafter is not None:
        run.drafter.begin(prompts, hidden)
    done = run.rows.commit([[t] for t in run.chosen])
    return run.event("prefill", done, verify_seconds=run.clock.stop())


def _ar_step(run: _Run) -> BatchEvent:
    """One target pass per row: feed each row's pending token, choose the next."""
    x = to_device([[c] for c in run.chosen], run.device)  # a copy that waits for nothing
    logits = run.kv.forward(x, torch.ones_like(x, dtype=torch.bool), 1, fed=[1] * len(run.chosen))[0]
    run.chosen = _choose(logits[:, -1], run.sampling, run.rows.gens)
    done = run.rows.commit([[t] for t in run.chosen])
    return run.event("ar", done, verify_seconds=run.clock.stop())


def _verify_on_host(run: _Run, ids: list[list[int]], drafted: list[list[int]], trees: list[TokenTree | None],
                    qs: list[torch.Tensor | None]) -> tuple:
    """Drafts the host holds, verified in one target pass (B x (n+1) positions, padded for rows that drafted fewer):
    chains keep the pending token and the accepted drafts and roll back the rest; trees (chain rows as one-branch
    trees) feed each entry at its depth under the ancestry mask and keep the accepted path's entries. Returns (width,
    features, verified)."""
    tokens, real = right_padded([[row[-1]] + d for row, d in zip(ids, drafted)], run.device)
    width, fed = tokens.shape[1], [1 + len(d) for d in drafted]  # fed: nothing to read back from the device
    if all(t is None for t in trees):
        before = list(run.kv.counts)
        logits, features = run.kv.forward(tokens, real, width, run.layers, fed=fed)  # (B, W, V)
        verified = _verify(logits, tokens, drafted, qs, run.sampling, run.rows.gens, run.inspect)
        run.kv.keep([n + 1 + v.num_accepted for n, v in zip(before, verified)])
    else:
        as_trees = [t if t is not None else TokenTree.chain(d) for t, d in zip(trees, drafted)]
        batch = TreeBatch.stack(as_trees, width - 1, run.device)
        logits, features = run.kv.forward(tokens, real, width, run.layers, tree=batch, fed=fed)  # (B, W, V)
        verified = _verify_trees(logits, tokens, as_trees, batch, qs, run.sampling, run.rows.gens, run.inspect)
        run.kv.keep_entries([[0] + [j + 1 for j in v.path] for v in verified])
    return width, features, verified


def _spec_step(run: _Run, k_policy: KPolicy | None) -> BatchEvent:
    """Draft up to k per row (a tree of up to run.tree.nodes nodes where allowed), verify every row's drafts in one
    target pass (B x (n+1) positions, padded for rows that drafted fewer), keep each row's agreed prefix (a tree's
    accepted path) plus the target's own next token, roll back the rest."""
    config, rows, drafter = run.config, run.rows, run.drafter
    if k_policy is not None:
        run.row_k = [k_policy(len(rows))] * len(rows)
    ids = [out.ids for out in rows.out]  # ids[r][-1] is pending: not yet in the target's cache
    ks = [max(0, min(k, config.max_new_tokens - out.num_generated - 1)) for k, out in zip(run.row_k, rows.out)]
    nodes = [run.tree.nodes if k > 0 else 0 for k in ks]
    costs, scale = (run.costs.costs(), run.costs.extra_scale()) if run.costs is not None else (None, 1.0)
    request = DraftRequest(ids, ks, run.sampling, rows.gens, run.eos, nodes, costs, scale)
    on_device = None
    if run.one_read and max(ks) > 0:  # under --tree auto the pass is sized before the tree is read: run.width
        capped = [min(n, run.width) for n in nodes] if costs is not None else nodes
        on_device = drafter.propose_on_device(replace(request, tree_nodes=capped))
    if on_device is None:
        proposals = drafter.propose(request) if max(ks) > 0 else [Proposal([]) for _ in ks]
        trees, drafted, qs, token_probs, values = map(list, zip(*(_as_verified(p, k, n)
                                                                  for p, k, n in zip(proposals, ks, nodes))))
    run.clock.split()  # no wait for the device: a step synchronises at its read (and its clock's stop)
    if isinstance(on_device, DeviceTrees):  # greedy trees verified on the device and read back with the verdicts
        width, features, proposals, trees, verified = verify_trees_on_device(run, ids, on_device)
        if costs is not None:
            run.width = auto_width(run.width, max(len(p.tokens) for p in proposals), run.tree.nodes)
        drafted, token_probs, values = ([getattr(p, f) for p in proposals] for f in ("tokens", "token_probs", "values"))
    elif on_device is not None:  # chains verified on the device and read back with the verdicts, once
        width, features, proposals, verified = verify_chains_on_device(run, ids, on_device, ks)
        trees, values = [None] * len(ids), [None] * len(ids)
        drafted, token_probs = [p.tokens for p in proposals], [p.token_probs for p in proposals]
    else:  # drafts the host holds
        width, features, verified = _verify_on_host(run, ids, drafted, trees, qs)
    new = [[d[j] for j in v.path] + [v.next_token] for d, v in zip(drafted, verified)]
    drafter.update([Verdict(v.num_accepted, row + n, _path_features(features, r, v.path, tree),
                            None if tree is None else v.path)
                    for r, (v, row, n, tree) in enumerate(zip(verified, ids, new, trees))])
    done = rows.commit(new)
    run.kv.compact()
    step_seconds = run.clock.stop()
    draft_seconds = run.clock.first
    verify_seconds = step_seconds - draft_seconds
    if run.costs is not None and max(ks) > 0:
        run.costs.add(width, draft_seconds + verify_seconds)
        for tree, v, value in zip(trees, verified, values):
            if tree is not None and value is not None:
                run.costs.add_extras(*tree.off_chain(value, v.path))
    if config.dynamic_k and k_policy is None:  # transformers' heuristic per row: +2 after a full acceptance, else -1
        run.row_k = [(min(k + 2, MAX_K_ENGINE) if v.num_accepted == len(d) == k else max(1, k - 1)) if d else k
                     for k, v, d in zip(run.row_k, verified, drafted)]
    return run.event("spec", done, draft_seconds, verify_seconds, max(ks), width, ks, drafted, verified, proposals,
                     trees, token_probs)


@torch.inference_mode()
def decode(target, tokenizer, prompts: Sequence[list[int]], config: GenerationConfig, drafter: Drafter | None = None,
           *, k_policy: KPolicy | None = None, inspect: bool = False, text: bool = True) -> Iterator[BatchEvent]:
    """Decode every prompt: prefill, then a speculative step per target pass with a drafter, else an autoregressive
    one. k is config.num_draft_tokens, or k_policy(rows still decoding) at every step when given; with
    config.dynamic_k each row adapts its own k. config.tree lets a drafter that drafts trees propose one (at most k
    deep), verified in the same one pass under an ancestry mask (tree_plan says when). `inspect` fills each spec
    StepEvent's inspection from the verify logits; `text` gives each StepEvent its text delta (stop strings are
    honoured either way). Finished rows leave the batch after the step that ends them. The target's cache comes from
    its runner (engine.graphs): a static one, graph-captured on CUDA, or the eager engine's.
    """
    run = _Run(target, tokenizer, prompts, config, drafter, inspect, text)
    try:
        run.warm([1] if drafter is None else range(1, max(config.num_draft_tokens, run.tree.nodes) + 2), prompts)
        yield _prefill(run, prompts)
        while True:
            run.clock.start()
            if not run.retire():
                run.clock.stop()
                return
            yield _ar_step(run) if drafter is None else _spec_step(run, k_policy)
    finally:
        graphs.release(run.kv)


def speculative(target, tokenizer, drafter: Drafter, prompt_ids: list[int], config: GenerationConfig,
                inspect: bool = True) -> Iterator[StepEvent]:
    """One prompt's speculative decoding (decode at B = 1), as StepEvents, inspected unless asked not to."""
    for e in decode(target, tokenizer, [prompt_ids], config, drafter, inspect=inspect):
        yield e.steps[0]


def autoregressive(target, tokenizer, prompt_ids: list[int], config: GenerationConfig) -> Iterator[StepEvent]:
    """One prompt's plain decoding: one target pass per token (decode at B = 1 with no drafter)."""
    for e in decode(target, tokenizer, [prompt_ids], config):
        yield e.steps[0]
