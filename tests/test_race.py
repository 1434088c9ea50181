"""The app's plain parts (specdemo.app.race, no gradio): request checks against the limits, the Space rules for model
ids (the allowlist and local paths, as app.py's limits_from_env reads them), the prompt-length guard and the token cap,
the summary text, the pacing of live frames (the throttle) and of the replay, and c and the verify cost as the sweep
defines them."""

from __future__ import annotations

import time

import pytest

from specdemo.app import race
from specdemo.app.race import (
    LIVE_TEXT_EVERY,
    AppLimits,
    Runs,
    Throttle,
    UserError,
    check_prompt_tokens,
    is_local_path,
    make_request,
    preset_fields,
    preset_ids,
    replay_frames,
    run_point,
)
from specdemo.app.summary import final_stats_markdown, sweep_table
from specdemo.config import BUNDLED_ID, PRESETS, TRAINED_DRAFT_ID
from specdemo.drafters.hybrid import HybridCalibration
from specdemo.engine import StepEvent
from specdemo.measure.tune_k import SweepPoint, summarize

OK = dict(prompt="hi", target="smollm2-135m", drafter="ngram", draft="", k=4, dynamic_k=False, temperature=0.0,
          top_p=1.0, max_new_tokens=16)


def test_make_request_refuses_bad_input_with_a_message():
    """Empty prompt, absurd k, a token count over the cap and a model off the allowlist are refused up front."""
    limits = AppLimits(max_new_tokens=64, allowlist=("org/allowed",))
    ok = dict(prompt="hi", target="smollm2-135m", drafter="ngram", draft="", k=4, dynamic_k=False, temperature=0.0,
              top_p=1.0, max_new_tokens=16)
    assert make_request(**ok, limits=limits).draft is None
    for bad, match in ((dict(prompt="  "), "empty"), (dict(k=999), "k must be"), (dict(k=0), "k must be"),
                       (dict(max_new_tokens=65), "max new tokens"), (dict(target="org/other"), "not allowed"),
                       (dict(drafter="model", draft="org/other"), "not allowed"), (dict(top_p=0.0), "top-p"),
                       (dict(drafter="magic"), "drafter must be one of")):
        with pytest.raises(UserError, match=match):
            make_request(**{**ok, **bad}, limits=limits)


def test_presets_fill_the_fields():
    """A prompt-lookup preset selects the ngram drafter and clears the draft id."""
    target, drafter, draft = preset_fields("Bundled SmolLM2-135M + prompt lookup (offline)")
    assert (target, drafter, draft) == ("smollm2-135m", "ngram", "")
    fields_ = preset_fields("Bundled SmolLM2-135M + trained draft + prompt lookup (offline)")
    assert fields_ == ("smollm2-135m", "hybrid", "smollm2-135m-draft")
    request = make_request("hi", *fields_, k=3, dynamic_k=False, temperature=0.0, top_p=1.0, max_new_tokens=8,
                           limits=AppLimits())
    assert (request.drafter, request.draft) == ("hybrid", "smollm2-135m-draft")


def test_replay_reveals_events_at_their_measured_times():
    """Frames follow a fake clock: an event shows once its own elapsed time has passed; the last frame shows all."""
    now = [0.0]
    seen = []
    for frame in replay_frames([0.05, 0.3, 0.9], [0.05, 0.2], clock=lambda: now[0],
                               sleep=lambda s: now.__setitem__(0, now[0] + s)):
        seen.append((now[0], frame))
    assert seen[0] == (0.0, (0, 0, True))
    assert seen[-1][1] == (3, 2, True) and seen[-1][0] == pytest.approx(0.9)
    for t, (n_ar, n_sd, _) in seen:  # exactly the events whose own elapsed time has passed are shown
        assert n_ar == sum(e <= t + 1e-9 for e in [0.05, 0.3, 0.9])
        assert n_sd == sum(e <= t + 1e-9 for e in [0.05, 0.2])
    plot_times = [t for t, f in seen if f[2]]
    assert all(b - a >= 0.5 - 1e-9 for a, b in zip(plot_times[:-1], plot_times[1:-1]))  # plots are throttled
    assert list(replay_frames([0.5], [0.2], pace=False)) == [(1, 1, True)]


