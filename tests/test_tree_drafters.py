"""Tree drafts from the model-free drafters (drafters/trees.py): prompt lookup's matches as branches (one branch is the
chain), suffix decoding's subtrees of its matches merged (a branchless history gives the chain's draft; a shorter match
adds what the longer one never saw), and the node budget
chosen from pass costs (flat costs keep the tree, steep ones fall back to less or nothing)."""

import random

import pytest
import torch

from specdemo.config import SamplingConfig, SuffixConfig
from specdemo.drafters.base import DraftRequest
from specdemo.drafters.ngram import NgramDrafter
from specdemo.drafters.suffix import SuffixCache, SuffixDrafter, SuffixTree
from specdemo.drafters.trees import (
    best_subtree,
    branch_out,
    cut_after,
    graft,
    lookup_matches,
    lookup_tree,
    lookup_values,
    match_subtrees,
    merge,
    shifted_costs,
    suffix_forest,
    tree_budget,
)
from specdemo.engine.tree import TokenTree, greedy_tree_accept


def picks(choices: list[int], vocab: int = 10) -> torch.Tensor:
    """Logits whose argmax at entry e is choices[e]."""
    logits = torch.full((len(choices), vocab), float("-inf"))
    logits[torch.arange(len(choices)), torch.tensor(choices)] = 10.0
    return logits


# "1 2 3" was followed by 9 9, then (after "0") 8 4, then (after "0") 9 5; the context ends in "0 1 2 3"
IDS = [1, 2, 3, 9, 9, 0, 1, 2, 3, 8, 4, 0, 1, 2, 3, 9, 5, 0, 1, 2, 3]


def test_lookup_matches_put_the_chains_match_first():
    """On random short-alphabet histories the best match is NgramDrafter.match's, for either tie-break."""
    rng = random.Random(0)
    for latest in (False, True):
        drafter = NgramDrafter(latest=latest)
        for _ in range(200):
            ids = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
            found = lookup_matches(drafter, ids)
            assert (found[0] if found else (0, -1)) == drafter.match(ids)


def test_lookup_tree_merges_the_matches_by_prefix():
    """Three earlier matches, the two of length 4 first (the earlier first): branches 8 -> 4 and 9 -> (5, 9), the
    shared 9 counted twice; one branch is the chain NgramDrafter.lookup proposes; an EOS cuts a branch."""
    drafter = NgramDrafter()
    tree, support = lookup_tree(drafter, IDS, k=2, branches=3)
    assert tree == TokenTree((8, 4, 9, 5, 9), (-1, 0, -1, 2, 2)) == TokenTree.from_paths([[8, 4], [9, 5], [9, 9]])
    assert support == [1, 1, 2, 1, 1]
    chain, _ = lookup_tree(drafter, IDS, k=2, branches=1)
    assert chain == TokenTree.chain(drafter.lookup(IDS, 2, frozenset()))
    assert lookup_tree(drafter, IDS, k=2, branches=3, eos=frozenset({9}))[0] == TokenTree.from_paths([[8, 4], [9]])
    assert len(lookup_tree(drafter, [5, 6, 7], k=4, branches=3)[0]) == 0


def test_a_lookup_tree_accepts_where_the_chain_fails():
    """The target continues like the second match (9 5): greedy over the tree keeps both, the chain (8 4) none."""
    tree, _ = lookup_tree(NgramDrafter(), IDS, k=2, branches=3)
    by_entry = [9, 0, 0, 5, 6, 0]  # the target's argmax after the root and after each node
    assert greedy_tree_accept(tree, picks(by_entry, 10)) == ([2, 3], 6)
    chain, _ = lookup_tree(NgramDrafter(), IDS, k=2, branches=1)
    assert greedy_tree_accept(chain, picks([9, 0, 0], 10)) == ([], 9)


