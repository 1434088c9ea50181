"""--tree auto sized by the run's own steps (engine.timing.StepCosts): the load-time pass costs corrected by what steps
of each verify width took beside steps of other widths (the ratios of neighbouring steps), and a run whose wide passes
cost far more than the load-time costs said stops drafting trees once it has timed them, with the target's greedy
output all along."""

import statistics
import time

import pytest
from test_tree_engine import FLAT, PROMPTS

from specdemo.config import GenerationConfig
from specdemo.drafters import NgramDrafter
from specdemo.engine import decode, row_outputs
from specdemo.engine.timing import StepCosts, step_costs


def timed(costs: StepCosts, seconds: dict[int, float], times: int = StepCosts.MIN_SAMPLES) -> StepCosts:
    """Each width's step taking its seconds, the widths in turn, `times` rounds."""
    for _ in range(times):
        for width, s in seconds.items():
            costs.add(width, s)
    return costs


def test_costs_are_the_prior_until_two_widths_are_timed_enough_beside_each_other():
    prior = {n: 1.0 + 0.1 * n for n in range(1, 9)}
    costs = StepCosts(prior)
    assert costs.costs() == prior
    timed(costs, {4: 0.05}, times=10)  # one width: nothing to compare it with
    timed(costs, {9: 0.09}, times=StepCosts.MIN_SAMPLES)  # another, after it: one ratio, the machine or the width?
    assert costs.costs() == prior
    timed(costs, {4: 0.05, 9: 0.09}, times=1)  # side by side: MIN_PAIRS ratios
    assert costs.costs()[8] / costs.costs()[3] == pytest.approx(0.09 / 0.05, abs=1e-3)


def test_measured_widths_take_the_measured_ratio_and_the_rest_follow_their_neighbours():
    """Widths 4 and 9 timed at 50 and 80 ms: 3 drafted tokens keep the prior's cost (the narrowest timed), 8 cost
    1.6x that; between them the correction is interpolated; beyond them a width costs at least the timed slope, or the
    prior's ratio to the widest timed where that is steeper."""
    prior = {n: 1.0 + 0.01 * n for n in range(1, 13)}  # a GPU's flat load-time costs
    out = timed(StepCosts(prior), {4: 0.050, 9: 0.080}).costs()
    assert out[3] == pytest.approx(prior[3], abs=1e-3)
    assert out[8] / out[3] == pytest.approx(0.080 / 0.050, abs=1e-3)
    assert out[1] == pytest.approx(prior[1], abs=1e-3) and out[2] == pytest.approx(prior[2], abs=1e-3)
    assert out[3] < out[5] < out[8]  # interpolated between the timed widths
    assert out[12] - out[8] == pytest.approx(4 * (out[8] - out[3]) / 5, abs=1e-3)  # at least the timed slope
    kinked = {n: 1.0 + 0.2 * n if n <= 8 else 2.6 + 0.5 * (n - 8) for n in range(1, 13)}  # steeper past 8
    assert timed(StepCosts(kinked), {4: 0.016, 9: 0.026}).costs() == pytest.approx(kinked, abs=1e-3)  # as the prior
    assert list(out.values()) == sorted(out.values())


def test_a_timed_one_token_step_makes_the_costs_wholly_measured_and_dips_are_pooled():
    prior = {n: 1.0 for n in range(1, 5)}
    out = timed(StepCosts(prior), {1: 0.010, 3: 0.020, 4: 0.018, 5: 0.030}).costs()
    assert out[2] == pytest.approx(1.9, abs=1e-3) and out[3] == pytest.approx(1.9, abs=1e-3)  # 2.0 and 1.8, pooled
    assert out[4] == pytest.approx(3.0, abs=1e-3) and out[1] == pytest.approx(1.45, abs=1e-3)  # between 1 and 1.9


def test_a_dear_width_timed_a_few_times_is_pooled_by_its_steps():
    """Widths timed in every step (5 and 12 drafted tokens, 44 and 50 ms) and one between them timed a few times at
    55 ms, between steps of the others: the dip is pooled by steps, 7 to 12 at 51 ms, where pooling them one for one
    put them at 52.5 (and so a rarely used width made every wider tree look as dear as the widest, what made --tree
    auto jump between the chain's width and its widest trees on the 2-core CPU, 2026-12-06)."""
    prior = {n: 1.0 for n in range(1, 13)}
    costs = timed(StepCosts(prior), {6: 0.044, 13: 0.050}, times=StepCosts.WINDOW)
    for _ in range(StepCosts.MIN_SAMPLES):
        timed(costs, {6: 0.044, 8: 0.055, 13: 0.050}, times=1)
    out = costs.costs()
    few, many = StepCosts.MIN_SAMPLES, StepCosts.WINDOW
    pooled = (0.055 * few + 0.050 * many) / (few + many)
    assert out[12] / out[5] == pytest.approx(pooled / 0.044, abs=1e-3)
    assert out[7] == out[12]


