"""Draft trees (engine/tree.py): positions and the ancestry mask (a chain is causal), greedy acceptance from extreme
logits and against autoregressive greedy, and recursive rejection sampling: its output law enumerated exactly through
tree_walk itself on a small vocabulary (sampled siblings with and without replacement, one-hot drafts, a mix) equals
the target's, a wrong residual breaks that, a chain is rejection_accept draw for draw, and seeded draws agree."""

import itertools
import random

import pytest
import torch

import specdemo.engine.tree as tree_mod
from specdemo.engine.tree import (
    TokenTree,
    TreeBatch,
    greedy_tree_accept,
    greedy_tree_accept_batch,
    sibling_rows,
    tree_accept,
    tree_accept_batch,
    tree_walk,
)
from specdemo.engine.verify import greedy_accept_batch, rejection_accept

NEG = float("-inf")

# root -> 0 (1) -> 1 (3) -> 2 (6); 0 -> 3 (4); root -> 4 (2) -> 5 (5)
BRANCHY = TokenTree((1, 3, 6, 4, 2, 5), (-1, 0, 1, 0, -1, 4))


def test_a_chain_is_causal_with_positions_counting_up():
    """chain(tokens): one child per node, the causal mask, positions start..start + k."""
    t = TokenTree.chain([7, 8, 9, 10])
    assert t.parents == (-1, 0, 1, 2) and t.is_chain()
    assert torch.equal(t.attention_mask(), torch.ones(5, 5, dtype=torch.bool).tril())
    assert t.positions(12).tolist() == [12, 13, 14, 15, 16]
    assert TokenTree.chain([]).attention_mask().tolist() == [[True]]


def test_a_branching_tree_attends_to_its_ancestors_only():
    """Each entry sees itself, the root and its ancestors; a node's position is the root's plus its depth."""
    t = BRANCHY
    assert t.depths == (1, 2, 3, 2, 1, 2)
    assert t.positions(5).tolist() == [5, 6, 7, 8, 7, 6, 7]
    assert (t.children(), t.children(0), t.children(2), t.path(2), t.path(5), t.path(-1)) == \
        ((0, 4), (1, 3), (), [0, 1, 2], [4, 5], [])
    ancestors = {0: [], 1: [0], 2: [0, 1], 3: [0], 4: [], 5: [4]}
    expected = torch.zeros(7, 7, dtype=torch.bool)
    expected[:, 0] = True
    for j, anc in ancestors.items():
        expected[j + 1, [j + 1] + [a + 1 for a in anc]] = True
    assert torch.equal(t.attention_mask(), expected) and torch.equal(torch.tensor(t.ancestry), expected)
    assert not t.is_chain() and t.distinct_siblings()


def test_trees_are_built_merged_and_pruned():
    """from_paths merges sequences by common prefix; select keeps an ancestor-closed subset; bad parents refused."""
    assert TokenTree.from_paths([[1, 3, 6], [1, 4], [2, 5], [1, 3]]) == BRANCHY
    assert TokenTree.from_paths([[4, 5, 6]]) == TokenTree.chain([4, 5, 6])
    assert BRANCHY.select([0, 3, 4]) == TokenTree((1, 4, 2), (-1, 0, -1))
    with pytest.raises(ValueError, match="without their parents"):
        BRANCHY.select([1, 2])
    with pytest.raises(ValueError, match="earlier node"):
        TokenTree((1, 2), (1, -1))
    assert not TokenTree((3, 3), (-1, -1)).distinct_siblings()


def picks(choices: list[int], vocab: int = 8) -> torch.Tensor:
    """Logits whose argmax at entry e is choices[e] (+10 there, -inf elsewhere): verdicts chance cannot change."""
    logits = torch.full((len(choices), vocab), NEG)
    logits[torch.arange(len(choices)), torch.tensor(choices)] = 10.0
    return logits


