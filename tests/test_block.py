"""Block verification (Sun et al., Alg. 2): exact output distributions (also for a deterministic drafter and for blocks
cut short by a confidence gate) and expected accepted lengths by enumeration on small vocabularies; the guarantee
(block >= token-wise, equal at k = 1 and when p = q; the paper's example: 10/9 and 11/9 drafts per step); the law of
tau and the sampled output through block_accept itself; and the engine's use of it (greedy output unchanged, sampled
output at B = 1 and B = 8 following the target's law)."""

import itertools

import pytest
import torch

from specdemo.config import GenerationConfig, SamplingConfig
from specdemo.drafters import ModelDrafter
from specdemo.engine import autoregressive, generated_ids, speculative
from specdemo.engine.loop import decode
from specdemo.engine.verify import (
    block_accept,
    block_thresholds,
    expected_accepted,
    rejection_accept,
)

V = 3  # tiny vocabulary: every draft block can be enumerated


def tables(seed: int, depth: int, vocab: int = V, alpha: float = 0.6, same: bool = False):
    """Random p and q for every prefix up to `depth` tokens (Dirichlet, so some are peaked): prefix -> (V,) float64.
    `same` makes q equal to p."""
    gen = torch.Generator().manual_seed(seed)
    dirichlet = torch.distributions.Dirichlet(torch.full((vocab,), alpha, dtype=torch.float64))
    p, q = {}, {}
    for n in range(depth + 1):
        for prefix in itertools.product(range(vocab), repeat=n):
            torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
            p[prefix] = dirichlet.sample()
            q[prefix] = p[prefix].clone() if same else dirichlet.sample()
    return p, q


def rows(prefix, block, p, q, deterministic=False):
    """(tokens (k,), q rows (k, V) or None, p rows (k+1, V)) for `block` drafted after `prefix`."""
    ctx = [tuple(prefix) + tuple(block[:i]) for i in range(len(block) + 1)]
    draft = None if deterministic else torch.stack([q[c] for c in ctx[:-1]])
    return torch.tensor(block), draft, torch.stack([p[c] for c in ctx])


def draft_blocks(prefix, k, q, stop=None):
    """Every block x ~ q with its probability; `stop(context)` ends a block early after at least one token, as a
    drafter's confidence gate does (the shipped EAGLE-3 head stops when the next peak of q is below its gate)."""
    def grow(block, weight):
        if len(block) == k or (block and stop is not None and stop(tuple(prefix) + block)):
            yield block, weight
            return
        ctx = tuple(prefix) + block
        for t in range(V):
            yield from grow(block + (t,), weight * float(q[ctx][t]))

    return list(grow((), 1.0))


def step_outcomes(prefix, k, p, q, drafts=None, stop=None) -> dict[tuple, float]:
    """Exact law of one block-verification step's output x_1..x_tau, y, from the algorithm's definition: the block
    x ~ q (or the deterministic drafter's `drafts(prefix)`), P(tau = i | x) = h_i prod_{j>i} (1 - h_j) with h_0 = 1
    (tau is the last i with eta_i <= h_i, the eta independent), y ~ norm(max(p_tau p - q, 0)), or p after a full
    block."""
    blocks = [(tuple(drafts(prefix)), 1.0)] if drafts else draft_blocks(prefix, k, q, stop)
    out: dict[tuple, float] = {}
    for block, weight in blocks:
        n = len(block)
        tokens, draft, target = rows(prefix, block, p, q, deterministic=drafts is not None)
        w, h = (t.double() for t in block_thresholds(tokens, draft, target))
        h = torch.cat([h.new_ones(1), h])  # h_0 = 1: tau = 0 when no eta passes
        for tau in range(n + 1):
            p_tau = float(h[tau] * torch.prod(1 - h[tau + 1 :]))
            if tau == n:
                y = target[n].double()
            else:
                qt = draft[tau].double() if draft is not None else torch.nn.functional.one_hot(tokens[tau], V).double()
                y = (w[tau] * target[tau].double() - qt).clamp(min=0)
                y = y / y.sum() if y.sum() > 0 else y
            for t in range(V):
                key = block[:tau] + (t,)
                out[key] = out.get(key, 0.0) + weight * p_tau * float(y[t])
    return out