def test_match_subtrees_grow_each_match_best_first():
    """After "1 2" (4 times): 3 4 1 2 twice (0.5 each), then the 0.25s in the order they were reached: the 5 under
    the match, 3 and 5 after "1 2" again, 6 under the first 5; each node's probability is its path's product of
    count ratios, and min_token_prob cuts the rarer branches. "2" occurs where "1 2" does: its subtree is the same,
    grown only when a depth limit does not say so."""
    seq = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 5, 6, 1, 2]
    tree = SuffixTree(24)
    tree.extend(0, seq)
    want = TokenTree((3, 4, 1, 2, 5, 3, 5, 6), (-1, 0, 1, 2, -1, 3, 3, 4))
    assert match_subtrees(tree, seq, 8, SuffixConfig(), max_depth=8) == [(want, [0.5] * 4 + [0.25] * 4)]
    both = match_subtrees(tree, seq, 8, SuffixConfig())
    assert len(both) == 2 and both[0] == both[1] and suffix_forest(both) == both[0]
    cut = match_subtrees(tree, seq, 8, SuffixConfig(min_token_prob=0.3), max_depth=8)
    assert [t for t, _ in cut] == [want.select(range(4))] == [TokenTree.chain([3, 4, 1, 2])]


def test_suffix_forest_adds_what_a_shorter_match_saw():
    """ "1 2" was followed by 3 once; "2" alone was followed by 7 three times: arctic's one best subtree drafts the
    longer match's 3 or the shorter one's 7 first, the forest drafts both, longest match first, and a node both
    matches reach keeps the higher probability."""
    seq = [1, 2, 3, 0, 9, 2, 7, 0, 8, 2, 7, 0, 6, 2, 7, 0, 1, 2]
    tree = SuffixTree(24)
    tree.extend(0, seq)
    parts = match_subtrees(tree, seq, 4, SuffixConfig(), max_depth=2)
    assert [t.tokens for t, _ in parts] == [(3, 0), (7, 0, 3, 0)]
    forest, values = suffix_forest(parts)
    assert forest == TokenTree((3, 0, 7, 0), (-1, 0, -1, 2))
    assert values == pytest.approx([0.5, 0.5, 0.6, 0.6])  # "2": 5 times, 3 of them before 7 (and 1 before 3: 0.2)
    merged, merged_values = merge(forest, values, TokenTree((3, 5), (-1, 0)), [0.9, 0.1])
    assert merged == TokenTree((3, 0, 7, 0, 5), (-1, 0, -1, 2, 0))
    assert merged_values == pytest.approx([0.9, 0.5, 0.6, 0.6, 0.1])


def test_a_suffix_tree_draft_holds_every_match_of_both_trees():
    """The chain (here the earlier answer's "1 2 4 4", the best score) comes first; the row's own "1 2" and "2"
    matches hang beside it: every continuation either tree saw after "1 2" or "2" is one of the root's children."""
    drafter = SuffixDrafter(SuffixCache())
    drafter.begin([[40]])
    drafter.propose(DraftRequest([[40, 1, 2, 4, 4]], [2], SamplingConfig(), [None]))  # an earlier answer
    prompt = [1, 2, 3, 0, 9, 2, 7, 0, 8, 2, 7, 0, 6, 2, 7, 0, 1, 2]
    drafter.begin([prompt])
    tree = drafter.propose(DraftRequest([prompt], [2], SamplingConfig(), [None], frozenset(), [8]))[0]
    assert (tree.tokens, tree.parents, tree.source) == ([4, 4, 3, 0, 7, 0], [-1, 0, -1, 2, -1, 4], "earlier")
    assert tree.values == pytest.approx([1.0, 1.0, 0.5, 0.5, 0.6, 0.6])
    assert drafter.propose(DraftRequest([prompt], [2], SamplingConfig(), [None]))[0].tokens == [4, 4]


def test_suffix_forest_without_branches_is_the_chain():
    """A history with one continuation of each match: the tree draft is a chain, speculate's chain draft first."""
    rng = random.Random(1)
    config = SuffixConfig(max_spec_factor=2)
    for _ in range(30):
        base = rng.sample(range(50), 12)  # no repeated token: every match has one continuation
        seq = base + base[: rng.randrange(2, 10)]
        tree = SuffixTree(24)
        tree.extend(0, seq)
        chain = tree.speculate(seq, 6, config)
        draft, probs = suffix_forest(match_subtrees(tree, seq, 6, config, max_depth=6))
        assert len(chain.tokens) >= 2 and draft.is_chain()
        assert draft.tokens[: len(chain.tokens)] == tuple(chain.tokens) and probs[: len(chain.tokens)] == chain.probs