def test_greedy_follows_the_branch_the_target_agrees_with():
    """The target picks 2 at the root (node 4's token, the root's second child), then 5 (node 5), then 7: path
    [4, 5], bonus 7; only its argmax at the path's entries matters."""
    assert greedy_tree_accept(BRANCHY, picks([2, 0, 0, 0, 0, 5, 7])) == ([4, 5], 7)
    assert greedy_tree_accept(BRANCHY, picks([1, 4, 0, 0, 3, 0, 0])) == ([0, 3], 3)  # the second grandchild
    assert greedy_tree_accept(BRANCHY, picks([1, 3, 6, 2, 0, 0, 0])) == ([0, 1, 2], 2)  # the full deepest path
    assert greedy_tree_accept(BRANCHY, picks([7, 3, 6, 2, 0, 0, 0])) == ([], 7)  # no root child agrees
    assert greedy_tree_accept(TokenTree.chain([]), picks([6])) == ([], 6)


def test_greedy_batch_matches_rows_and_the_chain_rule():
    """Random trees with the tokens the target would pick planted on some branches: the batched walk equals each
    row's alone (with padding) and the device's verdict, and on chains it is greedy_accept_batch."""
    gen = torch.Generator().manual_seed(0)
    vocab, trees, logits = 6, [], []
    for r in range(12):
        n = int(torch.randint(0, 8, (1,), generator=gen))
        parents = [int(torch.randint(-1, j, (1,), generator=gen)) if j else -1 for j in range(n)]
        if r % 3 == 0:
            parents = list(range(-1, n - 1))
        row = torch.randn(n + 1, vocab, generator=gen)
        choice = row.argmax(-1)
        tokens = [int(choice[a + 1]) if torch.rand(1, generator=gen) < 0.7 else int(torch.randint(vocab, (1,),
                  generator=gen)) for a in parents]
        trees.append(TokenTree(tokens, parents))
        logits.append(torch.cat([row, torch.randn(9 - n - 1, vocab, generator=gen)]))
    stacked = torch.stack(logits)  # (12, 9, V): rows padded to 8 nodes
    paths, nxt = greedy_tree_accept_batch(trees, stacked)
    assert (paths, nxt) == tuple(map(list, zip(*[greedy_tree_accept(t, lg[: len(t) + 1]) for t, lg in
                                                 zip(trees, logits)])))
    assert sum(len(p) for p in paths) >= 8  # the planted branches were found
    # the device's verdict (what a GPU runs) agrees with the host's walk (what a CPU runs)
    last, device_next = tree_mod.greedy_tree_verdict(TreeBatch.stack(trees, 8), stacked)
    assert [t.path(e - 1) if e else [] for t, e in zip(trees, last.tolist())] == paths
    assert device_next.tolist() == nxt
    chains = [r for r, t in enumerate(trees) if t.is_chain()]
    drafted = torch.zeros(len(chains), 8, dtype=torch.long)
    for i, r in enumerate(chains):
        drafted[i, : len(trees[r])] = torch.tensor(trees[r].tokens, dtype=torch.long)
    lengths = torch.tensor([len(trees[r]) for r in chains])
    accepted, chain_next = greedy_accept_batch(drafted, lengths, stacked[chains])
    assert accepted == [len(paths[r]) for r in chains] and chain_next == [nxt[r] for r in chains]


