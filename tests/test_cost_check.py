"""The pass-cost check on the real bundled model: a run's passes against those calibrated for its pair and k. It
stays quiet on a machine as it was at calibration and fires under a CPU hog that this test starts (and bounds)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specdemo.app.compute import compute
from specdemo.app.race import AppLimits, make_request
from specdemo.app.summary import drift_warning
from specdemo.app.ui import EXAMPLES
from specdemo.config import Runtime
from specdemo.measure.metrics import BUSY_RATIO, PassCosts, cost_drift

REWRITE = next(p for c, p in EXAMPLES if c == "rewrite")
HOG = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


def test_cost_drift_names_the_passes_beyond_the_ratio_either_way_and_skips_tiny_drafts():
    """Exact verdicts from made-up medians: 1.6x slower and 1.6x faster both count, 1.4x does not; a draft under 5%
    of a target pass (prompt lookup, the head on a CPU) is never judged, nor a hybrid's; a missing median is skipped."""
    was = PassCosts(target_pass=0.030, verify_pass=0.040, draft_token=0.003)
    assert cost_drift(was, PassCosts(0.030 * 1.4, 0.040 / 1.4, 0.003)) == {}
    assert cost_drift(was, PassCosts(0.030 * 1.6, 0.040 / 1.6, 0.003 * 3)) == {
        "target_pass": 1.6, "verify_pass": 0.62, "draft_token": 3.0}
    lookup = PassCosts(0.030, 0.040, 0.0001)
    assert cost_drift(lookup, PassCosts(0.030, 0.040, 0.0009)) == {}
    head = PassCosts(0.030, 0.040, 0.0007)  # the head's drafted token on a CPU, about 2% of a pass
    assert cost_drift(head, PassCosts(0.030, 0.040, 0.00116)) == {}
    assert cost_drift(was, PassCosts(None, 0.040, None)) == {}
    assert cost_drift(was, PassCosts(0.030, 0.040, 0.0001), judge_draft=False) == {}  # a hybrid's mix of drafts
    assert BUSY_RATIO == 1.5


def run(request, recalibrate: bool = False) -> dict:
    items = list(compute(request, AppLimits(max_new_tokens=64), Runtime(), recalibrate))
    return items[-1]


@pytest.mark.slow
@pytest.mark.timed
def test_the_check_stays_quiet_on_a_quiet_machine_and_fires_under_a_cpu_hog():
    """Calibrated, then run on the same quiet machine: no drift (one recalibration allowed). Then three busy
    processes (at most 90 s, killed at the end) take the two cores during a run: its target passes take well over
    1.5x their calibrated time, the result says so and the status line's warning offers Re-measure."""
    request = make_request(REWRITE, "smollm2-135m", "model", "", 2, False, 0.0, 1.0, 24, AppLimits(max_new_tokens=64))
    for _ in range(2):  # a shared machine's passing spell during the calibration is not what this test is about
        quiet = run(request, recalibrate=True)
        if quiet["pass_costs"]["drift"] == {}:
            break
    assert quiet["identical"] and quiet["pass_costs"]["drift"] == {}, quiet["pass_costs"]
    assert drift_warning(quiet) == ""
    hogs = [subprocess.Popen([sys.executable, "-c", HOG.format(seconds=90)]) for _ in range(3)]
    try:
        busy = run(request)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    drift = busy["pass_costs"]["drift"]
    assert busy["identical"] and drift.get("target_pass", 0) > BUSY_RATIO, busy["pass_costs"]
    assert busy["pass_costs"]["calibrated"] == quiet["pass_costs"]["calibrated"]  # the same calibration
    assert "Re-measure" in drift_warning(busy)
