"""Metrics from step events, named exactly, and the theory of Leviathan et al. 2023."""

import pytest

from specdemo.engine import StepEvent
from specdemo.measure.metrics import (
    alpha_from_mean_accepted,
    best_k,
    expected_speedup,
    expected_tokens,
    run_stats,
    speedup,
)


def spec(drafted, accepted, elapsed, generated, k):
    """A speculative step: `drafted` tokens proposed, the first `accepted` kept, plus one target token."""
    tokens = drafted[:accepted] + [99]
    return StepEvent("spec", tokens, "", elapsed, generated, drafted=drafted, num_accepted=accepted,
                     correction=None if accepted == len(drafted) else 99,
                     bonus=99 if accepted == len(drafted) else None, draft_seconds=0.1, verify_seconds=0.2, k=k)


def test_run_stats_counts_the_bonus_in_mean_accepted_and_not_in_acceptance():
    """Mean accepted length is tokens per target pass with the bonus/correction token; acceptance is accepted drafts
    over drafted tokens; the prefill's token counts in tokens/s but in no per-step figure."""
    events = [StepEvent("prefill", [5], "", 0.5, 1, verify_seconds=0.5),
              spec([1, 2, 3], 3, 1.0, 5, 3),  # all accepted: 3 drafts + bonus
              spec([1, 2, 3], 1, 1.5, 7, 3),  # 1 accepted + correction
              spec([1, 2], 0, 2.0, 8, 3)]     # none accepted + correction (a proposal shorter than k)
    s = run_stats(events)
    assert (s.tokens, s.seconds, s.tokens_per_s) == (8, 2.0, 4.0)
    assert (s.steps, s.drafted, s.accepted) == (3, 8, 4)
    assert s.acceptance_rate == pytest.approx(4 / 8)
    assert s.mean_accepted == pytest.approx((4 + 2 + 1) / 3)
    assert s.per_position_acceptance == pytest.approx([2 / 3, 1 / 3, 1 / 2])  # position 3 was drafted twice
    assert s.accepted_histogram == [1, 1, 0, 1]
    assert (s.draft_seconds, s.verify_seconds) == pytest.approx((0.3, 0.6))


def test_run_stats_of_nothing_and_of_plain_decoding():
    assert run_stats([]).tokens == 0
    ar = run_stats([StepEvent("prefill", [1], "", 0.1, 1), StepEvent("ar", [2], "", 0.2, 2)])
    assert (ar.tokens_per_s, ar.steps, ar.mean_accepted, ar.accepted_histogram) == (10.0, 0, 0.0, [])


def test_speedup_is_the_tokens_per_second_ratio():
    ar = run_stats([StepEvent("prefill", [1], "", 1.0, 1), StepEvent("ar", [2], "", 2.0, 2)])
    sd = run_stats([StepEvent("prefill", [1], "", 0.5, 1), spec([2], 1, 1.0, 3, 1)])
    assert speedup(ar, sd) == pytest.approx(3.0 / 1.0)
    assert speedup(run_stats([]), sd) == 0.0


def test_expected_tokens_and_speedup_follow_the_paper():
    """E[tokens] = (1 - a^(k+1)) / (1 - a); speedup = E[tokens] / (k c + verify cost)."""
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_speedup(0.5, 0.1, 2) == pytest.approx(1.75 / 1.2)
    assert expected_speedup(0.5, 0.1, 2, verify_cost=1.3) == pytest.approx(1.75 / 1.5)


def test_alpha_inverts_expected_tokens_and_clamps():
    for alpha in (0.1, 0.5, 0.9):
        assert alpha_from_mean_accepted(expected_tokens(alpha, 4), 4) == pytest.approx(alpha, abs=1e-9)
    assert alpha_from_mean_accepted(0.5, 4) == pytest.approx(0.0, abs=1e-9)  # below one token per pass
    assert alpha_from_mean_accepted(9.0, 4) == pytest.approx(1.0, abs=1e-6)  # above k + 1


def test_best_k_weighs_wider_verify_passes():
    """Free verify passes and a cheap draft favour a long k; passes that grow with width pull it down."""
    assert best_k(0.9, 0.01, 16) > 8
    growing = {k: 1.0 + 0.15 * k for k in range(1, 17)}
    assert best_k(0.9, 0.01, 16, growing) < best_k(0.9, 0.01, 16)
    assert best_k(0.3, 0.2, 16) == 1


def test_a_trees_draft_positions_are_its_depths():
    """Per-position acceptance and the accepted histogram count a tree step by depth: nodes at one depth are one
    position (the node indices of a 5-node tree are not 5 positions)."""
    from specdemo.measure.metrics import draft_depth, run_stats

    tree = StepEvent("spec", [4, 6, 9], "", 1.0, 3, drafted=[4, 5, 6, 7, 8], num_accepted=2,
                     parents=[-1, 0, -1, 2, 3], accepted_path=[2, 3])
    chain = StepEvent("spec", [4, 9], "", 2.0, 5, drafted=[4, 5], num_accepted=1)
    assert draft_depth(tree) == 3 and draft_depth(chain) == 2
    stats = run_stats([tree, chain])
    assert stats.per_position_acceptance == [1.0, 0.5, 0.0]  # depth 1: both; depth 2: the tree; depth 3: none
    assert stats.accepted_histogram == [0, 1, 1, 0]