def test_greedy_tree_output_is_the_targets_greedy_output():
    """A toy target whose argmax after any prefix is a fixed function of it; trees planted with its choices and
    decoys. The tokens a step emits (accepted path + next token) are always the next ones of its greedy run."""
    vocab = 5

    def argmax_after(prefix):
        return (3 * sum(prefix) + len(prefix)) % vocab

    gen = torch.Generator().manual_seed(1)
    for _ in range(40):
        prefix = torch.randint(vocab, (3,), generator=gen).tolist()
        paths, ctx = [], []
        for _ in range(3):  # three branches of depth 3, partly the target's run, partly decoys
            ctx, path = list(prefix), []
            for _ in range(3):
                t = argmax_after(ctx) if torch.rand(1, generator=gen) < 0.6 else int(torch.randint(vocab, (1,),
                                                                                                  generator=gen))
                path.append(t)
                ctx.append(t)
            paths.append(path)
        tree = TokenTree.from_paths(paths)
        logits = picks([argmax_after(prefix + [tree.tokens[i] for i in tree.path(e - 1)]) for e in
                        range(len(tree) + 1)], vocab)
        path, nxt = greedy_tree_accept(tree, logits)
        emitted = [tree.tokens[i] for i in path] + [nxt]
        run = list(prefix)
        for _ in emitted:
            run.append(argmax_after(run))
        assert emitted == run[len(prefix):]


# ---- exact sampling: the output law by enumeration ----------------------------------------------------------------

V = 4


class Tables:
    """p and q after every prefix: peaked random distributions (float64), made on first use from a seed."""

    def __init__(self, seed: int, vocab: int = V):
        self.seed, self.vocab, self.p, self.q = seed, vocab, {}, {}

    def _make(self, prefix, which):
        gen = torch.Generator().manual_seed(hash((self.seed, which, prefix)) % 2**31)
        return torch.softmax(2.0 * torch.randn(self.vocab, generator=gen, dtype=torch.float64), -1)

    def P(self, prefix):
        return self.p.setdefault(prefix, self._make(prefix, 0))

    def Q(self, prefix):
        return self.q.setdefault(prefix, self._make(prefix, 1))


def context(tree: TokenTree, prefix: tuple, entry: int) -> tuple:
    return prefix + tuple(tree.tokens[i] for i in tree.path(entry - 1))


def drafted_trees(prefix: tuple, parents: tuple, mode: str, t: Tables):
    """Every tree of this shape a drafter can propose after prefix, with its probability and its draft rows:
    'iid': each child ~ q at its parent, with replacement; 'without': siblings drawn without replacement; 'topk':
    deterministic, child i is the i-th most likely token of q at its parent (rows None); 'mixed': the root's first
    child is a lookup's fixed token (a one-hot row), the rest i.i.d. from q."""
    n, shape = len(parents), TokenTree((0,) * len(parents), parents)
    if mode == "topk":
        tokens = []
        for j, a in enumerate(parents):
            rank = sum(1 for s in range(j) if parents[s] == a)
            ctx = prefix + tuple(tokens[i] for i in shape.path(a))
            tokens.append(int(torch.argsort(t.Q(ctx), descending=True)[rank]))
        yield 1.0, TokenTree(tokens, parents), None
        return
    for tokens in itertools.product(range(V), repeat=n):
        tree = TokenTree(tokens, parents)
        weight, rows = 1.0, []
        for j, a in enumerate(parents):
            q = t.Q(context(tree, prefix, a + 1)).clone()
            earlier = [tokens[s] for s in tree.children(a) if s < j]
            if mode == "mixed" and j == 0:
                q = torch.nn.functional.one_hot(torch.tensor((sum(prefix) + 1) % V), V).double()
            elif mode == "without":
                if tokens[j] in earlier:
                    weight = 0.0
                    break
                q[earlier] = 0.0
                q = q / q.sum()
            weight *= float(q[tokens[j]])
            rows.append(q)
        if weight > 0:
            yield weight, tree, torch.stack(rows)


class _Branch(Exception):
    def __init__(self, accept: float):
        self.accept = accept


