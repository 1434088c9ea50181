"""An EAGLE-3 head's dynamic draft tree (EAGLE-2, Li et al. 2024): from each expanded node the head's candidates become
children valued by their joint draft probability; each depth expands the chain's node and the most probable others in
one head pass under a tree mask.

Greedy (draft_trees): the candidates are the head's top ones, a deterministic function of the context; the kept tree
is the chain the head drafts as a chain (its min_confidence stop included) plus the best other nodes
(drafters.trees.branch_out: those that fit the budget, or under --tree auto that pay for the wider target pass).
Sampling (draft_sampled_trees): the children are drawn from the head's q without replacement and every drawn node is
kept; how many children each node gets is fixed before they are drawn, so recursive rejection sampling stays exact
(engine.tree.tree_accept). Knows the head drafter's state, not the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..engine.tree import TokenTree
from ..engine.verify import generator_on, logits_to_probs
from ..models.placement import on_host, to_device
from .base import DraftRequest, Proposal
from .trees import branch_out, shifted_costs, tree_budget

if TYPE_CHECKING:
    from .eagle3 import Eagle3Drafter

TOP = 5  # candidates per expanded node (EAGLE-2's top-k; 3 drafted 2.53 tokens per pass at 32 nodes, 5 2.72, 8 2.73)
FRONTIER = 5  # nodes expanded per depth and row: the chain's and the most probable others (as TOP)


@dataclass
class _Row:
    """One row's tree as it grows: per node its token, parent, joint draft probability, q of its token after its
    parent, the head's output it was chosen from, and its depth; which nodes form the chain; where each fed node's
    entry sits in the head's cache."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    q: list[float] = field(default_factory=list)
    source: list[torch.Tensor] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)
    chain: list[int] = field(default_factory=list)
    column: dict[int, int] = field(default_factory=dict)

    def add(self, out: torch.Tensor, parent: int, probs: list[float], ids: list[int], peak_ok: bool) -> None:
        """The top candidates chosen from head output `out` as children of `parent` (most probable first); the first
        continues the chain if the parent ends it and the head is confident enough."""
        on_chain = (self.chain[-1] if self.chain else -1) == parent and peak_ok
        base = self.values[parent] if parent >= 0 else 1.0
        for i, (p, t) in enumerate(zip(probs, ids)):
            if i == 0 and on_chain:
                self.chain.append(len(self.tokens))
            self.tokens.append(t)
            self.parents.append(parent)
            self.values.append(base * p)
            self.q.append(p)
            self.source.append(out)
            self.depth.append(self.depth[parent] + 1 if parent >= 0 else 1)

    def ancestors(self, node: int) -> list[int]:
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out

    def to_expand(self, depth: int, eos: frozenset[int], worth: set[int] | None = None) -> list[int]:
        """This depth's nodes to feed: the chain's, then the most probable others (only those in `worth` when given),
        FRONTIER in all (nothing follows an end of sequence)."""
        at = [n for n, d in enumerate(self.depth) if d == depth and self.tokens[n] not in eos]
        first = [n for n in at if n in self.chain]
        rest = sorted((n for n in at if n not in first and (worth is None or n in worth)),
                      key=lambda n: -self.values[n])
        return (first + rest)[:FRONTIER]


def _top(drafter: Eagle3Drafter, out: torch.Tensor) -> tuple[list[list[float]], list[list[int]], list[float]]:
    """The head's TOP candidates after outputs out (N, H): their probabilities, target ids, and each output's peak."""
    q = torch.softmax(drafter.head.logits(out).float(), -1)  # (N, S)
    top = q.topk(min(TOP, q.shape[-1]), dim=-1)
    ids = drafter.head.subset[top.indices]  # draft vocabulary -> target ids
    read = torch.cat([top.values.double(), ids.double()], 1).tolist()  # one read (ids < 2**53 stay exact)
    n = top.values.shape[1]
    return [r[:n] for r in read], [[int(t) for t in r[n:]] for r in read], [r[0] for r in read]


