"""Acceptance rules: exact verdicts from extreme logits, and the rejection sampler's output distribution."""

import pytest
import torch

from specdemo.config import SamplingConfig
from specdemo.engine.verify import (
    ROW_RULES,
    block_accept,
    generator_on,
    greedy_accept,
    logits_to_probs,
    rejection_accept,
    sample_rows,
)

NEG = float("-inf")


def onehot_logits(tokens: list[int], vocab: int = 6) -> torch.Tensor:
    logits = torch.full((len(tokens), vocab), NEG)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 10.0
    return logits


def test_greedy_accepts_prefix_and_returns_correction():
    """Drafts are kept up to the first disagreement, which is replaced by the target's argmax."""
    draft = torch.tensor([1, 2, 3])
    n, nxt = greedy_accept(draft, onehot_logits([1, 2, 5, 4]))
    assert (n, nxt) == (2, 5)


def test_greedy_full_acceptance_gives_bonus():
    """All drafts agree: the bonus token is the target's argmax after the last draft."""
    n, nxt = greedy_accept(torch.tensor([1, 2]), onehot_logits([1, 2, 4]))
    assert (n, nxt) == (2, 4)


def test_greedy_with_no_drafts_is_a_plain_step():
    n, nxt = greedy_accept(torch.tensor([], dtype=torch.long), onehot_logits([3]))
    assert (n, nxt) == (0, 3)


def test_rejection_rejects_token_the_target_never_picks():
    """p(x) = 0 rejects x whatever the draw; the correction comes from norm(max(0, p - q)), i.e. the target."""
    target_probs = torch.softmax(onehot_logits([4, 4]), -1)
    draft_probs = torch.softmax(onehot_logits([1]), -1)
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        assert rejection_accept(torch.tensor([1]), draft_probs, target_probs, gen) == (0, 4)


def test_rejection_accepts_when_target_is_certain():
    """p(x) = 1 always accepts; the bonus comes from the last target row."""
    target_probs = torch.softmax(onehot_logits([1, 2, 3]), -1)
    draft_probs = torch.full((2, 6), 1 / 6)
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        assert rejection_accept(torch.tensor([1, 2]), draft_probs, target_probs, gen) == (2, 3)


def test_deterministic_drafter_rejection_excludes_the_drafted_token():
    """With q one-hot (prompt lookup), a rejected token can never be resampled as the correction."""
    target_probs = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])
    seen = set()
    for seed in range(200):
        gen = torch.Generator().manual_seed(seed)
        n, nxt = rejection_accept(torch.tensor([1]), None, target_probs, gen)
        if n == 0:
            seen.add(nxt)
    assert seen == {2}


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


class _FixedDraw:
    """Stands in for `torch` inside specdemo.engine.verify: every `torch.rand` returns the draw `r`; all else is
    torch."""

    def __init__(self, r: float = 0.0):
        self.r = r

    def __getattr__(self, name):
        return getattr(torch, name)

    def rand(self, size, generator=None, device=None):
        return torch.full((size,), self.r, device=device)


def _exact_first_token(monkeypatch, p: torch.Tensor, q: torch.Tensor | None, x: int) -> torch.Tensor:
    """The exact distribution of the first emitted token when `x` is drafted, from rejection_accept's own branches.

    torch.rand is fixed to a chosen r and verify.sample_rows returns a marker while recording the distribution it was
    asked to sample, so each call takes one branch deterministically. The acceptance probability is the measure of the
    r in [0, 1) that rejection_accept accepts: the code is bisected for its threshold (checked to be one interval
    [0, a) on a grid), so a wrong comparison shows up as a wrong weight rather than being re-derived here."""
    import specdemo.engine.verify as verify

    draw, asked = _FixedDraw(), []

    def recording_sample(probs, generators):
        assert len(probs) == len(generators) == 1
        asked.append(probs[0].clone())
        return torch.tensor([-1])

    monkeypatch.setattr(verify, "torch", draw)
    monkeypatch.setattr(verify, "sample_rows", recording_sample)
    target = torch.stack([p, p])  # row 1 gives the bonus token after an acceptance
    draft = None if q is None else q[None]

    def call(r):
        draw.r, asked[:] = r, []
        n, nxt = rejection_accept(torch.tensor([x]), draft, target, None)
        assert nxt == -1 and len(asked) == 1  # the next token is always one sample
        return n, asked[0]

    if call(0.0)[0] == 0:  # even r = 0 rejects: only p(x) = 0 may do that
        accept = 0.0
    elif call(torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)).item())[0] == 1:
        accept = 1.0
    else:
        lo, hi = 0.0, 1.0  # accepts at lo, rejects at hi
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if call(mid)[0] == 1 else (lo, mid)
        accept = hi
    for i in range(64):  # the accepted draws form the one interval [0, accept)
        r = (i + 0.5) / 64
        if abs(r - accept) > 1e-6:
            assert call(r)[0] == (1 if r < accept else 0)
    out = torch.zeros_like(p, dtype=torch.float64)
    if accept > 0:
        n, bonus = call(0.0)
        # accepted: x is emitted, then the bonus comes from p
        assert n == 1 and torch.allclose(bonus.double(), p.double(), rtol=0, atol=1e-7)
        out[x] += accept
    if accept < 1:
        n, residual = call((accept + 1) / 2)
        assert n == 0  # rejected: the first token is the correction, drawn from the distribution sample() was given
        out += (1 - accept) * residual.double()
    return out


