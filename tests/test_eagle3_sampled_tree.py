"""An EAGLE-3 head's draft trees under sampling (drafters/eagle3_tree.py's draft_sampled_trees) on tiny random
models: one tree step's output law, enumerated through the real drafting code over every draw, is the target's to
1e-6, and q rows drawn with replacement or a tree pruned after drawing break it; each node's q row is the law it was
drawn from; sampled decodes with the head's trees keep the target's distribution at B = 1 and 40, eager and static;
tree_plan gives the head trees when sampling."""

import itertools

import pytest
import torch
from conftest import draft_vocab, random_head, sampled_second_tokens, second_token_distribution, tiny_llama
from test_tree import tv, walk_outcomes

from specdemo.config import GenerationConfig, SamplingConfig
from specdemo.drafters import NgramDrafter, eagle3_tree
from specdemo.drafters.base import DraftRequest
from specdemo.drafters.eagle3 import Eagle3Drafter
from specdemo.drafters.trees import best_subtree
from specdemo.engine.kv import BatchKV
from specdemo.engine.loop import tree_plan
from specdemo.engine.tree import TokenTree, sibling_rows
from specdemo.engine.verify import logits_to_probs

PROMPT = [4, 2, 3, 1, 4, 4, 2, 1, 3]
IDS = PROMPT + [1]  # the prompt and a pending token: what the tree continues
V, SUBSET = 5, torch.tensor([0, 1, 3, 4])  # a 5-id target and a head over 4 of them: few enough to enumerate
MILD = {n: 1.0 + 0.05 * n for n in range(1, 17)}  # pass costs under which auto cuts some slots, by earlier draws


@pytest.fixture(scope="module")
def small():
    """An 8-layer tiny llama over 5 ids (so p has mass where q has) and a random head over 4 of them."""
    target = tiny_llama(V, seed=6, sharpness=4.0, layers=8)
    return target, random_head(target, 3, vocab=SUBSET)


class _Draw(Exception):
    def __init__(self, q: torch.Tensor, count: int):
        self.q, self.count = q, count


def _ordered_draws(q: torch.Tensor, count: int):
    """Every ordered draw of `count` indices from q without replacement, with its probability (float64)."""
    q = q.double() / q.double().sum()
    for picks in itertools.permutations([i for i in range(len(q)) if q[i] > 0], count):
        prob, left = 1.0, 1.0
        for i in picks:
            prob, left = prob * float(q[i]) / left, left - float(q[i])
        yield prob, list(picks)


def every_proposal(monkeypatch, drafter, hidden, request):
    """Every proposal draft_sampled_trees makes for this one-row request, with its probability: the real drafting
    code rerun with each draw forced to every ordered outcome (the probabilities from the q it drew from)."""
    out = []

    def run(forced):
        taken = []

        def draw(q, count, generator):
            if len(taken) == len(forced):
                raise _Draw(q, count)
            taken.append(forced[len(taken)])
            return torch.tensor(taken[-1][1], device=q.device)

        monkeypatch.setattr(eagle3_tree, "draw_without_replacement", draw)
        drafter.begin([PROMPT], hidden)
        try:
            proposal = drafter.propose(request)[0]
        except _Draw as d:
            for prob, picks in _ordered_draws(d.q, d.count):
                run(forced + [(prob, picks)])
            return
        out.append((float(torch.tensor([p for p, _ in taken], dtype=torch.float64).prod()), proposal))

    with torch.inference_mode():
        run([])
    return out


class Target:
    """The tiny target's p after IDS plus a suffix, under the sampling settings (float64), made on first use."""

    def __init__(self, model, sampling):
        self.model, self.sampling, self.memo = model, sampling, {}

    def __call__(self, suffix: tuple) -> torch.Tensor:
        if suffix not in self.memo:
            with torch.inference_mode():
                logits = self.model(input_ids=torch.tensor([IDS + list(suffix)])).logits[0, -1]
            self.memo[suffix] = logits_to_probs(logits, self.sampling).double()
        return self.memo[suffix]


