"""An EAGLE-3 head's dynamic draft tree (EAGLE-2, Li et al. 2024): from each expanded node the head's top candidates
become children valued by their joint draft probability; each depth expands the chain's node and the most probable
others in one head pass under a tree mask; the kept tree is the chain plus the best other nodes (drafters.trees.
branch_out: those that fit the budget, or under --tree auto that pay for the wider target pass).

Greedy only: the tree is a deterministic function of the context (top candidates, not samples), the chain is the one
the head drafts as a chain (its min_confidence stop included). Knows the head drafter's state, not the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..engine.tree import TokenTree
from .base import DraftRequest, Proposal
from .trees import branch_out

if TYPE_CHECKING:
    from .eagle3 import Eagle3Drafter

TOP = 3  # candidates per expanded node (EAGLE-2's top-k)
FRONTIER = 3  # nodes expanded per depth and row: the chain's and the most probable others


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

    def to_expand(self, depth: int, eos: frozenset[int]) -> list[int]:
        """This depth's nodes to feed: the chain's, then the most probable others, FRONTIER in all (nothing follows an
        end of sequence)."""
        at = [n for n, d in enumerate(self.depth) if d == depth and self.tokens[n] not in eos]
        first = [n for n in at if n in self.chain]
        rest = sorted((n for n in at if n not in first), key=lambda n: -self.values[n])
        return (first + rest)[:FRONTIER]


def _top(drafter: Eagle3Drafter, out: torch.Tensor) -> tuple[list[list[float]], list[list[int]], list[float]]:
    """The head's TOP candidates after outputs out (N, H): their probabilities, target ids, and each output's peak."""
    q = torch.softmax(drafter.head.logits(out).float(), -1)  # (N, S)
    top = q.topk(min(TOP, q.shape[-1]), dim=-1)
    ids = drafter.head.subset[top.indices]  # draft vocabulary -> target ids
    return top.values.tolist(), ids.tolist(), top.values[:, 0].tolist()


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
    base, true_valid = list(drafter.slots.counts), drafter.slots.valid.clone()  # the true entries: the past
    for depth in range(1, max(ks, default=0)):
        feed = [t.to_expand(depth, request.eos_token_ids) if depth < ks[r] else [] for r, t in enumerate(trees)]
        width = max(map(len, feed), default=0)
        if width == 0:
            break
        out = _expand(drafter, trees, feed, width, depth, base, true_valid)  # (B, W, H)
        fed = [(r, j, n) for r, nodes in enumerate(feed) for j, n in enumerate(nodes)]
        probs, ids, peak = _top(drafter, torch.stack([out[r, j] for r, j, _ in fed]))
        for (r, j, n), p, i, top1 in zip(fed, probs, ids, peak):
            trees[r].add(out[r, j], n, p, i, top1 >= drafter.min_confidence)
    return [_proposal(t, request.nodes(r), request.tree_by_cost, drafter.pass_costs) for r, t in enumerate(trees)]


def _expand(drafter: Eagle3Drafter, trees: list[_Row], feed: list[list[int]], width: int, depth: int,
            base: list[int], true_valid: torch.Tensor) -> torch.Tensor:
    """One head pass over each row's nodes to expand (B, W): each at its row's next position plus depth - 1, reading
    the output it was chosen from, attending to the row's true entries, its ancestors' entries and itself."""
    rows, device = len(trees), drafter.device
    length = drafter.slots.length
    hidden = torch.zeros(rows, width, feature_width(trees), dtype=drafter.dtype, device=device)
    tokens = torch.zeros(rows, width, dtype=torch.long, device=device)
    real = torch.zeros(rows, width, dtype=torch.bool, device=device)
    positions = torch.zeros(rows, width, dtype=torch.long, device=device)
    mask = torch.zeros(rows, width, length + width, dtype=torch.bool, device=device)
    mask[:, :, : true_valid.shape[1]] = true_valid[:, None, :]
    mask[:, torch.arange(width), length + torch.arange(width)] = True  # each entry sees itself (padding too)
    for r, (tree, nodes) in enumerate(zip(trees, feed)):
        for j, n in enumerate(nodes):
            hidden[r, j] = tree.source[n].to(drafter.dtype)
            tokens[r, j], real[r, j], positions[r, j] = tree.tokens[n], True, base[r] + depth - 1
            mask[r, j, [tree.column[a] for a in tree.ancestors(tree.parents[n])]] = True
            tree.column[n] = length + j
    return drafter._pass(hidden, tokens, real, positions, mask[:, None])


def feature_width(trees: list[_Row]) -> int:
    return next(t.source[0].shape[-1] for t in trees if t.source)


def _proposal(tree: _Row, nodes: int, by_cost: bool, pass_costs: dict[int, float] | None) -> Proposal:
    """The row's kept tree, the chain's nodes first (a parent still before its children), as a Proposal."""
    if not tree.tokens:
        return Proposal([])
    order = tree.chain + [n for n in range(len(tree.tokens)) if n not in set(tree.chain)]
    at = {n: i for i, n in enumerate(order)}
    full = TokenTree(tuple(tree.tokens[n] for n in order),
                     tuple(at[tree.parents[n]] if tree.parents[n] >= 0 else -1 for n in order))
    kept_tree, kept = branch_out(full, [tree.values[n] for n in order], pass_costs if by_cost else None, nodes,
                                 len(tree.chain))
    return Proposal(list(kept_tree.tokens), token_probs=[tree.q[order[j]] for j in kept],
                    parents=list(kept_tree.parents))
