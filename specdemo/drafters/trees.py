"""Draft trees from the model-free drafters, as pure functions of the context: prompt lookup's earlier matches as
branches, suffix decoding's subtrees of its matches; and the node budget a tree gets from the target's pass costs.

Knows token ids, the drafters' parameters and their trees; not the engine's loop. Every tree here is deterministic
(one-hot q: engine/tree.py's tree_accept with draft_probs None), siblings distinct.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

from ..config import SuffixConfig
from ..engine.tree import TokenTree
from .base import cut_at_eos
from .ngram import NgramDrafter
from .suffix import SuffixTree, _f32


def lookup_matches(drafter: NgramDrafter, ids: Sequence[int]) -> list[tuple[int, int]]:
    """Every earlier match of ids' suffix as (length, end), ids[end-length+1 : end+1] == ids[-length:], best first:
    longer first, then the drafter's tie-break (earliest, or most recent with latest=True). The first is
    NgramDrafter.match's."""
    n = len(ids)
    if n == 0:
        return []
    last, found = ids[-1], []
    for end in range(n - 1):  # end < n - 1: something follows the match
        if ids[end] != last:
            continue
        length = 1
        while length < drafter.max_ngram and end - length >= 0 and ids[end - length] == ids[n - 1 - length]:
            length += 1
        found.append((length, end))
    return sorted(found, key=lambda m: (-m[0], -m[1] if drafter.latest else m[1]))


def lookup_tree(drafter: NgramDrafter, ids: Sequence[int], k: int, branches: int,
                eos: frozenset[int] = frozenset()) -> tuple[TokenTree, list[int]]:
    """Prompt lookup as a tree: what followed each of the best `branches` matches (each as NgramDrafter.lookup copies
    it: up to k tokens, up to the match's length for a short one, cut after an EOS), merged by common prefix.
    Returns (tree, support): how many of the branches pass through each node. With branches = 1 it is the chain."""
    if k <= 0 or branches <= 0:
        return TokenTree((), ()), []
    paths = []
    for length, end in lookup_matches(drafter, ids):
        if length < drafter.min_ngram or len(paths) == branches:
            break
        count = k if length >= drafter.full_ngram else min(k, length)
        paths.append(cut_at_eos(list(ids[end + 1 : end + 1 + count]), eos))
    tree = TokenTree.from_paths(paths)
    support = [0] * len(tree)
    for path in paths:
        node = -1
        for t in path:
            node = next(c for c in tree.children(node) if tree.tokens[c] == t)
            support[node] += 1
    return tree, support


def match_subtrees(tree: SuffixTree, context: Sequence[int], max_tokens: int, config: SuffixConfig,
                   min_match: int = 1, max_depth: int | None = None) -> list[tuple[TokenTree, list[float]]]:
    """The subtree below each match length m of context's suffix, longest match first, each grown as arctic_inference's
    _speculate_tree grows its match's (best-first by estimated probability, the product of count ratios down from
    the match; children below min_token_prob or deeper than max_depth left out) to max_tokens nodes: (tree, each
    node's probability). Arctic keeps one match's subtree of at most max_spec_factor * m nodes; suffix_forest merges
    them all. A match that occurs exactly as often as the next longer one occurs at the same places, so grows the
    same subtree (when max_depth leaves both room), and is left out."""
    found = list(tree.matches(context, max_tokens, config, min_match))
    min_prob = _f32(config.min_token_prob)
    parts, longer = [], None  # longer: (count, m) of the last match grown
    for m, node, _ in reversed(found):
        if longer and node.count == longer[0] and max_depth is not None and longer[1] + max_depth <= tree.max_depth:
            continue
        tokens, parents, probs, _ = _grow(node, max_tokens, min_prob, max_depth)
        longer = (node.count, m)
        if tokens:
            parts.append((TokenTree(tokens, parents), probs))
    return parts