def first_two_law(proposals, p: Target, mutate=None) -> dict[tuple, float]:
    """Law of the first two emitted tokens, where one tree step emits them (a step that emits one token leaves the
    second to the next step, which draws it from p): every proposal, every way tree_walk goes on it."""
    law: dict[tuple, float] = {}
    for weight, proposal in proposals:
        tree, rows = TokenTree(proposal.tokens, proposal.parents or range(-1, len(proposal.tokens) - 1)), proposal.probs
        if mutate is not None:
            tree, rows = mutate(tree, rows)
        target = torch.stack([p(tuple(tree.tokens[i] for i in tree.path(e - 1))) for e in range(len(tree) + 1)])
        for prob, path, nxt in walk_outcomes(tree, rows.double(), target):
            seq = tuple(tree.tokens[i] for i in path)
            for y in torch.nonzero(nxt).flatten().tolist():
                emitted, w = seq + (y,), weight * prob * float(nxt[y])
                tails = [((), 1.0)] if len(emitted) >= 2 else [((z,), float(pz)) for z, pz in enumerate(p(emitted))]
                for tail, pt in tails:
                    key = (emitted + tail)[:2]
                    law[key] = law.get(key, 0.0) + w * pt
    return law


def with_replacement(tree, rows):
    """Each node's row replaced by q at its parent (its first sibling's row): as if siblings were drawn i.i.d."""
    return tree, torch.stack([rows[tree.children(a)[0]] for a in tree.parents])


def pruned(tree, rows):
    """EAGLE-2's rerank after drawing: the best len - 1 nodes by joint draft probability (q at the parent)."""
    single = with_replacement(tree, rows)[1]
    values = []
    for j, a in enumerate(tree.parents):
        values.append(float(single[j, tree.tokens[j]]) * (values[a] if a >= 0 else 1.0))
    kept_tree, kept = best_subtree(tree, values, None, len(tree) - 1)
    return kept_tree, rows[kept]


CASES = {"budget 6, k 2": (6, 2, 0.0, None, SamplingConfig(1.0)),
         "budget 4, k 3, unsure nodes stop, top-p": (4, 3, 0.45, None, SamplingConfig(0.7, top_p=0.9)),
         "auto's cost cut, k 2": (8, 2, 0.0, MILD, SamplingConfig(1.0))}


@pytest.mark.parametrize("case", list(CASES))
def test_one_tree_step_emits_the_targets_law_exactly(monkeypatch, small, case):
    """Every tree the head can draw (a draft vocabulary of 4 of 5 ids, children drawn without replacement), every way
    tree_accept goes on it: the first two emitted tokens follow p to 1e-6 (3e-8 here), far from the head's q; rows
    with replacement, or the drawn tree pruned by its values, move the law past 1e-4 (0.04-0.07). Some trees branch
    below the root; under --tree auto the cost cut gives trees of several sizes."""
    nodes, k, min_confidence, costs, sampling = CASES[case]
    target, head = small
    with torch.inference_mode():
        _, hidden = BatchKV(target, 1).prefill([PROMPT], head.target_layers)
    drafter = Eagle3Drafter(head, min_confidence=min_confidence)
    drafter.pass_costs = costs
    request = DraftRequest([IDS], [k], sampling, [None], frozenset({0}), [nodes], costs)
    proposals = every_proposal(monkeypatch, drafter, hidden, request)
    p = Target(target, sampling)
    exact = {(y, z): float(p(())[y] * p((y,))[z]) for y in range(V) for z in range(V)}
    assert abs(sum(w for w, _ in proposals) - 1.0) < 1e-9 and len(proposals) > 20
    assert all(len(pr.tokens) <= nodes and max(TokenTree(pr.tokens, pr.parents).depths) <= k for _, pr in proposals)
    assert len({len(pr.tokens) for _, pr in proposals}) > 1 or costs is None  # auto's cut depends on earlier draws
    assert any(len(TokenTree(pr.tokens, pr.parents).children(a)) > 1 for _, pr in proposals for a in pr.parents
               if a >= 0)
    assert tv(first_two_law(proposals, p), exact) < 1e-6
    first_drafts = {}
    for w, pr in proposals:
        first_drafts[pr.tokens[0]] = first_drafts.get(pr.tokens[0], 0.0) + w
    assert tv({(y,): v for y, v in first_drafts.items()}, {(y,): float(p(())[y]) for y in range(V)}) > 0.2
    for mutate in (with_replacement, pruned):
        assert tv(first_two_law(proposals, p, mutate), exact) > 1e-4, mutate.__name__