def walk_outcomes(tree, rows, target):
    """Every way tree_walk goes, through tree_walk itself: [(probability, accepted path, next-token law)]. Each
    accept/reject choice is replayed both ways, weighted min(1, p/q) and the rest (the law of tree_accept's draw
    r < p/q); the next-token law is the walk's distribution normalised, as torch.multinomial reads it."""
    out = []

    def run(forced):
        taken = []

        def decide(c, px, qx):
            a = 1.0 if float(qx) <= float(px) else float(px) / float(qx)
            if len(taken) == len(forced):
                raise _Branch(a)
            taken.append(a if forced[len(taken)] else 1.0 - a)
            return forced[len(taken) - 1]

        try:
            path, p = tree_walk(tree, rows, target, decide)
        except _Branch as b:
            for choice, w in ((True, b.accept), (False, 1.0 - b.accept)):
                if w > 0:
                    run(forced + [choice])
            return
        out.append((float(torch.tensor(taken, dtype=torch.float64).prod()), path, p / p.sum()))

    run([])
    return out


def step_law(prefix, parents, mode, t: Tables) -> dict[tuple, float]:
    """Exact law of one tree step's emitted tokens (accepted path, then the next token)."""
    law: dict[tuple, float] = {}
    for weight, tree, rows in drafted_trees(prefix, parents, mode, t):
        target = torch.stack([t.P(context(tree, prefix, e)) for e in range(len(tree) + 1)])
        for prob, path, nxt in walk_outcomes(tree, rows, target):
            seq = tuple(tree.tokens[i] for i in path)
            for y in range(V):
                if nxt[y] > 0:
                    law[seq + (y,)] = law.get(seq + (y,), 0.0) + weight * prob * float(nxt[y])
    return law


def first_n(prefix, n, parents, mode, t: Tables, memo=None) -> dict[tuple, float]:
    """Exact law of the first n emitted tokens under repeated tree steps."""
    memo = {} if memo is None else memo
    if (prefix, n) not in memo:
        out: dict[tuple, float] = {}
        for seq, prob in step_law(prefix, parents, mode, t).items():
            rest = {(): 1.0} if len(seq) >= n else first_n(prefix + seq, n - len(seq), parents, mode, t, memo)
            for tail, pt in rest.items():
                out[(seq + tail)[:n]] = out.get((seq + tail)[:n], 0.0) + prob * pt
        memo[(prefix, n)] = out
    return memo[(prefix, n)]


def law_of(prefix, n, dist) -> dict[tuple, float]:
    """p's (or q's) own law of the next n tokens: dist(prefix) -> (V,)."""
    return {s: float(torch.prod(torch.stack([dist(prefix + s[:i])[s[i]] for i in range(n)])))
            for s in itertools.product(range(V), repeat=n)}


def tv(a: dict, b: dict) -> float:
    return 0.5 * sum(abs(a.get(s, 0.0) - b.get(s, 0.0)) for s in set(a) | set(b))


SHAPES = {"3 children, one with 2": (-1, -1, -1, 0, 0), "2x2": (-1, 0, 0, -1, 3)}