def first_n(prefix, n, k, p, q, drafts=None, stop=None) -> dict[tuple, float]:
    """Exact law of the first n emitted tokens under repeated block-verification steps."""
    out: dict[tuple, float] = {}
    for seq, prob in step_outcomes(prefix, k, p, q, drafts, stop).items():
        if prob == 0:
            continue
        rest = {(): 1.0} if len(seq) >= n else first_n(tuple(prefix) + seq, n - len(seq), k, p, q, drafts, stop)
        for tail, pt in rest.items():
            key = (seq + tail)[:n]
            out[key] = out.get(key, 0.0) + prob * pt
    return out


def target_law(prefix, n, p) -> dict[tuple, float]:
    return {s: float(torch.prod(torch.stack([p[tuple(prefix) + s[:i]][s[i]] for i in range(n)])))
            for s in itertools.product(range(V), repeat=n)}


def tv(a: dict, b: dict) -> float:
    return 0.5 * sum(abs(a.get(s, 0.0) - b.get(s, 0.0)) for s in set(a) | set(b))


@pytest.mark.parametrize("seed,k", [(0, 2), (1, 2), (2, 3), (3, 3)])
def test_block_output_is_the_targets_law_exactly(seed, k):
    """Enumerating every draft block and every tau: the first token, pairs and triples follow p exactly (1e-9),
    and stand far from q's law."""
    p, q = tables(seed, depth=k + 3)
    for n in (1, 2, 3):
        exact = first_n((), n, k, p, q)
        assert tv(exact, target_law((), n, p)) < 1e-9
    assert tv(first_n((), 2, k, p, q), target_law((), 2, q)) > 0.1


def test_block_with_a_deterministic_drafter_is_exact():
    """q one-hot at whatever a deterministic drafter proposes (draft_probs None): still p's law exactly."""
    p, q = tables(5, depth=6)

    def drafts(prefix):  # a fixed, arbitrary proposal for every prefix
        return [(sum(prefix) + i) % V for i in range(3)]

    for n in (1, 2, 3):
        assert tv(first_n((), n, 3, p, q, drafts), target_law((), n, p)) < 1e-9


def test_block_with_a_confidence_gate_is_exact():
    """Blocks whose length depends on the drafted tokens (a gate on the next peak of q, as the shipped head's):
    still p's law exactly, and the gate does cut blocks here."""
    p, q = tables(4, depth=6)

    def gate(ctx):
        return float(q[ctx].max()) < 0.6

    assert len({len(b) for b, _ in draft_blocks((), 3, q, gate)}) >= 2
    for n in (1, 2, 3):
        assert tv(first_n((), n, 3, p, q, stop=gate), target_law((), n, p)) < 1e-9


def expected_lengths(k, p, q, prefix=()):
    """Each rule's expected accepted drafts over blocks x ~ q, by enumeration: token-wise from its own definition
    (sum_i P(x_1..x_i all pass min(1, p/q)) = sum_i sum_x prod_j min(p, q)), block from step_outcomes' law of tau."""
    token = 0.0
    for i in range(1, k + 1):
        for block in itertools.product(range(V), repeat=i):
            token += float(torch.prod(torch.stack([torch.minimum(p[prefix + block[:j]], q[prefix + block[:j]])[block[j]]
                                                   for j in range(i)])))
    block = sum((len(s) - 1) * prob for s, prob in step_outcomes(prefix, k, p, q).items())
    return token, block


