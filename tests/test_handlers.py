"""The handlers without a server: request checks, replay pacing, the summary text, and the {component: value}
frames, on a tiny model (milliseconds) and on the real bundled model (slow)."""

from __future__ import annotations

import html
import re
from dataclasses import asdict, fields

import pytest
import torch

from specdemo import charts, handlers as handlers_module
from specdemo.compare import Pair
from specdemo.config import Runtime
from specdemo.drafters import NgramDrafter
from specdemo.handlers import (AppLimits, Handlers, Outputs, RaceOutputs, SettingsOutputs, SweepOutputs, UserError,
                               final_stats_markdown, make_request, preset_fields, replay_frames, sweep_table)
from specdemo.loading import LoadedModel
from specdemo.render import COMMITTED, KINDS
from specdemo.sweep import SweepPoint, summarize
from specdemo.ui import EXAMPLES

REWRITE = next(p for c, p in EXAMPLES if c == "rewrite")
COMMITTED_CLASSES = tuple(KINDS[k][0] for k in COMMITTED)
SPAN = re.compile(r'<span class="(tok-[a-z]+)">(.*?)</span>', re.S)


def named(cls):
    """An outputs group whose components are stood in for by their field names: the handlers use components only as
    dict keys, so a frame reads as {"status": ..., "result_json": ...}."""
    return cls(*(f.name for f in fields(cls)))


OUTPUTS = Outputs(named(RaceOutputs), named(SweepOutputs), named(SettingsOutputs))
RACE_KEYS, SWEEP_KEYS = set(OUTPUTS.race.order()), set(OUTPUTS.sweep.order())


def spans(panel: str) -> list[tuple[str, str]]:
    """(class, unescaped text) of every token span in a panel."""
    return [(cls, html.unescape(text)) for cls, text in SPAN.findall(panel)]


def committed_text(panel: str) -> str:
    return "".join(text for cls, text in spans(panel) if cls in COMMITTED_CLASSES)


# ---- requests, presets, replay and text: no model ----

def test_make_request_refuses_bad_input_with_a_message():
    """Empty prompt, absurd k, a token count over the cap and a model off the allowlist are refused up front."""
    limits = AppLimits(max_new_tokens=64, allowlist=("org/allowed",))
    ok = dict(prompt="hi", target="smollm2-135m", drafter="ngram", draft="", k=4, dynamic_k=False, temperature=0.0,
              top_p=1.0, max_new_tokens=16)
    assert make_request(**ok, limits=limits).draft is None
    for bad, match in ((dict(prompt="  "), "empty"), (dict(k=999), "k must be"), (dict(k=0), "k must be"),
                       (dict(max_new_tokens=65), "max new tokens"), (dict(target="org/other"), "not allowed"),
                       (dict(drafter="model", draft="org/other"), "not allowed"), (dict(top_p=0.0), "top_p"),
                       (dict(drafter="magic"), "Unknown drafter")):
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


def test_the_preset_handler_fills_the_settings_and_custom_leaves_them():
    """apply_preset names target, drafter and draft; for Custom it sends only a skip, so nothing changes."""
    h = Handlers(OUTPUTS)
    assert h.apply_preset("Bundled SmolLM2-135M + prompt lookup (offline)") == {
        "target": "smollm2-135m", "drafter": "ngram", "draft": ""}
    custom = h.apply_preset("Custom (type the ids below)")
    assert set(custom) == {"target"} and custom["target"] == handlers_module.gr.skip()
    assert h.apply_best_k(3) == {"k": 3}


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
    """The hybrid's line names the model's cap and the measured verify costs it came from; other drafters have none."""
    result = {"speedup": 1.5, "identical": True, "target": "t", "device": "cpu", "dtype": "float32", "k": 8,
              "dynamic_k": False, "drafter": "hybrid", "draft": "d", "ar": {"tokens_per_s": 20.0},
              "sd": {"seconds": 1.0, "draft_seconds": 0.1, "verify_seconds": 0.8, "tokens_per_s": 30.0,
                     "acceptance_rate": 0.5, "accepted": 5, "drafted": 10, "mean_accepted": 1.5, "steps": 10}}
    assert "hybrid:" not in final_stats_markdown(result)
    capped = final_stats_markdown({**result, "hybrid_model_k": 1, "hybrid_verify_costs": {"1": 1.0, "2": 1.07, "3": 1.3},
                                   "hybrid_draft_cost": 0.071})
    assert "proposes 1 token per step" in capped and "costs 1.30× a 1-token one" in capped
    assert "a drafted token 0.07×" in capped
    assert "up to k tokens per step" in final_stats_markdown({**result, "hybrid_model_k": None,
                                                              "hybrid_verify_costs": {"1": 1.0, "2": 1.0, "3": 1.01}})