def test_rejection_sampling_matches_target_distribution(monkeypatch):
    """The first emitted token follows p exactly, not q (Leviathan et al., Thm 3.5): the draft token x ~ q is
    enumerated with weight q[x], and for each x rejection_accept's accept and reject branches are taken
    deterministically and weighted exactly (see _exact_first_token). The same holds for a deterministic drafter
    (q one-hot at whatever x it drafts)."""
    p = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    q = torch.tensor([0.5, 0.05, 0.3, 0.05, 0.1])
    assert tv(p, q) > 0.4
    exact = sum(float(q[x]) * _exact_first_token(monkeypatch, p, q, x) for x in range(5))
    assert tv(exact, p.double()) < 1e-6
    assert tv(exact, q.double()) > 0.35
    for x in range(5):  # deterministic drafter: p exactly, whichever token it drafts
        assert tv(_exact_first_token(monkeypatch, p, None, x), p.double()) < 1e-6


def test_top_k_and_top_p_filter_identically():
    """Filters keep the most likely tokens; mass outside them is zero."""
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_p=0.7))
    assert torch.allclose(probs, torch.tensor([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]))
    probs = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_k=1))
    assert torch.equal(probs, torch.tensor([1.0, 0.0, 0.0, 0.0]))
    cold = logits_to_probs(logits, SamplingConfig(temperature=0.1))
    assert cold[0] > 0.99


def test_generator_on_keeps_a_generator_on_its_own_device():
    gen = torch.Generator().manual_seed(3)
    assert generator_on(gen, "cpu") is gen
    assert generator_on(None, "cpu") is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device type (the GPU check runs it)")
def test_generator_on_another_device_is_seeded_from_the_run():
    """A draft on the GPU beside a CPU engine (or the reverse) samples from a generator derived from the run's seed:
    the same seed gives the same draws, another seed other draws."""
    def draws(seed):
        own = generator_on(torch.Generator().manual_seed(seed), "cuda:0")
        assert own.device == torch.device("cuda:0")
        return torch.rand(8, generator=own, device="cuda:0").tolist()
    assert draws(1) == draws(1)
    assert draws(1) != draws(2)
    back = generator_on(torch.Generator(device="cuda:0").manual_seed(1), "cpu")  # the CUDA generator seeds a CPU one
    assert back.device == torch.device("cpu")


def test_sample_rows_draws_what_multinomial_draws():
    """sample_rows (no host read) gives, row for row, the token torch.multinomial(p, 1) gives from the same
    generator state."""
    probs = torch.softmax(torch.randn(5, 300, generator=torch.Generator().manual_seed(0)), -1)
    for seed in range(20):
        gens = [torch.Generator().manual_seed(seed * 10 + r) for r in range(5)]
        ours = sample_rows(probs, gens).tolist()
        gens = [torch.Generator().manual_seed(seed * 10 + r) for r in range(5)]
        assert ours == [int(torch.multinomial(p, 1, generator=g)) for p, g in zip(probs, gens)]


@pytest.mark.parametrize("rule", ["token", "block"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_the_batched_rule_is_the_one_row_rule_in_every_row(deterministic, rule):
    """Each rule's batched form (verify.ROW_RULES) over a ragged batch (lengths 0..4, padding past them) decides
    every row as the one-row rule (rejection_accept, block_accept) decides it alone, from the same generator state:
    the batch changes nothing but the reads. (The one-row rules are the batched ones at one row; their exactness is
    test_block's and test_rejection_sampling_matches_target_distribution's.)"""
    rows_rule, alone_rule = ROW_RULES[rule], {"token": rejection_accept, "block": block_accept}[rule]
    g = torch.Generator().manual_seed(1)
    rows, k, vocab = 6, 4, 7
    p = torch.softmax(torch.randn(rows, k + 1, vocab, generator=g) * 2, -1)
    q = None if deterministic else torch.softmax(torch.randn(rows, k, vocab, generator=g) * 2, -1)
    lengths = [0, 1, 2, 3, 4, 4]
    for seed in range(30):
        drafted = torch.randint(vocab, (rows, k), generator=g)
        drafted[:, :2] = p[:, :2].argmax(-1)  # some rows accept a while
        gens = [torch.Generator().manual_seed(seed * 100 + r) for r in range(rows)]
        accepted, nxt = rows_rule(drafted, torch.tensor(lengths), q, p, gens, lengths)
        alone = []
        for r, n in enumerate(lengths):
            gen = torch.Generator().manual_seed(seed * 100 + r)
            alone.append(alone_rule(drafted[r, :n], None if q is None else q[r, :n], p[r, : n + 1], gen))
        assert list(zip(accepted.tolist(), nxt.tolist())) == alone