def test_block_accepts_at_least_as_many_as_token_wise():
    """Sun et al.'s guarantee: block's expected accepted length is >= token-wise's for every p and q, strictly more
    for most random tables at k >= 2; expected_accepted (the per-block expectations the bench note uses) averages to
    the same numbers."""
    gains = []
    for seed in range(12):
        k = 2 + seed % 2
        p, q = tables(100 + seed, depth=k, alpha=0.3 + 0.2 * (seed % 3))
        token, block = expected_lengths(k, p, q)
        assert block >= token - 1e-12
        gains.append(block - token)
        per_block = [0.0, 0.0]
        for b in itertools.product(range(V), repeat=k):
            weight = float(torch.prod(torch.stack([q[b[:i]][b[i]] for i in range(k)])))
            e = expected_accepted(*rows((), b, p, q))
            per_block = [per_block[0] + weight * e["token"], per_block[1] + weight * e["block"]]
        assert per_block == pytest.approx([token, block], abs=1e-9)
    assert sum(g > 1e-6 for g in gains) >= 9


@pytest.mark.parametrize("case", ["k1", "p_equals_q"])
def test_block_equals_token_wise_where_the_theory_says(case):
    """k = 1: h_1 = p_1 = min(1, p/q), Alg. 2 is Alg. 1. p == q: both accept the whole block."""
    k, p, q = (1, *tables(7, depth=1)) if case == "k1" else (3, *tables(8, depth=3, same=True))
    token, block = expected_lengths(k, p, q)
    assert block == pytest.approx(token, abs=1e-12)
    if case == "p_equals_q":
        assert token == pytest.approx(3.0)


def test_tau_follows_its_law_through_block_accept():
    """For one fixed block, block_accept's accepted counts over seeded draws follow P(tau = i) = h_i prod_{j>i}
    (1 - h_j): the law the enumeration assumes."""
    p, q = tables(3, depth=3)
    tokens, draft, target = rows((), (0, 1, 2), p, q)
    _, h = block_thresholds(tokens, draft, target)
    h = torch.cat([h.new_ones(1), h])
    law = torch.tensor([float(h[i] * torch.prod(1 - h[i + 1 :])) for i in range(4)])
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    trials = 4000
    for _ in range(trials):
        counts[block_accept(tokens, draft.float(), target.float(), gen)[0]] += 1
    assert 0.5 * float((counts / trials - law).abs().sum()) < 0.03


def simulate(k, p, q, trials, seed, rule):
    """Seeded decoding with the tables: draft k tokens from q, verify with `rule`, until two tokens are emitted.
    -> (the law of the pair (V, V), the mean number of drafts the first step accepted)."""
    gen = torch.Generator().manual_seed(seed)
    pf, qf = {c: t.float() for c, t in p.items()}, {c: t.float() for c, t in q.items()}
    counts, first = torch.zeros(V, V), 0
    for _ in range(trials):
        out = ()
        while len(out) < 2:
            block = ()
            for _ in range(k):
                block += (int(torch.multinomial(qf[out + block], 1, generator=gen)),)
            tokens, draft, target = rows(out, block, pf, qf)
            n, y = rule(tokens, draft, target, gen)
            first += n if not out else 0
            out += block[:n] + (y,)
        counts[out[0], out[1]] += 1
    return counts / trials, first / trials


def test_sampled_pairs_through_block_accept_follow_the_target():
    """Seeded trials through block_accept itself: token pairs within a TV bound of p's law, far from q's; the mean
    accepted length of the first step matches the enumeration's, which is well above rejection_accept's."""
    k, (p, q) = 3, tables(14, depth=5)
    empirical, block_n = simulate(k, p, q, 2000, 0, block_accept)
    law, draft_law = target_law((), 2, p), target_law((), 2, q)
    as_dict = {(a, b): float(empirical[a, b]) for a in range(V) for b in range(V)}
    assert tv(as_dict, law) < 0.04
    assert tv(law, draft_law) > 0.4
    assert tv(as_dict, draft_law) > 0.35
    token, block = expected_lengths(k, p, q)
    assert block > token + 0.25
    assert block_n == pytest.approx(block, abs=0.08)
    _, token_n = simulate(k, p, q, 2000, 1, rejection_accept)
    assert token_n == pytest.approx(token, abs=0.08)