def test_sweep_table_and_chart_show_measured_points_beside_theory():
    """A Sweep from specdemo.sweep becomes a table line per k and a figure with measured, theory and acceptance."""
    points = [SweepPoint(k=k, ar_seconds=1.0, sd_seconds=1.0 / (1 + k / 10), ar_tokens=20, sd_tokens=20,
                         speedup=1 + k / 10, acceptance_rate=0.5, mean_accepted=1.5, mean_drafted=k, alpha=0.5,
                         c=0.01, verify_cost=1.0, expected_speedup=1.2, identical=True) for k in (1, 2, 3)]
    result = summarize(points, {p.k: p.verify_cost for p in points}, k_max=6)
    table = sweep_table(result)
    assert table.count("\n| ") == 3 and f"best k = {result.best_k}" in table
    fig = charts.k_sweep([asdict(p) for p in points], sorted(result.theory.items()), result.best_measured_k,
                         result.best_k)
    assert {t.name for t in fig.data} == {"measured speedup", "theory (α, c)", "acceptance rate"}
    assert result.best_measured_k == 3


def test_an_out_of_memory_error_is_a_status_message_and_releases_the_hardware():
    """torch's OutOfMemoryError from the compute step becomes a readable status; the next run can take the lock."""

    def oom(request, limits, runtime):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        yield

    handlers = Handlers(OUTPUTS, AppLimits(), gpu=lambda fn: oom)
    with pytest.warns(UserWarning, match="Out of memory"):
        outs = list(handlers.run_compare("hi", "smollm2-135m", "ngram", "", 4, False, 0.0, 1.0, 8, False, False))
    assert outs[-1]["status"].startswith("**Error:** Out of memory") and outs[-1]["result_json"]["error"]
    assert not handlers.hardware.locked()


# ---- the handlers on a tiny model: the real compare and sweep code, milliseconds ----

@pytest.fixture
def tiny_loads(monkeypatch, tiny_target, tiny_tok):
    """load_pair replaced by a tiny target with prompt lookup; records the keyword arguments of each call."""
    calls = []

    def load_pair(target, kind="model", draft=None, **kwargs):
        calls.append(kwargs)
        loaded = LoadedModel("tiny", tiny_target, tiny_tok, torch.device("cpu"), torch.float32, "folder")
        return Pair(loaded, NgramDrafter(), kind, None)

    monkeypatch.setattr(handlers_module, "load_pair", load_pair)
    return calls


TINY_PROMPT = "w3 w5 w7 w3 w5 w9 w2 w3 w5"


def test_compare_frames_name_only_the_events_outputs_and_the_last_fills_them(tiny_loads):
    """Every /compare frame is a dict over the race outputs; the last has the panels, plots, summary and JSON."""
    runtime = Runtime(cache_dir="/nowhere", fast_linear=False)
    h = Handlers(OUTPUTS, AppLimits(device="cpu"), runtime)
    outs = list(h.run_compare(TINY_PROMPT, "tiny", "ngram", "", 3, False, 0.0, 1.0, 12, False, False))
    assert all(isinstance(o, dict) and set(o) <= RACE_KEYS for o in outs)
    assert set(outs[-1]) == RACE_KEYS and outs[-1]["status"].startswith("Done")
    assert outs[-1]["result_json"]["identical"] is True and outs[-1]["result_json"]["sd"]["tokens"] == 12
    assert committed_text(outs[-1]["sd_html"]) == outs[-1]["result_json"]["sd"]["text"]
    assert tiny_loads == [{"device": "cpu", "runtime": runtime}]  # app.py's Runtime reaches load_pair
    assert not h.hardware.locked()


def test_sweep_frames_name_only_the_events_outputs(tiny_loads):
    """Every /sweep_k frame is a dict over the sweep outputs: a figure and the apply button per k, then Done."""
    h = Handlers(OUTPUTS, AppLimits(device="cpu"))
    outs = list(h.run_sweep(TINY_PROMPT, "tiny", "ngram", "", 3, 0.0, 1.0, 8))
    assert all(isinstance(o, dict) and set(o) <= SWEEP_KEYS for o in outs)
    assert sum("plot" in o for o in outs) == 3 and outs[-1]["table"].startswith("Done")
    assert outs[-1]["best"] in (1, 2, 3) and tiny_loads[0]["runtime"] == Runtime()
    assert not h.hardware.locked()