def draft_trees(drafter: Eagle3Drafter, request: DraftRequest, feature: torch.Tensor) -> list[Proposal]:
    """Each row's dynamic tree after the catch-up pass (feature (B, H): what the first draft step reads), at most
    request.ks[r] deep and request.nodes(r) nodes; the head's cache gets an entry per expanded node (cut at the next
    verdict, as a chain's drafted entries are)."""
    rows, ks = len(request.ids), request.ks
    trees = [_Row() for _ in range(rows)]
    probs, ids, peak = _top(drafter, feature)
    for r in range(rows):
        if ks[r] > 0 and request.nodes(r) > 0:
            trees[r].add(feature[r], -1, probs[r], ids[r], True)
    base, true_valid = list(drafter.kv.counts), drafter.kv.visible()  # the true entries: the past
    for depth in range(1, max(ks, default=0)):
        # under --tree auto only nodes that would be verified now are expanded (their children are worth less)
        worth = None if request.tree_costs is None else [
            _kept(t, request.nodes(r), request.tree_costs, request.tree_extra_scale)[1] for r, t in enumerate(trees)]
        if (level := _level(drafter, trees, request, depth, base, true_valid, worth)) is None:
            break
        fed, outs = level
        probs, ids, peak = _top(drafter, outs)
        for (r, n), out, p, i, top1 in zip(fed, outs, probs, ids, peak):
            trees[r].add(out, n, p, i, top1 >= drafter.min_confidence)
    return [_proposal(t, request.nodes(r), request.tree_costs, request.tree_extra_scale) for r, t in enumerate(trees)]


def _level(drafter: Eagle3Drafter, trees: list[_Row], request: DraftRequest, depth: int, base: list[int],
           true_valid: torch.Tensor, worth: list[set[int]] | None = None
           ) -> tuple[list[tuple[int, int]], torch.Tensor] | None:
    """One depth's head pass: each row's nodes to expand (_Row.to_expand; none at or past the row's k), fed in one
    pass (_expand); `worth`: each row's nodes worth expanding beyond its chain (None: any). Returns ((row, node) of
    each fed node, the output each one's children are chosen from (N, H)), or None when no row has a node left to
    expand."""
    feed = [t.to_expand(depth, request.eos_token_ids, None if worth is None else worth[r]) if depth < request.ks[r]
            else [] for r, t in enumerate(trees)]
    width = max(map(len, feed), default=0)
    if width == 0:
        return None
    out = _expand(drafter, trees, feed, width, depth, base, true_valid)  # (B, W, H)
    fed = [(r, j, n) for r, nodes in enumerate(feed) for j, n in enumerate(nodes)]
    if len(fed) == out.shape[0] * out.shape[1]:  # no padding: every output, in order
        return [(r, n) for r, _, n in fed], out.reshape(len(fed), out.shape[-1])
    at = to_device([(r, j) for r, j, _ in fed], out.device).T
    return [(r, n) for r, _, n in fed], out[at[0], at[1]]


def _expand(drafter: Eagle3Drafter, trees: list[_Row], feed: list[list[int]], width: int, depth: int,
            base: list[int], true_valid: torch.Tensor) -> torch.Tensor:
    """One head pass over each row's nodes to expand (B, W): each at its row's next position plus depth - 1, reading
    the output it was chosen from, attending to the row's true entries, its ancestors' entries and itself. Where each
    entry lands (its column in the mask) is the cache's to say (kv.tree_columns)."""
    rows, device = len(trees), drafter.device
    columns, start = drafter.kv.tree_columns(width)
    tokens, positions = [[0] * width for _ in range(rows)], [[0] * width for _ in range(rows)]  # padding: 0s
    real = [[False] * width for _ in range(rows)]
    seen = [(r, j, start[r] + j) for r in range(rows) for j in range(width)]  # each entry sees itself (padding too)
    where, sources = [], []
    for r, (tree, nodes) in enumerate(zip(trees, feed)):
        for j, n in enumerate(nodes):
            where.append((r, j))
            sources.append(tree.source[n])
            tokens[r][j], positions[r][j], real[r][j] = tree.tokens[n], base[r] + depth - 1, True
            seen += [(r, j, tree.column[a]) for a in tree.ancestors(tree.parents[n])]
            tree.column[n] = start[r] + j
    inputs = to_device([tokens, positions], device, torch.long)  # the host's lists, moved at once
    fed = torch.stack(sources).to(drafter.dtype)  # one gather, not a copy per node
    if len(where) == rows * width:  # no padding (one row): the fed outputs in order are the pass's
        hidden = fed.view(rows, width, -1)
    else:
        hidden = torch.zeros(rows, width, fed.shape[-1], dtype=drafter.dtype, device=device)
        at = to_device(where, device).T
        hidden[at[0], at[1]] = fed
    mask = torch.zeros(rows, width, columns, dtype=torch.bool, device=device)
    mask[:, :, : true_valid.shape[1]] = true_valid[:, None, :]
    mask[tuple(to_device(seen, device).T)] = True
    return drafter._pass(hidden, inputs[0], on_host(real, torch.bool), inputs[1], mask[:, None])