def test_unknown_verification_is_refused_with_its_choices():
    with pytest.raises(ValueError, match="token, block"):
        SamplingConfig(1.0, verification="tree").validate()


PROMPT = [3, 5, 7, 3, 5, 9, 2]


def test_greedy_ignores_the_rule(tiny_target, tiny_draft, tiny_tok):
    """At temperature 0 block is the greedy rule: the same tokens as autoregressive decoding, steps labelled greedy."""
    config = GenerationConfig(max_new_tokens=24, num_draft_tokens=4, sampling=SamplingConfig(verification="block"))
    events = list(speculative(tiny_target, tiny_tok, ModelDrafter(tiny_draft), PROMPT, config))
    assert generated_ids(events) == generated_ids(autoregressive(tiny_target, tiny_tok, PROMPT, config))
    assert {e.verification for e in events if e.kind == "spec"} == {"greedy"}


def _first_two(model, prompt):
    """Exact P(second new token) from one model, marginalizing the first (EOS included: ignore_eos runs on)."""
    with torch.inference_mode():
        p1 = torch.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1], -1)
        seqs = torch.tensor([prompt + [t] for t in range(p1.shape[0])])
        p2 = torch.softmax(model(input_ids=seqs).logits[:, -1], -1)  # (V, V)
    return (p1[:, None] * p2).sum(0)


@pytest.mark.parametrize("batch,samples,bound", [(1, 600, 0.1), (8, 1600, 0.07)])
def test_engine_block_sampling_follows_the_target(tiny_target, tiny_draft, tiny_tok, batch, samples, bound):
    """decode with block verification and k = 3, at B = 1 and B = 8 (each row its own generator): the second token
    (the first a verify step emits) follows the target's law within a TV bound, far from the draft's; every spec
    step says it was decided by block. The bounds sit above the 99.9th percentile of the TV of that many draws from
    16 tokens (about 0.056 at 2,000, scaling as 1 / sqrt(draws))."""
    expected, draft_law = _first_two(tiny_target, PROMPT), _first_two(tiny_draft, PROMPT)
    counts, rules = torch.zeros_like(expected), set()
    sampling = SamplingConfig(1.0, verification="block")
    for seed in range(0, samples, batch):
        config = GenerationConfig(max_new_tokens=5, num_draft_tokens=3, sampling=sampling, seed=seed, ignore_eos=True)
        out: list[list[int]] = [[] for _ in range(batch)]
        for e in decode(tiny_target, tiny_tok, [PROMPT] * batch, config, ModelDrafter(tiny_draft)):
            rules |= {s.verification for s in e.steps if s.kind == "spec"}
            for i, s in zip(e.rows, e.steps):
                out[i] += s.tokens
            if all(len(o) >= 2 for o in out):
                break
        for o in out:
            counts[o[1]] += 1
    empirical = counts / counts.sum()
    assert rules == {"block"}
    assert 0.5 * float((empirical - expected).abs().sum()) < bound
    assert 0.5 * float((draft_law - expected).abs().sum()) > 0.25
    assert 0.5 * float((empirical - draft_law).abs().sum()) > 0.2


def test_the_papers_motivating_example():
    """Sun et al.'s example: context-free p = (1/3, 2/3), q = (2/3, 1/3), k = 2: token-wise accepts 10/9 drafts per
    step in expectation, block verification 11/9."""
    law = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64)
    p = {c: law for n in range(3) for c in itertools.product(range(2), repeat=n)}
    q = {c: t.flip(0) for c, t in p.items()}
    token = block = 0.0
    for b in itertools.product(range(2), repeat=2):
        weight = float(q[()][b[0]] * q[b[:1]][b[1]])
        tokens, draft, target = torch.tensor(b), torch.stack([q[()], q[b[:1]]]), torch.stack([p[()], p[b[:1]], p[b]])
        e = expected_accepted(tokens, draft, target)
        token, block = token + weight * e["token"], block + weight * e["block"]
    assert (token, block) == (pytest.approx(10 / 9), pytest.approx(11 / 9))