def test_summary_says_how_the_hybrid_drafted_and_why():
    """The hybrid's line names the model's cap and the measured verify costs it came from; other drafters have none.
    The outputs line names the draft, or a model-free drafter's kind (suffix decoding is not prompt lookup)."""
    result = {"speedup": 1.5, "identical": True, "target": "t", "device": "cpu", "dtype": "float32", "k": 8,
              "dynamic_k": False, "drafter": "hybrid", "draft": "d", "ar": {"tokens_per_s": 20.0},
              "sd": {"seconds": 1.0, "draft_seconds": 0.1, "verify_seconds": 0.8, "tokens_per_s": 30.0,
                     "acceptance_rate": 0.5, "accepted": 5, "drafted": 10, "mean_accepted": 1.5, "steps": 10}}
    assert "hybrid:" not in final_stats_markdown(result)
    capped = final_stats_markdown({**result, **HybridCalibration(1, {1: 1.0, 2: 1.07, 3: 1.3}, 0.071).as_dict()})
    assert "proposes 1 token per step" in capped and "costs 1.30× a 1-token one" in capped
    assert "a drafted token 0.07×" in capped
    uncapped = HybridCalibration(None, {1: 1.0, 2: 1.0, 3: 1.01}, None).as_dict()
    assert "up to k tokens per step" in final_stats_markdown({**result, **uncapped})
    assert "drafter hybrid (d), k=8" in final_stats_markdown(result)
    for kind, named in (("ngram", "prompt lookup"), ("suffix", "suffix decoding")):  # no draft: the kind's name
        assert f"drafter {kind} ({named}), k=8" in final_stats_markdown({**result, "drafter": kind, "draft": None})


def test_sweep_table_has_a_line_per_k_and_the_fit():
    """A Sweep from specdemo.measure.tune_k becomes a table line per k, then the fitted alpha, c and the theory's best
    k."""
    points = [SweepPoint(k=k, ar_seconds=1.0, sd_seconds=1.0 / (1 + k / 10), ar_tokens=20, sd_tokens=20,
                         speedup=1 + k / 10, acceptance_rate=0.5, mean_accepted=1.5, mean_drafted=k, alpha=0.5,
                         c=0.01, verify_cost=1.0, expected_speedup=1.2, identical=True) for k in (1, 2, 3)]
    result = summarize(points, {p.k: p.verify_cost for p in points}, k_max=6)
    table = sweep_table(result)
    assert table.count("\n| ") == 3 and f"best k = {result.best_k}" in table
    assert result.best_measured_k == 3


def test_non_numeric_or_fractional_numbers_get_a_clear_message():
    """What an API client may send for k, max new tokens, temperature, top-p or a checkbox: a message names the
    field; numbers sent as strings are fine."""
    limits = AppLimits()
    for bad, match in ((dict(k="abc"), "k must be a whole number from 1 to 64, got 'abc'"),
                       (dict(k=2.5), "k must be a whole number .*, got 2.5"),
                       (dict(k=None), "k must be a whole number"),
                       (dict(max_new_tokens="lots"), "max new tokens must be"),
                       (dict(temperature="hot"), "temperature must be"), (dict(top_p=float("nan")), "top-p must be"),
                       (dict(dynamic_k="maybe"), "dynamic k must be true or false"), (dict(prompt=None), "empty")):
        with pytest.raises(UserError, match=match):
            make_request(**{**OK, **bad}, limits=limits)
    request = make_request(**{**OK, "k": "3", "max_new_tokens": 8.0, "temperature": "0.5", "dynamic_k": "true"},
                           limits=limits)
    assert (request.k, request.max_new_tokens, request.temperature, request.dynamic_k) == (3, 8, 0.5, True)


def test_on_a_space_only_the_presets_may_load(monkeypatch):
    """app.limits_from_env with SPACE_ID set and no allowlist: the presets' ids load, any other id is refused; an
    explicit allowlist wins."""
    import app

    limits = app.limits_from_env({"SPACE_ID": "someone/specdemo"})
    assert limits.allowlist == preset_ids() and not limits.allow_local_paths
    assert set(preset_ids()) == {n for p in PRESETS for n in (p.target, p.draft) if n}
    for preset in PRESETS:
        target, drafter, draft = preset_fields(preset.label)
        make_request(**{**OK, "target": target, "drafter": drafter, "draft": draft}, limits=limits)
    for bad in (dict(target="openai-community/gpt2"), dict(drafter="model", draft="someone/tiny-draft")):
        with pytest.raises(UserError, match="not allowed on this server"):
            make_request(**{**OK, **bad}, limits=limits)
    assert app.limits_from_env({"SPACE_ID": "x", "SPECDEMO_MODEL_ALLOWLIST": "org/a"}).allowlist == ("org/a",)
    assert app.limits_from_env({}).allowlist == ()  # run locally: any hub id