def test_each_nodes_row_is_the_law_it_was_drawn_from(eagle3_target):
    """Sampled trees (top-k and top-p on) from a head over 12 of 16 ids, two rows, several seeds: the root's row is
    the sampled chain's first q (logits_to_probs, as chains draw), every row is q at its parent less the earlier
    siblings, renormalised (sibling_rows without replacement), zero outside the draft vocabulary; siblings differ;
    token_probs are each token's own row; the same seed draws the same trees."""
    head = random_head(eagle3_target, 1, vocab=draft_vocab(12, 1, vocab=16))
    sampling = SamplingConfig(0.8, top_k=10, top_p=0.95)
    prompts = [[4, 2, 8, 7, 5, 4, 11, 1, 13], [14, 5, 3, 11, 9]]
    ids = [p + [3] for p in prompts]
    with torch.inference_mode():
        _, hidden = BatchKV(eagle3_target, 2).prefill(prompts, head.target_layers)

    def propose(seed, nodes=(8, 8)):
        drafter = Eagle3Drafter(head)
        drafter.begin(prompts, hidden)
        gens = [torch.Generator().manual_seed(seed + r) for r in range(2)]
        with torch.inference_mode():
            return drafter.propose(DraftRequest(ids, [3, 3], sampling, gens, frozenset({0}), list(nodes)))

    outside = torch.ones(16, dtype=torch.bool)
    outside[head.subset] = False
    branched = 0
    for seed in range(4):
        chains = propose(seed, ())
        for chain, p in zip(chains, propose(seed)):
            tree = TokenTree(p.tokens, p.parents)
            assert len(tree) <= 8 and max(tree.depths) <= 3 and tree.distinct_siblings()
            assert torch.equal(p.probs[0], chain.probs[0]) and float(p.probs[:, outside].abs().sum()) == 0.0
            at = [p.probs[kids[0]] if kids else p.probs[0] for kids in map(tree.children, range(-1, len(tree)))]
            assert torch.allclose(sibling_rows(tree, torch.stack(at), replacement=False), p.probs, atol=1e-6)
            assert p.token_probs == pytest.approx([float(p.probs[j, t]) for j, t in enumerate(p.tokens)])
            branched += any(len(tree.children(a)) > 1 for a in range(len(tree)))
        assert [q.tokens for q in propose(seed)] == [q.tokens for q in propose(seed)]
    assert branched >= 4 and [q.tokens for q in propose(0)] != [q.tokens for q in propose(1)]


class Counted(Eagle3Drafter):
    """A head drafter that counts the trees it proposes (more than one child somewhere)."""

    trees = 0

    def propose(self, request):
        out = super().propose(request)
        Counted.trees += sum(p.parents is not None and not TokenTree(p.tokens, p.parents).is_chain() for p in out)
        return out


@pytest.mark.parametrize("rows", [1, 40])
def test_sampled_decodes_with_the_heads_trees_keep_the_targets_distribution(eagle3_runner, eagle3_target, tiny_tok,
                                                                            rows, monkeypatch):
    """The head's sampled trees in the engine (--tree 8, k 2), eager and static: the second new token follows the
    target's distribution (TV < 0.06 over 2,000 seeded rows in batches of 40; < 0.15 over 300 runs at B = 1), and
    the drafter proposed trees in most steps."""
    head = random_head(eagle3_target, 2, vocab=draft_vocab(12, 2, vocab=16))
    prompt = [4, 2, 8, 7, 5, 4, 11, 1, 13]
    expected = second_token_distribution(eagle3_target, prompt)
    config = GenerationConfig(max_new_tokens=3, num_draft_tokens=2, sampling=SamplingConfig(1.0), tree="8")
    trials = 2000 if rows > 1 else 300
    monkeypatch.setattr(Counted, "trees", 0)
    counts, drafted = sampled_second_tokens(eagle3_target, tiny_tok, lambda: Counted(head), prompt, config, trials,
                                            rows)
    empirical = counts / counts.sum()
    assert counts.sum() > 0.9 * trials and Counted.trees > trials // 2
    assert 0.5 * float((empirical - expected).abs().sum()) < (0.06 if rows > 1 else 0.15)


def test_the_heads_trees_are_planned_when_sampling(small):
    """tree_plan: the head drafts trees when sampling as when greedy (--tree N, and auto by its pass costs); a
    drafter whose trees are greedy only still gets chains when sampling, and says why."""
    _, head = small
    sampled = GenerationConfig(sampling=SamplingConfig(1.0), tree="8")
    drafter = Eagle3Drafter(head)
    assert tree_plan(sampled, drafter).nodes == tree_plan(GenerationConfig(tree="8"), drafter).nodes == 8
    drafter.pass_costs = MILD
    plan = tree_plan(GenerationConfig(sampling=SamplingConfig(1.0)), drafter)
    assert plan.nodes == 16 and plan.by_cost

    class GreedyOnly(NgramDrafter):
        greedy_trees_only = True

    plan = tree_plan(sampled, GreedyOnly())
    assert plan.nodes == 0 and "greedy only" in plan.why and tree_plan(GenerationConfig(tree="8"), GreedyOnly()).nodes