def _kept(tree: _Row, nodes: int, pass_costs: dict[int, float] | None, scale: float = 1.0
          ) -> tuple[TokenTree, set[int], list[int]]:
    """What of the row's tree would be verified now (drafters.trees.branch_out): (that tree, the chain's nodes first,
    a parent still before its children; the row's nodes in it; each of its nodes' node in the row's tree)."""
    order = tree.chain + [n for n in range(len(tree.tokens)) if n not in set(tree.chain)]
    at = {n: i for i, n in enumerate(order)}
    full = TokenTree(tuple(tree.tokens[n] for n in order),
                     tuple(at[tree.parents[n]] if tree.parents[n] >= 0 else -1 for n in order))
    kept_tree, kept = branch_out(full, [tree.values[n] for n in order], pass_costs, nodes, len(tree.chain), scale)
    return kept_tree, {order[j] for j in kept}, [order[j] for j in kept]


def _proposal(tree: _Row, nodes: int, pass_costs: dict[int, float] | None, scale: float = 1.0) -> Proposal:
    """The row's kept tree (_kept) as a Proposal."""
    if not tree.tokens:
        return Proposal([])
    kept_tree, _, kept = _kept(tree, nodes, pass_costs, scale)
    return Proposal(list(kept_tree.tokens), token_probs=[tree.q[n] for n in kept], parents=list(kept_tree.parents),
                    values=[tree.values[n] for n in kept])


# ---- sampling: children drawn from q without replacement, none pruned after drawing --------------------------------

Open = tuple[int, torch.Tensor, torch.Tensor]  # an expanded node (-1: the root), q after it (S,), the head's output


def draw_without_replacement(q: torch.Tensor, count: int, generator: torch.Generator | None) -> torch.Tensor:
    """count indices drawn from q (S,) without replacement, in draw order, left on q's device: each from q less the
    earlier ones, renormalised. The exponential race (Gumbel-top-k): q_i / E_i largest first, E_i ~ Exp(1), whose
    order is that of sequential draws; count must not exceed q's support."""
    race = torch.empty_like(q).exponential_(generator=generator)
    keys = torch.where(q > 0, q / race, torch.full_like(q, -1.0))
    return keys.topk(count).indices


def _tops(opened: list[list[Open]]) -> list[list[list[float]]]:
    """Each opened node's q's largest values, at most TOP and no more than its support (what _allot weighs), every
    row's in one read."""
    qs = [q for row in opened for _, q, _ in row]
    if not qs:
        return [[] for _ in opened]
    q = torch.stack(qs)  # (N, S)
    top = q.topk(min(TOP, q.shape[-1]), dim=-1).values.double()
    read = torch.cat([top, (q > 0).sum(-1, keepdim=True).double()], 1).tolist()  # the depth's first read
    tops = iter([r[: min(len(r) - 1, int(r[-1]))] for r in read])
    return [[next(tops) for _ in row] for row in opened]


def _draws(opened: list[list[Open]], counts: list[list[int]], gens, subset: torch.Tensor
           ) -> list[list[tuple[list[int], list[float], list[int]]]]:
    """Each opened node's children drawn from its q without replacement (draw_without_replacement; row r's nodes in
    order from gens[r], as drawn one node at a time), every row's read back at once: per node (draft ids, their q
    there, their target ids)."""
    most = max((c for row in counts for c in row), default=0)
    picks, wanted = [], []
    for r, row in enumerate(opened):
        for (_, q, _), count in zip(row, counts[r]):
            if count:
                picks.append(torch.nn.functional.pad(draw_without_replacement(q, count, gens[r]), (0, most - count)))
                wanted.append(q)
    read = iter([])
    if most:
        at = torch.stack(picks)  # (M, most)
        q = torch.stack(wanted).gather(1, at)
        read = iter(torch.cat([at.double(), q.double(), subset[at].double()], 1).tolist())  # the second read
    out = []
    for row_counts in counts:
        out.append([])
        for count in row_counts:
            got = next(read) if count else []
            out[-1].append(([int(x) for x in got[:count]], got[most : most + count],
                            [int(x) for x in got[2 * most : 2 * most + count]]))
    return out