def test_local_paths_are_refused_unless_allowed(tmp_path, monkeypatch):
    """Folders, absolute and relative paths and home paths are refused as model ids (on a Space too) unless
    SPECDEMO_ALLOW_LOCAL_PATHS=1; hub ids and the app's own ids are not paths."""
    import app

    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "model").mkdir(parents=True)
    for path in (str(tmp_path), "./x", "../x", "~/models/x", "a/b/c", "org/model", "C:\\models\\x"):
        assert is_local_path(path), path
        for env in ({}, {"SPACE_ID": "x"}):
            with pytest.raises(UserError, match="looks like a path"):
                make_request(**{**OK, "target": path}, limits=app.limits_from_env(env))
    for name in ("openai-community/gpt2", "gpt2", BUNDLED_ID, TRAINED_DRAFT_ID):
        assert not is_local_path(name), name
    allowed = app.limits_from_env({"SPECDEMO_ALLOW_LOCAL_PATHS": "1"})
    with pytest.raises(UserError, match="a folder with no config.json"):  # allowed, but not a model
        make_request(**{**OK, "target": str(tmp_path)}, limits=allowed)
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    assert make_request(**{**OK, "target": str(tmp_path)}, limits=allowed).target == str(tmp_path)


def test_a_huge_prompt_is_refused_by_its_length_at_once():
    """200,000 characters are refused by counting characters (no tokenizer), in well under a second."""
    start = time.monotonic()
    with pytest.raises(UserError, match="too long: 200,000 characters"):
        make_request(**{**OK, "prompt": "x" * 200_000}, limits=AppLimits())
    assert time.monotonic() - start < 1.0
    with pytest.raises(UserError, match="2,000 characters, at most 1,600 here"):
        make_request(**{**OK, "prompt": "x" * 2000}, limits=AppLimits(max_prompt_tokens=100))


def test_the_token_cap_follows_the_context_and_the_setting(monkeypatch, tiny_tok):
    """Default: the target's context minus max new tokens, at most 4096; SPECDEMO_MAX_PROMPT_TOKENS lowers it.
    The count is the chat-templated prompt's, from the tokenizer alone."""
    monkeypatch.setattr(race, "load_tokenizer", lambda name, runtime: (tiny_tok, 4200))
    over_cap = make_request(**{**OK, "prompt": "w1 " * 4097, "max_new_tokens": 20}, limits=AppLimits())
    with pytest.raises(UserError, match="4,097 tokens, at most 4,096 here"):  # the default cap, under the context
        check_prompt_tokens(over_cap, AppLimits(), None)
    monkeypatch.setattr(race, "load_tokenizer", lambda name, runtime: (tiny_tok, 40))
    request = make_request(**{**OK, "prompt": "w1 w2 w3 " * 3, "max_new_tokens": 20}, limits=AppLimits())
    assert check_prompt_tokens(request, AppLimits(), None) == 9
    with pytest.raises(UserError, match="9 tokens, at most 8 here"):
        check_prompt_tokens(request, AppLimits(max_prompt_tokens=8), None)
    long = make_request(**{**OK, "prompt": "w1 " * 25, "max_new_tokens": 20}, limits=AppLimits())
    with pytest.raises(UserError, match="25 tokens, at most 20 here .*context is 40 tokens"):
        check_prompt_tokens(long, AppLimits(), None)


def test_throttle_lets_a_live_frame_through_every_half_second_and_the_last_one_always():
    """On a fake clock: frames at most every 0.5 s (LIVE_TEXT_EVERY), the first at once, a final frame always."""
    assert LIVE_TEXT_EVERY == 0.5
    now = [0.0]
    throttle = Throttle(clock=lambda: now[0])
    seen = []
    for i in range(200):  # an event every 10 ms for 2 s
        now[0] = i * 0.01
        seen.append(throttle.due(final=i == 199))
    times = [i * 0.01 for i, due in enumerate(seen) if due]
    assert all(b - a >= 0.5 - 1e-9 for a, b in zip(times[:-2], times[1:-1]))
    assert seen[0] and seen[-1] and 4 <= len(times) <= 6


def test_run_point_gives_c_and_verify_cost_as_the_sweep_defines_them():
    """c = draft seconds per drafted token / AR seconds per pass; verify cost = seconds per verify / same."""
    ar = [StepEvent("prefill", [1], "a", 0.05, 1, verify_seconds=0.05)]
    ar += [StepEvent("ar", [1], "a", 0.05 + 0.01 * i, 1 + i, verify_seconds=0.01) for i in range(1, 5)]
    sd = [StepEvent("prefill", [1], "a", 0.05, 1, verify_seconds=0.05),
          StepEvent("spec", [1, 1], "aa", 0.072, 3, drafted=[1, 1], num_accepted=1, correction=1,
                    draft_seconds=0.004, verify_seconds=0.018, k=2)]
    p = run_point(Runs(ar, sd, result={"k": 2}))
    assert p.c == pytest.approx(0.002 / 0.01) and p.verify_cost == pytest.approx(1.8)
    assert run_point(Runs()) is None
    assert race.passes(sd) == [(0.0, 0.0, 0.05), (0.05, 0.004, 0.018)]