COSTS = {1: 1.1, 2: 1.3, 3: 1.6, 4: 2.0}


def test_the_budget_maximises_tokens_per_pass_cost():
    """(1 + sum of kept values) / cost: 1.9 / 1.1, 2.4 / 1.3 (best), 2.8 / 1.6; flat costs keep every node; a steep
    curve keeps none; never past the widest pass measured."""
    values = [0.9, 0.5, 0.4, 0.1]
    assert tree_budget(values, COSTS) == 2
    assert tree_budget(values, dict.fromkeys(range(1, 9), 1.0)) == 4
    assert tree_budget(values, {1: 2.0, 2: 3.0, 3: 4.0, 4: 5.0}) == 0
    assert tree_budget([0.9] * 8, dict.fromkeys(range(1, 4), 1.0)) == 3


def test_best_subtree_keeps_a_tree_of_the_best_nodes():
    """Nodes are taken best first among those whose parent is in (a likely child of an unlikely node waits for it),
    up to the budget; a GPU-like flat curve keeps the whole tree, a steep one none."""
    tree = TokenTree((1, 2, 3, 4, 5), (-1, -1, 0, 1, 3))
    values = [0.5, 0.3, 0.45, 0.1, 0.9]
    kept_tree, kept = best_subtree(tree, values, COSTS)
    assert kept == [0, 2] and kept_tree == TokenTree((1, 3), (-1, 0))
    assert best_subtree(tree, values, dict.fromkeys(range(1, 6), 1.0))[0] == tree
    assert best_subtree(tree, values, {1: 3.0, 2: 4.0})[1] == []


def test_branch_out_keeps_the_chain_and_adds_what_pays():
    """The chain (the first nodes, or the first children) always stays; other nodes join best value first, up to the
    limit; with costs only those that pay for widening the chain's pass: flat costs keep the branch, steep ones
    leave the chain, and a short limit cuts the chain itself."""
    tree = TokenTree((1, 2, 3, 4, 5), (-1, 0, -1, 2, 1))  # chain 1 2, a branch 3 4, 5 under 2
    values = [0.6, 0.5, 0.3, 0.2, 0.1]
    assert branch_out(tree, values, None, 8)[1] == [0, 1, 2, 3, 4]
    assert branch_out(tree, values, None, 3)[1] == [0, 1, 4]  # first children: 1 -> 2 -> 5
    assert branch_out(tree, values, None, 3, chain=2)[1] == [0, 1, 2]  # the chain 1 2, then 3 before 5
    assert branch_out(tree, values, dict.fromkeys(range(1, 9), 1.0), 8, chain=2)[1] == [0, 1, 2, 3, 4]
    steep = {n: 2.0**n for n in range(1, 9)}
    assert branch_out(tree, values, steep, 8, chain=2) == (TokenTree.chain([1, 2]), [0, 1])
    assert branch_out(tree, values, steep, 1)[1] == [0]


def test_graft_puts_the_chain_first_and_merges_by_prefix():
    """A chain grafted with a tree: the chain's nodes first, a tree node on a chain prefix is that node (the higher
    value), the rest hang where their parents went; cut_after drops what follows an EOS."""
    tree = TokenTree((7, 8, 9, 5), (-1, 0, 0, -1))
    merged, values = graft([7, 9], [0.5, 0.4], tree, [0.9, 0.2, 0.3, 0.1])
    assert merged == TokenTree((7, 9, 8, 5), (-1, 0, 0, -1)) and values == [0.9, 0.4, 0.2, 0.1]
    assert graft([], [], tree, [0.9, 0.2, 0.3, 0.1]) == (tree, [0.9, 0.2, 0.3, 0.1])
    assert cut_after(TokenTree((7, 0, 3, 4), (-1, 0, 1, -1)), frozenset({0})) == (TokenTree((7, 0, 4), (-1, 0, -1)),
                                                                                  [0, 1, 3])
    assert shifted_costs({1: 1.2, 2: 1.5, 3: 1.8}, 1) == {1: 1.5 / 1.2, 2: 1.8 / 1.2}
    assert lookup_values(*lookup_tree(NgramDrafter(), IDS, k=2, branches=3)) == [1 / 3, 1 / 3, 2 / 3, 1 / 3, 1 / 3]