def suffix_forest(parts: Sequence[tuple[TokenTree, Sequence[float]]]) -> tuple[TokenTree, list[float]]:
    """Suffix decoding's tree draft: the subtrees of every match (match_subtrees of a row's own tree, then of the
    earlier answers'), merged by common prefix in that order, each node valued at the highest probability a match
    gives it. Where arctic's one best subtree branches little, the shorter matches add the continuations the longer
    ones never saw (on the repetitive workload: docs/notes/trees-cpu-2026-12-04.md); its size is the node budget's
    and the cost cut's (branch_out), not max_spec_factor's."""
    merged, values = TokenTree((), ()), []
    for tree, probs in parts:
        merged, values = merge(merged, values, tree, probs)
    return merged, values


def _grow(match, limit: int, min_prob: float, max_depth: int | None = None
          ) -> tuple[list[int], list[int], list[float], float]:
    """Best-first growth from a suffix-tree node: (tokens, parents, probabilities, their float32 sum)."""
    tokens, parents, probs, depths, score = [], [], [], [], 0.0
    heap: list = []  # (-probability, arrival, suffix-tree node, parent in the draft, probability)
    arrival = itertools.count()  # equal probabilities: the first pushed first

    def push(at, parent: int, prob: float) -> None:
        if max_depth is not None and (depths[parent] if parent >= 0 else 0) >= max_depth:
            return
        for child in at.order or ():  # most frequent first: the rest are no more likely
            p = _f32(prob * _f32(child.count / at.count))
            if p < min_prob:
                break
            heapq.heappush(heap, (-p, next(arrival), child, parent, p))

    push(match, -1, 1.0)
    while heap and len(tokens) < limit:
        _, _, child, parent, p = heapq.heappop(heap)
        tokens.append(child.token)
        parents.append(parent)
        probs.append(p)
        depths.append(depths[parent] + 1 if parent >= 0 else 1)
        score = _f32(score + p)
        push(child, len(tokens) - 1, p)
    return tokens, parents, probs, score


def tree_budget(values: Sequence[float], pass_costs: dict[int, float], start: float = 1.0) -> int:
    """How many nodes a tree should keep: values are its nodes' estimated probabilities of being accepted, in the
    order they would be kept; keeping N costs an (N+1)-token pass, pass_costs[N] (a 1-token pass costs 1) and is
    expected to yield 1 + the sum of the first N values tokens. The N that maximises tokens per unit of pass cost
    (0: none), never past the widest pass measured. DraftValue.length's rule for chains, for trees. `start`: the
    tokens expected without these nodes, where they would widen a pass that already verifies others (whose costs
    pass_costs are then relative to)."""
    best, keep, expected = start, 0, start
    for n, v in enumerate(values[: max(pass_costs, default=0)], start=1):
        expected += v
        value = expected / pass_costs[n]
        if value > best:
            best, keep = value, n
    return keep


def best_subtree(tree: TokenTree, values: Sequence[float], pass_costs: dict[int, float] | None,
                 limit: int | None = None, start: float = 1.0, scale: float = 1.0) -> tuple[TokenTree, list[int]]:
    """The part of `tree` worth verifying on this machine: nodes taken best value first among those whose parent is
    already taken (so the kept part is a tree: EAGLE-2's rerank), at most `limit`, cut at tree_budget (None: no cost
    cut; `start` as there; the cut weighs the values by `scale`). Returns (tree, kept nodes)."""
    order, frontier = [], [(-values[c], c) for c in tree.children(-1)]
    heapq.heapify(frontier)
    while frontier and (limit is None or len(order) < limit):
        _, c = heapq.heappop(frontier)
        order.append(c)
        for g in tree.children(c):
            heapq.heappush(frontier, (-values[g], g))
    if pass_costs is not None:
        order = order[: tree_budget([scale * values[c] for c in order], pass_costs, start)]
    kept = sorted(order)
    return tree.select(kept), kept


