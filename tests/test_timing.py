"""The clocks: the decoders' compute clock, forward hooks, and the pass-cost micro-benchmark."""

import pytest
import torch

from specdemo.engine import timing
from specdemo.engine.timing import Clock, ForwardTimer, forward_costs, verify_costs_for
from specdemo.measure.bench.timing import target_modules


def test_forward_costs_are_relative_to_one_token(tiny_target):
    """forward_costs reports 1.0 for width 1 and leaves the cache usable (positive ratios for every width)."""
    costs = forward_costs(tiny_target, [[3, 5, 7, 3]], [2, 5], repeats=1)
    assert costs[1] == 1.0 and set(costs) == {1, 2, 5}
    assert all(v > 0 for v in costs.values())


def test_forward_costs_survive_a_slow_spell(tiny_target, monkeypatch):
    """The widths take turns, so a slow spell (here the first four passes after the prompt, 50 ms each) costs every
    width one pass, not all the passes of the width measured first: timed one width after the other, the 1-token
    passes all fell in it and the wider ones came out 'cheaper' than one token, as a noisy hybrid load once did.
    The clock is simulated (a w-token pass takes 10 + w ms), so the figures are exact whatever the machine does."""
    clock = [0.0]
    calls = []
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])

    def simulated_pass(module, args, kwargs):
        calls.append(1)
        width = kwargs["input_ids"].shape[1]
        clock[0] += 0.010 + 0.001 * width + (0.050 if 2 <= len(calls) <= 5 else 0.0)  # call 1 fills the cache

    handle = tiny_target.register_forward_pre_hook(simulated_pass, with_kwargs=True)
    try:
        costs = forward_costs(tiny_target, [[3, 5, 7, 3]], [2, 3], repeats=3)
    finally:
        handle.remove()
    assert len(calls) == 1 + 4 * 3  # the prompt, then a warm-up round and 3 rounds of widths 1, 2, 3
    assert costs == pytest.approx({1: 1.0, 2: 12 / 11, 3: 13 / 11})  # the spell fell in the uncounted warm-up


def test_forward_timer_counts_nested_calls_once(tiny_target):
    """A CausalLM call runs its base model and head inside; the timer counts one call."""
    timer = ForwardTimer(target_modules(tiny_target))
    try:
        with torch.inference_mode():
            tiny_target(input_ids=torch.tensor([[1, 2, 3]]))
            tiny_target.model(input_ids=torch.tensor([[1, 2, 3]]))
    finally:
        timer.remove()
    assert timer.calls == 2 and timer.seconds > 0
    tiny_target(input_ids=torch.tensor([[1]]))
    assert timer.calls == 2  # hooks removed


def test_clock_counts_only_between_start_and_stop(monkeypatch):
    """The decoders' clock adds up start..stop spans; time outside them (a consumer at a `yield`) is not counted."""
    readings = iter([10.0, 10.5, 99.0, 99.25])  # start, stop, (a long pause), start, stop
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(readings))
    clock = Clock(torch.device("cpu"))
    clock.start()
    assert clock.stop() == 0.5
    clock.start()
    assert clock.stop() == 0.25
    assert clock.total == 0.75


def test_a_split_times_the_first_phase_without_waiting_for_the_device(monkeypatch):
    """split() marks where a step's drafting ends: stop() gives the whole step and `first` the part before the mark,
    and the device is waited for at start and stop only (a step's read is its one other synchronisation)."""
    readings = iter([10.0, 10.2, 10.5, 20.0, 20.25])  # start, split, stop; start, stop
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(readings))
    waits = []
    monkeypatch.setattr(timing, "sync", waits.append)
    clock = Clock(torch.device("cpu"))
    clock.start()
    clock.split()
    assert clock.stop() == 0.5 and clock.first == pytest.approx(0.2)
    assert len(waits) == 2
    clock.start()
    assert clock.stop() == 0.25 and clock.first == 0.0  # no split: no first phase


def test_a_speculative_step_waits_for_the_device_at_its_clocks_start_and_stop_only(tiny, tiny_tok, monkeypatch):
    """Each speculative step of a decode calls timing.sync twice (its clock's start and stop; before the split,
    four times: drafting was stopped and verification started with waits between), and its draft and verify
    seconds add up to the step's."""
    from specdemo.config import GenerationConfig
    from specdemo.drafters.ngram import NgramDrafter
    from specdemo.engine import decode

    waits, sync = [], timing.sync
    monkeypatch.setattr(timing, "sync", lambda device: waits.append(device) or sync(device))
    config = GenerationConfig(max_new_tokens=16, num_draft_tokens=3, tree="off")
    events = decode(tiny.target, tiny_tok, [[3, 5, 7, 3, 5, 7, 3, 5]], config, NgramDrafter())
    per_step, before = [], 0.0
    for event in events:
        per_step.append((event.kind, len(waits)))
        waits.clear()
        if event.kind == "spec":
            assert event.draft_seconds > 0 and event.verify_seconds > 0
            assert event.draft_seconds + event.verify_seconds == pytest.approx(event.elapsed - before)
        before = event.elapsed
    spec = [n for kind, n in per_step if kind == "spec"]
    assert spec and all(n == 2 for n in spec[1:]), per_step


def test_timed_call_returns_the_result_and_its_wall_time(monkeypatch):
    readings = iter([1.0, 3.5])
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(readings))
    assert timing.timed_call(lambda: "done") == ("done", 2.5)


def test_verify_costs_interpolate_between_measured_widths(monkeypatch):
    """Widths 2..5 are measured, wider ones at doubling steps; k between them is interpolated linearly."""
    measured = {}

    def fake_seconds(model, prompt_ids, widths, repeats):
        measured["widths"] = list(widths)
        return {1: 0.5, **{w: 0.5 * (1.0 + 0.1 * (w - 1)) for w in widths}}  # linear in width

    monkeypatch.setattr(timing, "forward_seconds", fake_seconds)
    costs = verify_costs_for(None, [[1, 2]], k_max=8)
    assert measured["widths"] == [2, 3, 4, 5, 7, 9]
    assert sorted(costs) == list(range(1, 9))
    # k + 1 tokens: 1 + 0.1 k, even where interpolated
    assert all(abs(costs[k] - (1.0 + 0.1 * k)) < 1e-9 for k in costs)
