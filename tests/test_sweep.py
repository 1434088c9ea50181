"""The k sweep on tiny random llamas: pooled figures, the theory curve and its best k."""

import pytest
import torch

from specdemo.config import GenerationConfig
from specdemo.drafters import ModelDrafter, NgramDrafter
from specdemo.measure.compare import Pair
from specdemo.measure.metrics import best_k, expected_speedup
from specdemo.measure.tune_k import SweepPoint, point, summarize, sweep
from specdemo.models.loading import LoadedModel

PROMPTS = ["w3 w5 w7 w3 w5 w9 w2", "w1 w2 w3 w4 w1 w2 w3"]


def tiny_pair(model, tok, drafter, kind="model") -> Pair:
    return Pair(LoadedModel("tiny", model, tok, torch.device("cpu"), torch.float32, "folder"), drafter, kind, "tiny")


def fake_point(k: int, speedup: float, alpha: float, c: float = 0.1, tokens: int = 100, mean_accepted: float = 2.0):
    return SweepPoint(k, 1.0, 1.0 / speedup, tokens, tokens, speedup, alpha, mean_accepted, k, alpha, c, 1.0,
                      expected_speedup(alpha, c, k), True)


def test_sweep_best_k_agrees_with_metrics(tiny_target, tiny_draft, tiny_tok):
    """The sweep's best k is metrics.best_k at its pooled alpha, c and measured verify costs."""
    pair = tiny_pair(tiny_target, tiny_tok, ModelDrafter(tiny_draft))
    result = sweep(pair, PROMPTS, ks=[1, 2, 4], config=GenerationConfig(max_new_tokens=12), k_max=6)
    assert [p.k for p in result.points] == [1, 2, 4]
    assert sorted(result.verify_costs) == list(range(1, 7))
    assert result.best_k == best_k(result.alpha, result.c, 6, result.verify_costs)
    assert max(result.theory, key=result.theory.get) == result.best_k
    assert 0.0 <= result.alpha <= 1.0 and result.c > 0


def test_sweep_points_are_lossless_and_counted(tiny_target, tiny_tok):
    """Greedy prompt lookup at every k reproduces the autoregressive tokens; counts and rates are consistent."""
    pair = tiny_pair(tiny_target, tiny_tok, NgramDrafter(), "ngram")
    config = GenerationConfig(max_new_tokens=16)
    result = sweep(pair, PROMPTS, ks=[1, 3], config=config, measure_verify_costs=False)
    for p in result.points:
        assert p.identical
        assert p.ar_tokens == p.sd_tokens == 16 * len(PROMPTS)
        assert p.speedup == pytest.approx(p.ar_seconds / p.sd_seconds)
        assert 0.0 <= p.acceptance_rate <= 1.0 and 1.0 <= p.mean_accepted <= p.k + 1
        assert p.c == 0.0 or p.c < 1.0  # prompt lookup is nearly free next to a target pass
    assert result.verify_costs == {}
    assert result.best_k == best_k(result.alpha, result.c, 16)


def test_summarize_pools_alpha_by_verify_steps():
    """Points with more verify steps weigh more in the pooled alpha; the measured best k is the fastest point."""
    points = [fake_point(1, 1.2, 0.2, tokens=300, mean_accepted=1.5),  # 200 steps
              fake_point(4, 1.5, 0.8, tokens=100, mean_accepted=2.0)]  # 50 steps
    s = summarize(points, {}, k_max=8)
    assert s.alpha == pytest.approx((200 * 0.2 + 50 * 0.8) / 250)
    assert s.best_measured_k == 4
    assert s.best_k == best_k(s.alpha, s.c, 8)
    assert set(s.as_dict()["theory"]) == {str(k) for k in range(1, 9)}


def test_point_speedup_is_total_time_ratio(tiny_target, tiny_tok):
    """A point's speedup is total autoregressive seconds over total speculative seconds."""
    from specdemo.measure.tune_k import run_ar, run_sd

    pair = tiny_pair(tiny_target, tiny_tok, NgramDrafter(), "ngram")
    config = GenerationConfig(max_new_tokens=8, num_draft_tokens=2)
    ids = [[3, 5, 7, 3, 5, 9, 2], [1, 2, 3, 1, 2, 3]]
    ar = [run_ar(pair, p, config) for p in ids]
    sd = [run_sd(pair, p, config) for p in ids]
    p = point(2, ar, sd)
    assert p.speedup == pytest.approx(sum(r.wall_seconds for r in ar) / sum(r.wall_seconds for r in sd))


