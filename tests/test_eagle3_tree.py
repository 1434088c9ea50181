"""An EAGLE-3 head's dynamic draft trees (drafters/eagle3_tree.py) on tiny random models: each expanded node's
children are the head's top candidates after its path fed as a chain (the tree pass's mask and positions), every tree
starts with the chain the head drafts from the same state, and greedy output is the target's own under both
caches."""

from dataclasses import replace

import pytest
import torch
from conftest import random_head
from test_tree_engine import PROMPTS, spec_steps

from specdemo.config import GenerationConfig, SamplingConfig
from specdemo.drafters import Drafter, eagle3_tree
from specdemo.drafters.base import DraftRequest
from specdemo.drafters.eagle3 import Eagle3Drafter
from specdemo.engine import decode, row_outputs
from specdemo.engine.kv import BatchKV


@pytest.fixture(scope="module")
def head(eagle3_target):
    """A random head over all 16 ids of the 8-layer tiny target."""
    return random_head(eagle3_target, 0, vocab=torch.tensor(range(16)))


def test_children_are_the_heads_top_candidates_after_their_path(eagle3_target, head, monkeypatch):
    """Two rows, one tree each (up to 4 deep, 3 expanded per depth): at every expanded node, its children are the
    head's top 3 after feeding the root-to-node path one token at a time, as chain drafting would."""
    prompts = [[4, 2, 8, 7, 5, 4, 11, 1, 13], [14, 5, 3, 11, 9]]
    ids = [p + [3] for p in prompts]  # a pending token each
    grown = []
    proposal = eagle3_tree._proposal
    monkeypatch.setattr(eagle3_tree, "_proposal", lambda tree, *a: grown.append(tree) or proposal(tree, *a))
    with torch.inference_mode():
        _, hidden = BatchKV(eagle3_target, 2).prefill(prompts, head.target_layers)
        drafter = Eagle3Drafter(head)
        drafter.begin(prompts, hidden)
        drafter.propose(DraftRequest(ids, [4, 4], SamplingConfig(), [None, None], frozenset({0}), [16, 16]))
        checked = 0
        for r, tree in enumerate(grown):
            for n in range(len(tree.tokens)):
                kids = [tree.tokens[c] for c, a in enumerate(tree.parents) if a == n]
                if not kids:
                    continue
                chain = Eagle3Drafter(head)
                chain.begin(prompts, hidden)
                feature = chain._catch_up(ids, [4, 4])
                for node in tree.ancestors(n)[::-1]:
                    tokens = torch.tensor([[tree.tokens[node] if i == r else 0] for i in range(2)])
                    feature = chain._pass(feature[:, None], tokens, torch.tensor([[i == r] for i in range(2)]))[:, -1]
                q = torch.softmax(head.logits(feature[r : r + 1]).float(), -1)[0]
                assert head.subset[q.topk(eagle3_tree.TOP).indices].tolist() == kids
                checked += 1
    assert checked >= 10 and all(max(t.depth) == 4 for t in grown)
class Lockstep(Drafter):
    """An EAGLE-3 head drafting trees beside a twin drafting chains from the same state (same head, same requests,
    same verdicts): every tree must start with the twin's chain (its first nodes, a chain)."""

    needs_target_hidden = True
    drafts_trees = True

    def __init__(self, head):
        self.tree, self.chain = Eagle3Drafter(head), Eagle3Drafter(head)
        self.target_layers = self.tree.target_layers
        self.checked = 0

    def begin(self, prompts, target_hidden=None):
        self.tree.begin(prompts, target_hidden)
        self.chain.begin(prompts, target_hidden)

    def propose(self, request):
        trees = self.tree.propose(request)
        for t, c in zip(trees, self.chain.propose(replace(request, tree_nodes=()))):
            n = len(c.tokens)
            assert t.tokens[:n] == c.tokens and (t.parents is None or t.parents[:n] == list(range(-1, n - 1)))
            self.checked += n > 0 and t.parents is not None
        return trees

    def update(self, verdicts):
        self.tree.update(verdicts)
        self.chain.update(verdicts)

    def select(self, rows):
        self.tree.select(rows)
        self.chain.select(rows)


@pytest.mark.parametrize("rows", [1, 4])
def test_greedy_trees_and_the_chain_they_start_with(eagle3_runner, eagle3_target, head, tiny_tok, rows):
    """A random EAGLE-3 head's dynamic trees (top candidates per node, greedy): the target's own tokens at B = 1 and
    4, eager and static, and every tree starts with the chain the head drafts from the same state, so drafting trees
    leaves its cache as drafting chains does."""
    drafter = Lockstep(head)
    config = GenerationConfig(max_new_tokens=40, num_draft_tokens=4, tree="8")
    events = list(decode(eagle3_target, tiny_tok, PROMPTS[:rows], config, drafter))
    assert row_outputs(events, rows) == row_outputs(list(decode(eagle3_target, tiny_tok, PROMPTS[:rows], config)),
                                                    rows)
    trees = [s for s in spec_steps(events) if s.parents is not None]
    assert trees and drafter.checked >= len(trees) // 2
    assert all(len(s.drafted) <= 8 for s in trees)


@pytest.mark.parametrize("costs, wide", [({n: 1.0 + 0.01 * n for n in range(1, 17)}, True),
                                         ({n: 2.0**n for n in range(1, 17)}, False)], ids=["flat", "steep"])
def test_auto_expands_only_nodes_worth_verifying(eagle3_target, head, monkeypatch, costs, wide):
    """Under --tree auto the greedy tree feeds the head only the chain's node and the others that would be verified
    now: with flat costs several per depth, with steep ones (no branch pays) the chain's alone, so the head's passes
    cost what chain drafting's do, and the tree is the chain."""
    prompts = [[4, 2, 8, 7, 5, 4, 11, 1, 13], [14, 5, 3, 11, 9]]
    ids = [p + [3] for p in prompts]
    widths = []
    expand = eagle3_tree._expand
    monkeypatch.setattr(eagle3_tree, "_expand", lambda d, t, feed, *a: widths.append(max(map(len, feed)))
                        or expand(d, t, feed, *a))
    with torch.inference_mode():
        _, hidden = BatchKV(eagle3_target, 2).prefill(prompts, head.target_layers)
        drafter = Eagle3Drafter(head)
        drafter.begin(prompts, hidden)
        out = drafter.propose(DraftRequest(ids, [4, 4], SamplingConfig(), [None, None], frozenset({0}), [16, 16],
                                           costs))
    assert widths and (max(widths) > 1) == wide
    assert all((p.parents is not None and len(set(p.parents)) < len(p.parents)) == wide for p in out)