def test_the_machines_pace_prices_no_width():
    """Steps compare with their neighbours, not with every step of other widths: widths 6 and 13 timed side by side
    at 44 and 50 ms, then the machine 1.4x slower for a spell in which only width 8 (46 ms at the usual pace) and 13
    are timed, then back at its pace with only width 6. Width 8 is costed at its own cost between them, where each
    width's latest steps priced it as the spell (64 ms, above width 13)."""
    prior = {n: 1.0 for n in range(1, 13)}
    costs = timed(StepCosts(prior), {6: 0.044, 13: 0.050}, times=StepCosts.WINDOW)
    timed(costs, {8: 1.4 * 0.046, 13: 1.4 * 0.050})
    timed(costs, {6: 0.044}, times=StepCosts.WINDOW)
    out = costs.costs()
    assert out[7] / out[5] == pytest.approx(0.046 / 0.044, abs=1e-3)
    assert out[12] / out[5] == pytest.approx(0.050 / 0.044, abs=1e-3)


def test_the_window_follows_the_machine():
    """Only the last WINDOW ratios of a pair of widths count: a width that got dearer beside another is costed at
    its new cost."""
    costs = timed(StepCosts({n: 1.0 for n in range(1, 9)}), {4: 0.05, 9: 0.05})
    assert costs.costs()[8] == pytest.approx(1.0, abs=1e-3)
    timed(costs, {4: 0.05, 9: 0.10}, times=StepCosts.WINDOW)
    assert costs.costs()[8] == pytest.approx(2.0, abs=1e-3)


def test_a_drafters_runs_share_their_timings_and_a_new_prior_replaces_the_old():
    drafter, other = NgramDrafter(), NgramDrafter()
    first = step_costs(drafter, (1, 4, True), FLAT)
    assert step_costs(drafter, (1, 4, True), FLAT) is first and step_costs(other, (1, 4, True), FLAT) is not first
    assert step_costs(drafter, (4, 4, True), FLAT) is not first  # another batch size is another setting
    assert step_costs(drafter, (1, 4, True), {1: 2.0}).prior == {1: 2.0}


class Recording(NgramDrafter):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.costs = []

    def propose(self, request):
        self.costs.append(request.tree_costs)
        return super().propose(request)