def draft_sampled_trees(drafter: Eagle3Drafter, request: DraftRequest, feature: torch.Tensor) -> list[Proposal]:
    """Each row's tree under sampling after the catch-up pass (feature (B, H)), at most request.ks[r] deep and
    request.nodes(r) nodes, exact for tree_accept: depth by depth, each expanded node's child count is fixed from
    what was drawn before (_allot), its children are drawn from the head's q there (logits_to_probs, as chains are)
    without replacement with the row's generator and all kept, in draw order; the most probable drawn nodes are
    expanded next. Each node's q row is the law it was drawn from, zero outside the draft vocabulary. Every row's
    depth reads the device twice (what the allotment weighs, what was drawn), the trees' q once at the end."""
    rows, ks, sampling = len(request.ids), request.ks, request.sampling
    gens = [generator_on(g, drafter.device) for g in request.generators]
    trees = [_Row() for _ in range(rows)]
    laws: list[list[torch.Tensor]] = [[] for _ in range(rows)]  # per node: the law it was drawn from, (S,)
    drawn: list[list[int]] = [[] for _ in range(rows)]  # per node: its draft id
    q = logits_to_probs(drafter.head.logits(feature), sampling)  # (B, S)
    opened: list[list[Open]] = [[(-1, q[r], feature[r])] if ks[r] > 0 and request.nodes(r) > 0 else []
                                for r in range(rows)]
    base, true_valid = list(drafter.kv.counts), drafter.kv.visible()  # the true entries: the past
    costs = request.tree_costs
    for depth in range(1, max(ks, default=0) + 1):
        counts = [_allot(tree, opened[r], tops, depth, ks[r], request.nodes(r), drafter.min_confidence, costs,
                         request.tree_extra_scale) for r, (tree, tops) in enumerate(zip(trees, _tops(opened)))]
        for r, (tree, picked) in enumerate(zip(trees, _draws(opened, counts, gens, drafter.head.subset))):
            for (node, q_n, out), (picks, q_picks, ids) in zip(opened[r], picked):
                for i, pick in enumerate(picks):
                    law = q_n.clone()
                    law[picks[:i]] = 0.0  # the earlier siblings are out
                    laws[r].append(law / law.sum() if i else law)
                    drawn[r].append(pick)
                tree.add(out, node, q_picks, ids, True)
        if (level := _level(drafter, trees, request, depth, base, true_valid)) is None:
            break
        fed, outs = level
        q = logits_to_probs(drafter.head.logits(outs), sampling)  # (N, S)
        opened = [[] for _ in range(rows)]
        for (r, n), q_n, out in zip(fed, q, outs):
            opened[r].append((n, q_n, out))
    return _sampled_proposals(trees, laws, drawn, drafter.head)


def _allot(tree: _Row, opened: list[Open], tops: list[list[float]], depth: int, k: int, budget: int,
           min_confidence: float, pass_costs: dict[int, float] | None, scale: float = 1.0) -> list[int]:
    """How many children each expanded node gets at this depth, from what was drawn before only (never from the
    children themselves, so no drawn node is ever dropped): none under a node whose peak q is below min_confidence
    (the root aside: as a chain stops); one under the chain's node first, one node kept back for each depth below it
    (the chain's); then slot i of a node, valued its joint q times q's i-th largest value there, best first while
    the budget lasts, and under --tree auto (pass_costs) only those that pay for the wider pass (tree_budget, their
    values weighed by `scale`)."""
    counts, used = [0] * len(opened), len(tree.tokens)
    slots: list[tuple[float, int]] = []  # (value, which expanded node), each node's in order
    chain_node, chain_at, chain_value = (tree.chain[-1] if tree.chain else -1), None, 0.0
    for j, ((node, _, _), top) in enumerate(zip(opened, tops)):
        if not top or (node >= 0 and top[0] < min_confidence):
            continue
        value = tree.values[node] if node >= 0 else 1.0
        if node == chain_node and len(tree.chain) == depth - 1 and used < budget:
            counts[j], chain_at, chain_value = 1, j, value * top[0]
            top = top[1:]
        slots += [(value * v, j) for v in top]
    reserve = k - depth if chain_at is not None else 0
    used += chain_at is not None
    slots.sort(key=lambda s: -s[0])  # stable: a node's slots stay in order, so each node gets its first ones
    slots = slots[: max(0, budget - used - reserve)]
    if pass_costs is not None:
        start = 1.0 + sum(tree.values) + chain_value  # the tokens expected of the nodes in already
        slots = slots[: tree_budget([scale * v for v, _ in slots], shifted_costs(pass_costs, used + reserve),
                                    start)]
    for _, j in slots:
        counts[j] += 1
    return counts


def _sampled_proposals(trees: list[_Row], laws: list[list[torch.Tensor]], drawn: list[list[int]], head
                       ) -> list[Proposal]:
    """Each row's tree in draw order, each node's q row over the target vocabulary (zero outside the subset), the
    q of every row's drawn tokens read back at once."""
    flat = [law for row in laws for law in row]
    token_probs = iter([])
    if flat:
        picks = to_device([d for row in drawn for d in row], flat[0].device)
        token_probs = iter(torch.stack(flat).gather(1, picks[:, None])[:, 0].tolist())
    out = []
    for tree, row_laws in zip(trees, laws):
        q = [next(token_probs) for _ in row_laws]
        out.append(Proposal(list(tree.tokens), head.spread(torch.stack(row_laws)), q, parents=list(tree.parents),
                            values=list(tree.values)) if tree.tokens else Proposal([]))
    return out
