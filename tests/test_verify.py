"""Acceptance rules: exact verdicts from extreme logits, and the rejection sampler's output distribution."""

import pytest
import torch

from specdemo.config import SamplingConfig
from specdemo.verify import generator_on, greedy_accept, logits_to_probs, rejection_accept

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


def test_rejection_sampling_matches_target_distribution():
    """Over many seeded trials the first emitted token follows p, not q (Leviathan et al., Thm 3.5)."""
    p = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    q = torch.tensor([0.5, 0.05, 0.3, 0.05, 0.1])
    assert tv(p, q) > 0.4
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(5)
    trials = 20000
    for _ in range(trials):
        x = int(torch.multinomial(q, 1, generator=gen))
        _, nxt = rejection_accept(torch.tensor([x]), q[None], torch.stack([p, p]), gen)
        first = x if _ == 1 else nxt
        counts[first] += 1
    empirical = counts / trials
    assert tv(empirical, p) < 0.02
    assert tv(empirical, q) > 0.35


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
