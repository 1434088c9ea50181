"""The plotly figures (specdemo.measure.charts) from plain numbers: what each trace holds and what each title says."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from specdemo.measure import charts
from specdemo.measure.tune_k import SweepPoint, summarize


def test_running_speedup_ends_at_the_tokens_per_second_ratio():
    """The last running-speedup value equals (sd tokens/s) / (ar tokens/s) of the whole runs."""
    ar = [(0.0, 0), (1.0, 10), (2.0, 20)]
    sd = [(0.0, 0), (0.5, 8), (1.0, 20)]
    points = charts.running_speedup_points(ar, sd)
    assert points[-1] == (2.0, pytest.approx((20 / 1.0) / (20 / 2.0)))
    for fig in (charts.tokens_vs_time(ar, sd), charts.running_speedup(ar, sd), charts.accepted_histogram([1, 2])):
        assert fig.data



def test_timeline_puts_each_pass_at_its_place_on_the_runs_clock():
    """AR passes and SD draft-then-verify bars start where the step before ended; prefill is its own trace; the
    title carries c and the verify cost."""
    ar = [(0.0, 0.0, 0.05), (0.05, 0.0, 0.01), (0.06, 0.0, 0.01)]
    sd = [(0.0, 0.0, 0.05), (0.05, 0.004, 0.012), (0.066, 0.004, 0.012)]
    fig = charts.timeline(ar, sd, c=0.4, verify_cost=1.2)
    by_name = {t.name: t for t in fig.data}
    assert set(by_name) == {"target pass (1 token)", "draft", "verify (k + 1 tokens)", "prefill"}
    assert list(by_name["target pass (1 token)"].base) == [0.05, 0.06]
    assert list(by_name["draft"].base) == [0.05, 0.066] and list(by_name["draft"].x) == [0.004, 0.004]
    assert list(by_name["verify (k + 1 tokens)"].base) == pytest.approx([0.054, 0.07])
    assert list(by_name["prefill"].x) == [0.05, 0.05]
    assert "c = 0.400" in fig.layout.title.text and "1.20× a 1-token pass" in fig.layout.title.text


def test_position_acceptance_shows_each_position_beside_alpha_to_the_i():
    """Bars for positions 1..k, the geometric alpha^i line, and c and the verify cost in the title."""
    fig = charts.position_acceptance([0.8, 0.6, 0.3], [10, 8, 5], alpha=0.7, c=0.05, verify_cost=1.1)
    bars, line = fig.data
    assert list(bars.x) == [1, 2, 3] and list(bars.y) == [0.8, 0.6, 0.3]
    assert list(bars.text) == ["of 10", "of 8", "of 5"]
    assert list(line.y) == pytest.approx([0.7, 0.49, 0.343])
    assert "c = 0.050" in fig.layout.title.text and "1.10×" in fig.layout.title.text
    assert len(charts.position_acceptance([], [], None, 0.0, 1.0).data) == 1


def test_k_sweep_shows_measured_points_beside_theory():
    """A Sweep from specdemo.measure.tune_k becomes a figure with measured speedup, the theory curve and acceptance."""
    points = [SweepPoint(k=k, ar_seconds=1.0, sd_seconds=1.0 / (1 + k / 10), ar_tokens=20, sd_tokens=20,
                         speedup=1 + k / 10, acceptance_rate=0.5, mean_accepted=1.5, mean_drafted=k, alpha=0.5,
                         c=0.01, verify_cost=1.0, expected_speedup=1.2, identical=True) for k in (1, 2, 3)]
    result = summarize(points, {p.k: p.verify_cost for p in points}, k_max=6)
    fig = charts.k_sweep([asdict(p) for p in points], sorted(result.theory.items()), result.best_measured_k,
                         result.best_k)
    assert {t.name for t in fig.data} == {"measured speedup", "theory (α, c)", "acceptance rate"}