@pytest.mark.parametrize("mode", ["iid", "without", "topk", "mixed"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_tree_sampling_emits_the_targets_law_exactly(mode, shape):
    """Enumerating every drafted tree and every accept/reject branch of tree_walk: the first token and the first two
    tokens follow p to 1e-9, far from q; depth-2 trees, 2-3 children, sampled siblings (with and without
    replacement), one-hot (top-k) siblings and a one-hot child among sampled ones."""
    t = Tables(seed=len(mode) + 10 * len(shape))
    memo = {}
    for n in (1, 2):
        assert tv(first_n((), n, SHAPES[shape], mode, t, memo), law_of((), n, t.P)) < 1e-9
    assert tv(law_of((), 2, t.P), law_of((), 2, t.Q)) > 0.2
    assert tv(first_n((), 2, SHAPES[shape], mode, t, memo), law_of((), 2, t.Q)) > 0.2


def _no_subtraction(p, q):
    return p


def _not_renormalised(p, q):
    return (p - q).clamp(min=0)


@pytest.mark.parametrize("mode", ["iid", "without", "topk"])
@pytest.mark.parametrize("wrong", [_no_subtraction, _not_renormalised])
def test_a_wrong_residual_breaks_the_law(monkeypatch, mode, wrong):
    """The enumeration catches a residual that forgets q (for one-hot drafts: keeps the rejected token) or is not
    renormalised before the next sibling's test: the first token's law moves 1e5 times past the exact test's bound
    (forgetting q: 0.06-0.14 in TV; not renormalising: 1e-3 to 5e-3, the residual's mass being small here)."""
    t = Tables(seed=3)
    parents = SHAPES["3 children, one with 2"]
    assert tv(first_n((), 1, parents, mode, t), law_of((), 1, t.P)) < 1e-9
    monkeypatch.setattr(tree_mod, "_residual", wrong)
    assert tv(first_n((), 1, parents, mode, t), law_of((), 1, t.P)) > 1e-4


def test_sibling_rows_are_the_laws_the_siblings_were_drawn_from():
    """With replacement each child's row is q at its parent; without, q less the earlier siblings, renormalised."""
    tree = TokenTree((0, 2, 1, 3), (-1, -1, -1, 0))
    q = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]], dtype=torch.float64)
    parent_probs = torch.stack([q[0], q[1], q[0], q[0], q[0]])  # after the root, then after each node
    assert torch.equal(sibling_rows(tree, parent_probs), torch.stack([q[0], q[0], q[0], q[1]]))
    rows = sibling_rows(tree, parent_probs, replacement=False)
    expected = [[0.4, 0.3, 0.2, 0.1], [0, 0.5, 0.2 / 0.6, 1 / 6], [0, 0.3 / 0.4, 0, 0.1 / 0.4], [0.1, 0.2, 0.3, 0.4]]
    assert torch.allclose(rows, torch.tensor(expected, dtype=torch.float64)) and rows[1].sum() == pytest.approx(1)


@pytest.mark.parametrize("deterministic", [False, True])
def test_on_a_chain_tree_accept_is_rejection_accept(deterministic):
    """A chain through tree_accept takes rejection_accept's draws and verdicts, seed for seed."""
    gen = torch.Generator().manual_seed(5)
    for seed in range(60):
        k = seed % 5
        target = torch.softmax(2 * torch.randn(k + 1, 6, generator=gen), -1)
        draft = torch.softmax(2 * torch.randn(k, 6, generator=gen), -1)
        tokens = torch.multinomial(draft, 1, generator=gen)[:, 0] if k else torch.zeros(0, dtype=torch.long)
        q = None if deterministic else draft
        a = rejection_accept(tokens, q, target, torch.Generator().manual_seed(seed))
        path, nxt = tree_accept(TokenTree.chain(tokens.tolist()), q, target, torch.Generator().manual_seed(seed))
        assert (len(path), nxt) == a and path == list(range(len(path)))


def test_seeded_tree_sampling_follows_the_target():
    """Seeded trials through tree_accept itself (trees sampled i.i.d. from q, shape 2x2, float32 rows as the engine
    passes them): the first two tokens within a TV bound of p's law and far from q's; more than one token per step
    on average."""
    t = Tables(seed=21)
    parents, gen = SHAPES["2x2"], torch.Generator().manual_seed(0)
    shape = TokenTree((0,) * len(parents), parents)
    counts, steps, trials = {}, 0, 3000
    for _ in range(trials):
        out = ()
        while len(out) < 2:
            tokens, rows = [], []
            for a in parents:
                ctx = out + tuple(tokens[i] for i in shape.path(a))
                rows.append(t.Q(ctx).float())
                tokens.append(int(torch.multinomial(rows[-1], 1, generator=gen)))
            tree = TokenTree(tokens, parents)
            target = torch.stack([t.P(context(tree, out, e)).float() for e in range(len(tree) + 1)])
            path, nxt = tree_accept(tree, torch.stack(rows), target, gen)
            out += tuple(tree.tokens[i] for i in path) + (nxt,)
            steps += 1
        counts[out[:2]] = counts.get(out[:2], 0) + 1 / trials
    law = law_of((), 2, t.P)
    assert tv(counts, law) < 0.06  # 16 outcomes, 3000 draws: the 99.9th percentile of the TV is about 0.045
    assert tv(counts, law_of((), 2, t.Q)) > 0.2
    assert trials / steps < 0.9  # fewer steps than two per trial: the tree emitted 2 tokens in one step at times