def branch_out(tree: TokenTree, values: Sequence[float], pass_costs: dict[int, float] | None, limit: int,
               chain: int | None = None, scale: float = 1.0) -> tuple[TokenTree, list[int]]:
    """The draft a tree drafter proposes: the drafter's chain draft, the tree's first `chain` nodes (a chain; None:
    first children from the root), then its other nodes best value first among those whose parent is in, at most
    `limit` nodes in all; with pass_costs (--tree auto) only those that pay for widening the chain's pass
    (tree_budget from the chain's expected tokens, their values weighed by `scale`: what such nodes have given over
    their values), so where none pays the draft is the chain. Returns (tree, kept nodes)."""
    if chain is not None:
        chain = list(range(min(chain, limit)))
    else:
        chain, node = [], -1
        while tree.children(node) and len(chain) < limit:
            node = tree.children(node)[0]
            chain.append(node)
    on = set(chain)
    frontier = [(-values[c], c) for a in (-1, *chain) for c in tree.children(a) if c not in on]
    heapq.heapify(frontier)
    extra: list[int] = []
    while frontier and len(chain) + len(extra) < limit:
        _, c = heapq.heappop(frontier)
        extra.append(c)
        for g in tree.children(c):
            heapq.heappush(frontier, (-values[g], g))
    if pass_costs is not None:
        start = 1.0 + sum(values[c] for c in chain)
        extra = extra[: tree_budget([scale * values[c] for c in extra], shifted_costs(pass_costs, len(chain)),
                                    start)]
    kept = sorted(chain + extra)
    return tree.select(kept), kept


def merge(tree: TokenTree, values: Sequence[float], other: TokenTree,
          other_values: Sequence[float]) -> tuple[TokenTree, list[float]]:
    """other merged into tree by common prefix: tree's nodes first, in their order; a node of other on a path tree
    holds is that node (valued the higher of the two), the rest hang where their parents went. Returns (tree, each
    node's value)."""
    tokens, parents, merged = list(tree.tokens), list(tree.parents), list(values)
    index = {(a, t): j for j, (a, t) in enumerate(zip(parents, tokens))}  # (parent, token) -> node
    at: list[int] = []  # other's node j -> its merged node
    for j, (a, t) in enumerate(zip(other.parents, other.tokens)):
        key = (at[a] if a >= 0 else -1, t)
        if key in index:
            merged[index[key]] = max(merged[index[key]], other_values[j])
        else:
            index[key] = len(tokens)
            tokens.append(t)
            parents.append(key[0])
            merged.append(other_values[j])
        at.append(index[key])
    return TokenTree(tuple(tokens), tuple(parents)), merged


def graft(chain: Sequence[int], chain_values: Sequence[float], tree: TokenTree,
          values: Sequence[float]) -> tuple[TokenTree, list[float]]:
    """A chain as the first branch of a tree, the tree merged into it (merge)."""
    return merge(TokenTree.chain(chain), chain_values, tree, values)


def lookup_values(tree: TokenTree, support: Sequence[int]) -> list[float]:
    """Each node of a lookup tree's estimated chance of acceptance: the share of the matches that continue through
    it (every match passes through one child of the root)."""
    total = sum(support[c] for c in tree.children(-1)) or 1
    return [s / total for s in support]


def cut_after(tree: TokenTree, stop: frozenset[int]) -> tuple[TokenTree, list[int]]:
    """The tree without the nodes below a node whose token is in `stop` (nothing follows an end of sequence), and
    the nodes it keeps."""
    keep: list[int] = []
    ended = [False] * len(tree)
    for j, (t, a) in enumerate(zip(tree.tokens, tree.parents)):
        if a >= 0 and (ended[a] or tree.tokens[a] in stop):
            ended[j] = True
        else:
            keep.append(j)
    return tree.select(keep), keep


def shifted_costs(pass_costs: dict[int, float], width: int) -> dict[int, float]:
    """{n: cost of a pass n nodes wider than one of `width` nodes, over that pass's} (its nodes kept anyway)."""
    base = pass_costs.get(width, 1.0) if width else 1.0
    return {n - width: c / base for n, c in pass_costs.items() if n > width}