def test_rerender_without_a_finished_run_changes_nothing():
    """Toggling "hide rejected drafts" before any run sends a skip for the panel."""
    assert Handlers(OUTPUTS).rerender([], True, "") == {"sd_html": handlers_module.gr.skip()}


# ---- the handlers on the real bundled model ----

@pytest.fixture(scope="module")
def handlers():
    torch.set_num_threads(1)  # the CPU is shared; one thread is both faster and steadier here
    return Handlers(OUTPUTS, AppLimits(max_new_tokens=64))


@pytest.mark.slow
def test_compare_handler_colors_every_committed_token(handlers):
    """Greedy prompt lookup: one committed span per generated token, SD text == AR text, and the JSON agrees."""
    outs = list(handlers.run_compare(REWRITE, "smollm2-135m", "ngram", "", 4, False, 0.0, 1.0, 24, False, True))
    last = outs[-1]
    ar_html, sd_html, stats, status, result = (last[n] for n in ("ar_html", "sd_html", "stats", "status",
                                                                 "result_json"))
    assert status.startswith("Done"), status
    assert result["identical"] is True and result["ar"]["tokens"] == result["sd"]["tokens"] > 0
    sd_spans = [s for s in spans(sd_html) if s[0] in COMMITTED_CLASSES]
    assert len(sd_spans) == result["sd"]["tokens"]
    assert len(spans(ar_html)) == result["ar"]["tokens"]
    assert committed_text(sd_html) == committed_text(ar_html) == result["sd"]["text"] == result["ar"]["text"]
    rejected = sum(1 for cls, _ in spans(sd_html) if cls == "tok-rejected")
    assert rejected == result["sd"]["drafted"] - result["sd"]["accepted"]
    assert sum(1 for cls, _ in spans(sd_html) if cls == "tok-accepted") == result["sd"]["accepted"]
    assert "Speedup" in stats and "mean accepted length" in stats
    # partial frames come before the final one, and the streamed panels only grow
    panels = [o["sd_html"] for o in outs if "sd_html" in o]
    assert len(panels) >= 2
    assert all(committed_text(b).startswith(committed_text(a)) for a, b in zip(panels, panels[1:]))
    hidden = handlers.rerender(last["segments_state"], True, sd_html)["sd_html"]
    assert "hide-rejected" in hidden and committed_text(hidden) == committed_text(sd_html)


@pytest.mark.slow
def test_errors_show_in_the_status_and_the_app_keeps_serving(handlers):
    """An unknown model, an empty prompt and a hub-only preset offline give a clear status, not a traceback."""
    hub_only = "HuggingFaceTB/SmolLM2-1.7B-Instruct"  # a hub preset: refused quickly and clearly when offline
    for args, match in (((REWRITE, "no/such-model-xyz", "ngram", "", 4, False, 0.0, 1.0, 8), "Could not load"),
                        ((REWRITE, hub_only, "model", "HuggingFaceTB/SmolLM2-135M-Instruct", 4, False, 0.0, 1.0, 8),
                         "Could not load"),
                        (("", "smollm2-135m", "ngram", "", 4, False, 0.0, 1.0, 8), "prompt is empty"),
                        ((REWRITE, "smollm2-135m", "ngram", "", 40, False, 0.0, 1.0, 8), "k must be")):
        outs = list(handlers.run_compare(*args, False, False))
        status, result = outs[-1]["status"], outs[-1]["result_json"]
        assert status.startswith("**Error:**") and match in status, status
        assert "error" in result
    assert not handlers.hardware.locked()


@pytest.mark.slow
def test_sweep_handler_plots_measured_and_theory(handlers):
    """A short sweep k = 1..2 yields a figure with the theory curve and a best k for the apply button."""
    outs = list(handlers.run_sweep(REWRITE, "smollm2-135m", "ngram", "", 2, 0.0, 1.0, 8))
    figs = [o["plot"] for o in outs if hasattr(o.get("plot"), "data")]
    assert figs and {t.name for t in figs[-1].data} >= {"measured speedup", "acceptance rate"}
    assert outs[-1]["table"].startswith("Done") and outs[-1]["best"] in (1, 2)
    assert not handlers.hardware.locked()