def test_tree_batch_stacks_padded_rows():
    """TreeBatch: each row's mask and depths as its tree's, padding real = False, seeing only itself."""
    trees = [BRANCHY, TokenTree.chain([4])]
    b = TreeBatch.stack(trees)
    assert b.tokens.shape == (2, 6) and b.real.sum(1).tolist() == [6, 1]
    assert torch.equal(b.mask[0], BRANCHY.attention_mask()) and b.depths[1].tolist() == [0, 1, 0, 0, 0, 0, 0]
    assert torch.equal(b.mask[1, 2:], torch.eye(7, dtype=torch.bool)[2:])
    assert torch.equal(b.mask[1, :2, :2], TokenTree.chain([4]).attention_mask()) and not b.mask[1, :2, 2:].any()
    assert b.tokens[1].tolist() == [4, 0, 0, 0, 0, 0] and b.parents[1].tolist() == [-1] * 6
    assert TreeBatch.stack([], 3).mask.shape == (0, 4, 4)


def test_tree_accept_batch_is_each_row_with_its_own_generator():
    """Rows of different trees and padding: the same verdicts as each row alone from the same seed."""
    gen = torch.Generator().manual_seed(2)
    trees, rows = [BRANCHY, TokenTree.chain([1, 2]), TokenTree((), ())], []
    target = torch.softmax(3 * torch.randn(3, 7, 8, generator=gen), -1)
    for r, t in enumerate(trees):  # sampled draft rows for the branchy tree, one-hot for the others
        rows.append(torch.softmax(torch.randn(len(t), 8, generator=gen), -1) if r == 0 else None)
    for seed in range(20):
        gens = [torch.Generator().manual_seed(seed + r) for r in range(3)]
        alone = [tree_accept(t, q, target[r, : len(t) + 1], torch.Generator().manual_seed(seed + r))
                 for r, (t, q) in enumerate(zip(trees, rows))]
        assert tree_accept_batch(trees, rows, target, gens) == ([a for a, _ in alone], [b for _, b in alone])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_batched_walk_decides_every_row_as_tree_accept_does(dtype):
    """tree_accept_batch (the engine's: all rows at once on the device, one read) takes tree_accept's verdicts and
    draws, seed for seed, on random batches: trees of 0 to 8 nodes of every shape, one-hot rows, sampled rows and
    both in one batch, padding past each tree; so the exact law enumerated above for tree_walk is the engine's."""
    rng, gen, vocab = random.Random(0), torch.Generator().manual_seed(0), 7
    for trial in range(200):
        trees, qs = [], []
        for _ in range(rng.randint(1, 5)):
            n = rng.randint(0, 8)
            q = torch.softmax(2 * torch.randn(n, vocab, generator=gen, dtype=torch.float64), -1)
            tokens = torch.multinomial(q, 1, generator=gen)[:, 0].tolist() if n else []
            trees.append(TokenTree(tokens, [rng.randint(-1, j - 1) for j in range(n)]))
            qs.append(q if rng.random() < 0.6 else None)
        width = max(len(t) for t in trees) + 1 + rng.randint(0, 2)
        p = torch.softmax(2 * torch.randn(len(trees), width, vocab, generator=gen), -1).to(dtype)
        gens = [torch.Generator().manual_seed(100 * trial + r) for r in range(len(trees))]
        batched = tree_accept_batch(trees, qs, p, gens)
        alone = [tree_accept(t, q, p[r, : len(t) + 1], torch.Generator().manual_seed(100 * trial + r))
                 for r, (t, q) in enumerate(zip(trees, qs))]
        assert batched == ([a for a, _ in alone], [t for _, t in alone]), trial