def test_auto_stops_drafting_trees_once_it_has_timed_wide_passes_as_costly(tiny_tok):
    """A target whose passes cost 3 ms per token beyond the first, squared (a 9-token pass 192 ms, a 5-token one
    48 ms), behind flat load-time costs, asked for one answer twice (as a server is: its runs share their timings):
    prompt lookup drafts trees at first, and once the runs have timed the wider steps no branch pays for them, so the
    second answer's last steps verify chains; every request carried the costs it was sized by, and each answer is
    the target's own."""
    from conftest import WORDS, tiny_llama

    model = tiny_llama(len(WORDS) + 1, seed=1, sharpness=8.0)

    def slow(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[1] <= 17:  # the decode's passes, not the prefill
            time.sleep(0.003 * (ids.shape[1] - 1) ** 2)

    handle = model.register_forward_pre_hook(slow, with_kwargs=True)
    try:
        config = GenerationConfig(max_new_tokens=64, num_draft_tokens=4)
        drafter = Recording(pass_costs=FLAT)
        runs = [list(decode(model, tiny_tok, PROMPTS[:1], config, drafter)) for _ in range(2)]
    finally:
        handle.remove()
    plain = list(decode(model, tiny_tok, PROMPTS[:1], GenerationConfig(max_new_tokens=64)))
    assert all(row_outputs(events, 1) == row_outputs(plain, 1) for events in runs)
    first, last = ([e.steps[0] for e in events if e.kind == "spec" and e.steps[0].drafted] for events in runs)
    assert drafter.costs[0] == FLAT and all(c is not None for c in drafter.costs)
    learned = drafter.costs[-1]
    # (4/2)^2 = 4 by the sleeps; 8 drafted tokens may be priced from the line through narrower widths once trees
    # stop reaching them (a CI run timed widths 4 and 5 at 1.12x apart, and 8 extrapolated to 1.42x of 4)
    assert learned[4] / learned[2] > 2.0 and learned[8] > learned[4], learned
    assert any(s.parents is not None for s in first[:10])  # flat costs: branches pay
    assert not any(s.parents is not None for s in last[-5:]), [len(s.drafted) for s in last]


def test_reports_give_the_steps_by_width_and_the_costs_auto_sized_by(tiny_target, tiny_tok):
    """A run's steps by verify width (metrics.step_ms_by_width) agree with the steps the drafter's StepCosts keeps,
    and the bench's tree report under auto gives the costs it sized trees by at the end."""
    from specdemo.engine.loop import auto_costs
    from specdemo.measure.bench.run import tree_report
    from specdemo.measure.metrics import step_ms_by_width

    drafter = NgramDrafter(pass_costs=FLAT)
    config = GenerationConfig(max_new_tokens=48, num_draft_tokens=4)
    steps = [e.steps[0] for e in decode(tiny_target, tiny_tok, PROMPTS[:1], config, drafter)]
    by_width = step_ms_by_width(steps)
    assert sum(n for n, _ in by_width.values()) == sum(s.kind == "spec" for s in steps)
    costs = auto_costs(drafter, 1, config)
    measured = {w: statistics.median(s) for w, s in costs.seconds.items() if w > 1 and len(s) >= costs.MIN_SAMPLES}
    assert measured, by_width
    for w, seconds in measured.items():
        assert by_width[w][0] >= StepCosts.MIN_SAMPLES and by_width[w][1] == pytest.approx(1e3 * seconds, abs=0.01)
    rows = [{"tree": "auto", "tree_steps": 3, "steps": 20}]
    report = tree_report(config, drafter, rows, "--tree")
    assert report["sized_by"] == {str(n): c for n, c in costs.costs().items()}
    assert report["tree_steps"] == 3 and report["drafted_steps"] == 20
    assert "sized_by" not in tree_report(GenerationConfig(tree="8"), drafter, [], "--tree")


def test_off_chain_values_and_what_the_accepted_path_took_there():
    from specdemo.engine.tree import TokenTree

    tree = TokenTree((5, 6, 7, 8, 9), (-1, 0, -1, 2, 1))  # chain 0 -> 1 -> 4; branches 2 -> 3
    values = [0.8, 0.6, 0.1, 0.05, 0.5]
    assert tree.off_chain(values, [0, 1, 4]) == (pytest.approx(0.15), 0)  # all along the chain
    assert tree.off_chain(values, [2, 3]) == (pytest.approx(0.15), 2)  # both from the branch
    assert tree.off_chain(values, []) == (pytest.approx(0.15), 0)


def test_the_extra_scale_is_what_branches_gave_over_their_values():
    costs = StepCosts(FLAT)
    costs.add_extras(1.0, 1)
    assert costs.extra_scale() == 1.0  # valued at 1 token so far: too little to say
    for _ in range(9):
        costs.add_extras(1.0, 0)
    assert costs.extra_scale() == pytest.approx(0.1)
    many = StepCosts(FLAT)
    for _ in range(10):
        many.add_extras(0.5, 2)
    assert many.extra_scale() == 2.0  # capped


def test_a_low_extra_scale_keeps_fewer_branches():
    """branch_out under the same costs: branches valued as drafted pay for the wider pass; weighed by what such
    branches gave (a tenth), none does."""
    from specdemo.drafters.trees import branch_out
    from specdemo.engine.tree import TokenTree

    tree = TokenTree((1, 2, 3, 4, 5), (-1, 0, -1, -1, 2))
    values = [0.9, 0.8, 0.5, 0.4, 0.3]
    costs = {n: 1.0 + 0.05 * n for n in range(1, 9)}
    assert len(branch_out(tree, values, costs, 8, 2)[0]) == 5
    assert len(branch_out(tree, values, costs, 8, 2, scale=0.1)[0]) == 2


@pytest.mark.parametrize("kind", ["ngram", "suffix", "hybrid", "hybrid-suffix"])
def test_tree_drafters_value_their_nodes_and_runs_learn_the_scale(kind, tiny_target, tiny_draft, tiny_tok):
    """Every tree drafter's trees carry each node's value (Proposal.values); a run under auto records what its
    branches gave against those values and asks its next drafts with that scale."""
    from test_tree_engine import make

    from specdemo.engine.loop import auto_costs

    drafter = make(kind, tiny_draft)
    seen = []
    propose = drafter.propose

    def recording(request):
        out = propose(request)
        seen.append((request.tree_extra_scale, out))
        return out

    drafter.propose = recording
    config = GenerationConfig(max_new_tokens=40, num_draft_tokens=4)
    events = list(decode(tiny_target, tiny_tok, PROMPTS, config, drafter))
    assert row_outputs(events, 4) == row_outputs(list(decode(tiny_target, tiny_tok, PROMPTS, config)), 4)
    trees = [p for _, out in seen for p in out if p.parents is not None]
    assert trees and all(p.values is not None and len(p.values) == len(p.tokens) for p in trees)
    costs = auto_costs(drafter, 4, config)
    assert costs.extras and seen[0][0] == 1.0 and seen[-1][0] != 1.0
    assert seen[-1][0] == pytest.approx(costs.extra_scale(), abs=0.05)  # all but the last step's branches
