"""Prompt lookup: copy what followed the context's last n-gram where it appeared before (or, as a draft tree, what
followed each of its best matches). No model, no state."""

from __future__ import annotations

from .base import Drafter, DraftRequest, Proposal, cut_at_eos


class NgramDrafter(Drafter):
    """Prompt lookup: find the longest earlier match of the context's suffix and copy what followed it, row by row.

    A longer match is stronger evidence: one of length L < `full_ngram` proposes at most L tokens, a longer one k,
    because on a CPU a wide verify pass that fails costs more than a 1-token pass. Ties go to the earliest match,
    which for extractive prompts is usually the source text itself (`latest=True` prefers the most recent one, as
    transformers' prompt lookup does). (Tuned by replaying recorded outputs; docs/notes/, "The one-off simulators".)
    """

    name = "ngram"
    drafts_trees = True

    def __init__(self, max_ngram: int = 8, min_ngram: int = 1, full_ngram: int = 3, latest: bool = False,
                 branches: int = 4, pass_costs: dict[int, float] | None = None):
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.full_ngram = full_ngram
        self.latest = latest
        self.branches = branches  # a tree's most matches (drafters.trees.lookup_tree)
        self.pass_costs = pass_costs

    def begin(self, prompts, target_hidden=None) -> None:
        pass

    def match(self, ids: list[int]) -> tuple[int, int]:
        """(length, end) of the longest earlier match of ids' suffix: ids[end-length+1 : end+1] == ids[-length:]."""
        n, last = len(ids), ids[-1] if ids else None
        best_len, best_end = 0, -1
        ends = range(n - 2, -1, -1) if self.latest else range(n - 1)  # end < n - 1: something follows the match
        for end in ends:
            if ids[end] != last:
                continue
            length = 1
            while length < self.max_ngram and end - length >= 0 and ids[end - length] == ids[n - 1 - length]:
                length += 1
            if length > best_len:  # strictly longer: ties keep the first one visited
                best_len, best_end = length, end
        return best_len, best_end

    def lookup(self, ids: list[int], k: int, eos: frozenset[int]) -> list[int]:
        """One row's copy: up to k tokens (up to the match's length for a short match), cut after an EOS."""
        if k <= 0:
            return []
        length, end = self.match(ids)
        if length < self.min_ngram:
            return []
        count = k if length >= self.full_ngram else min(k, length)
        return cut_at_eos(ids[end + 1 : end + 1 + count], eos)

    def tree(self, ids: list[int], k: int, nodes: int, eos: frozenset[int],
             costs: dict[int, float] | None = None, scale: float = 1.0) -> Proposal:
        """One row's lookup tree: what followed each of the best `branches` matches, merged by prefix: the chain
        `lookup` proposes, then the other matches' nodes by their share of the matches, up to `nodes` nodes, those
        beyond the chain cut by pass costs when asked (drafters.trees.branch_out)."""
        from .trees import branch_out, lookup_tree, lookup_values  # trees builds on this module

        tree, support = lookup_tree(self, ids, k, self.branches, eos)
        if not len(tree):
            return Proposal([])
        chain = len(self.lookup(ids, k, eos))  # the best match's copy: the tree's first nodes
        values = lookup_values(tree, support)
        tree, kept = branch_out(tree, values, costs, nodes, chain, scale)
        return Proposal(list(tree.tokens), parents=list(tree.parents), values=[values[j] for j in kept])

    def propose(self, request: DraftRequest) -> list[Proposal]:
        eos = request.eos_token_ids
        return [self.tree(ids, k, request.nodes(r), eos, request.tree_costs, request.tree_extra_scale)
                if request.nodes(r) and k > 0
                else Proposal(self.lookup(ids, k, eos)) for r, (ids, k) in enumerate(zip(request.ids, request.ks))]
