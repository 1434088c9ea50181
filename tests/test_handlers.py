"""The handlers without a server: the {component: value} frames of a live run, its race and its replay, the pass
costs beside the calibrated ones and Re-measure, Stop, bad requests refused before the hardware is taken, the sweep,
presets and errors, on a tiny model (milliseconds) and on the real bundled model (slow). The plain checks and text
they use are tested in test_race.py."""

from __future__ import annotations

import html
import re
from dataclasses import fields

import pytest
import torch

from specdemo.app import handlers as handlers_module
from specdemo.app import race
from specdemo.app.handlers import (
    Handlers,
    Outputs,
    RaceOutputs,
    SettingsOutputs,
    SweepOutputs,
)
from specdemo.app.race import CUSTOM, AppLimits, Runs
from specdemo.app.render import COMMITTED, KINDS
from specdemo.app.summary import drift_warning
from specdemo.app.ui import EXAMPLES
from specdemo.config import Placement, Runtime, drafter_default
from specdemo.drafters.base import SharedState

REWRITE = next(p for c, p in EXAMPLES if c == "rewrite")
COMMITTED_CLASSES = tuple(KINDS[k][0] for k in COMMITTED)
SPAN = re.compile(r'<span class="(tok-[a-z]+)"[^>]*>(.*?)</span>', re.S)


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


# ---- presets and errors: no model ----

def test_the_preset_handler_fills_the_settings_and_custom_leaves_them():
    """apply_preset names target, drafter, draft and k (a bundled pair starts at its kind's best measured k,
    config.DRAFTER_DEFAULTS); for Custom it sends only a skip, so nothing changes."""
    h = Handlers(OUTPUTS)
    assert h.apply_preset("Bundled SmolLM2-135M + prompt lookup (offline)") == {
        "target": "smollm2-135m", "drafter": "ngram", "draft": "", "k": drafter_default("ngram").k}
    assert h.apply_preset("Bundled SmolLM2-135M + trained draft (offline)") == {
        "target": "smollm2-135m", "drafter": "model", "draft": "smollm2-135m-draft", "k": drafter_default("model").k}
    custom = h.apply_preset("Custom (type the ids below)")
    assert set(custom) == {"target"} and custom["target"] == handlers_module.gr.skip()
    assert h.apply_best_k(3) == {"k": 3}


def test_picking_a_drafter_moves_k_to_its_starting_k_and_the_preset_to_what_the_settings_are():
    """A drafter picked on the page starts at the k it starts at from the CLI (its measured best on the bundled
    pair), and the Preset box shows the preset the settings now are (a model-free kind ignores the draft box), else
    Custom; an unknown kind changes nothing. Wired to the radio's input event, which a preset's choice does not fire."""
    h = Handlers(OUTPUTS)
    draft = "smollm2-135m-draft"
    expected = {"ngram": "Bundled SmolLM2-135M + prompt lookup (offline)", "suffix": CUSTOM,
                "model": "Bundled SmolLM2-135M + trained draft (offline)",
                "hybrid": "Bundled SmolLM2-135M + trained draft + prompt lookup (offline)"}
    for kind, preset in expected.items():
        assert h.apply_drafter(kind, "smollm2-135m", draft) == {"k": drafter_default(kind).k, "preset": preset}, kind
    assert len({h.apply_drafter(kind, "smollm2-135m", "")["k"] for kind in ("ngram", "suffix", "model")}) > 1
    assert h.apply_drafter("model", "smollm2-135m", "other/draft")["preset"] == CUSTOM  # the preset's draft differs
    assert h.apply_drafter("ngram", "org/other-target", "")["preset"] == CUSTOM
    skip = handlers_module.gr.skip()
    assert h.apply_drafter("nope", "smollm2-135m", "") == {"k": skip, "preset": skip}


def test_an_out_of_memory_error_is_a_status_message_and_releases_the_hardware(monkeypatch, tiny_tok):
    """torch's OutOfMemoryError from the compute step becomes a readable status; the next run can take the lock."""
    monkeypatch.setattr(race, "load_tokenizer", lambda name, runtime: (tiny_tok, 256))

    def oom(request, limits, runtime, recalibrate=False, session=None):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        yield

    handlers = Handlers(OUTPUTS, AppLimits(), gpu=lambda fn: oom)
    with pytest.warns(UserWarning, match="Out of memory"):
        outs = list(handlers.run_compare("hi", "smollm2-135m", "ngram", "", 4, False, 0.0, 1.0, 8, False, False))
    assert outs[-1]["status"].startswith("**Error:** Out of memory") and outs[-1]["result_json"]["error"]
    assert not handlers.hardware.locked()


# ---- the handlers on a tiny model: the real compare and sweep code, milliseconds ----

TINY_PROMPT = "w3 w5 w7 w3 w5 w9 w2 w3 w5"


def tiny_run(h: Handlers, max_new_tokens: int = 12, replay: bool = False, **changes) -> list[dict]:
    values = dict(prompt=TINY_PROMPT, target="tiny", drafter="ngram", draft="", k=3, dynamic_k=False,
                  temperature=0.0, top_p=1.0, max_new_tokens=max_new_tokens, hide_rejected=False, replay=replay)
    return list(h.run_compare(**{**values, **changes}))


def test_compare_frames_name_only_the_events_outputs_and_the_last_fills_them(tiny_loads):
    """Every /compare frame is a dict over the race outputs; the last has the panels, plots, summary and JSON."""
    runtime = Runtime(cache_dir="/nowhere", fast_linear=False)
    h = Handlers(OUTPUTS, AppLimits(device="cpu"), runtime)
    outs = tiny_run(h)
    assert all(isinstance(o, dict) and set(o) <= RACE_KEYS for o in outs)
    assert set(outs[-1]) == RACE_KEYS and outs[-1]["status"].startswith("Done")
    assert outs[-1]["result_json"]["identical"] is True and outs[-1]["result_json"]["sd"]["tokens"] == 12
    assert committed_text(outs[-1]["sd_html"]) == outs[-1]["result_json"]["sd"]["text"]
    assert isinstance(outs[-1]["runs_state"], Runs) and outs[-1]["timeline_plot"].data
    (state,) = [load.pop("shared") for load in tiny_loads]  # the visitor's own (test_app_sessions.py)
    assert isinstance(state, SharedState)
    assert tiny_loads == [{"device": "cpu", "draft_device": None, "runtime": runtime,  # app.py's Runtime reaches it
                           "placement": Placement()}]
    assert not h.hardware.locked()


def test_both_panels_fill_side_by_side_as_the_runs_take_turns_with_no_plots_until_the_end(tiny_loads):
    """Live frames carry text only: the panels that changed, never a plot or the inspector's data; the status says
    the race is on once; speculative tokens are on screen before the AR run is over; the last live state of each
    panel is its run's whole text; the plots come with Done; with `replay`, the race then replays from t = 0."""
    produced = []

    def gpu(fn):  # stands where spaces.GPU or the worker would: sees what the compute step hands over, and when
        def wrapped(*args):
            for item in fn(*args):
                produced.append(item[0] if isinstance(item, tuple) else type(item).__name__)
                yield item
        return wrapped

    h = Handlers(OUTPUTS, AppLimits(device="cpu"), gpu=gpu)
    seen = [(frame, list(produced)) for frame in h.run_compare(TINY_PROMPT, "tiny", "ngram", "", 3, False, 0.0, 1.0,
                                                               40, False, True)]
    result = seen[-1][0]["result_json"]
    live = [(f, p) for f, p in seen if "ar_html" in f or "sd_html" in f][1:]  # after the reset frame
    live = live[:next(i for i, (f, _) in enumerate(live) if f.get("status", "").startswith("Race"))]
    assert live and all(not set(f) & {"tokens_plot", "speedup_plot", "hist_plot", "timeline_plot"} for f, _ in live)
    assert sum(f.get("status", "").startswith("Racing") for f, _ in seen) == 1
    assert all("data-info" not in f.get("sd_html", "") for f, _ in live)
    first_sd = next(i for i, (f, _) in enumerate(live) if spans(f.get("sd_html", "")))
    ar_done = next(i for i, (_, p) in enumerate(live) if p.count("ar") >= result["ar"]["tokens"])
    assert first_sd <= ar_done  # speculative tokens showed while the AR run was still going
    last = {w: next(f[w] for f, _ in reversed(live) if w in f) for w in ("ar_html", "sd_html")}
    assert committed_text(last["ar_html"]) == result["ar"]["text"]
    assert committed_text(last["sd_html"]) == result["sd"]["text"]
    first_race = next(i for i, (f, _) in enumerate(seen) if f.get("status", "").startswith("Race"))
    assert committed_text(seen[first_race][0]["sd_html"]) != result["sd"]["text"]  # the replay starts over at t = 0
    assert seen[-1][0]["status"].startswith("Done") and seen[-1][0]["tokens_plot"].data


def test_a_run_reports_its_pass_costs_beside_the_calibrated_ones(tiny_loads):
    """The result's pass_costs: what the pair's passes cost at calibration (its first run) and in this run, and the
    drift between them; Re-measure calibrates again; a drift is named on the status line."""
    h = Handlers(OUTPUTS, AppLimits(device="cpu"))
    costs = tiny_run(h)[-1]["result_json"]["pass_costs"]
    assert set(costs) == {"calibrated", "run", "drift"}
    assert all(costs[w]["target_pass"] > 0 and costs[w]["verify_pass"] > 0 for w in ("calibrated", "run"))
    again = tiny_run(h)[-1]
    assert again["result_json"]["pass_costs"]["calibrated"] == costs["calibrated"]  # kept
    assert "machine check" in again["stats"] and "1-token target pass" in again["stats"]
    frames = list(h.remeasure(TINY_PROMPT, "tiny", "ngram", "", 3, False, 0.0, 1.0, 12, False, False))
    assert any(f.get("status", "").startswith("Measuring what each pass costs") for f in frames)
    assert frames[-1]["result_json"]["pass_costs"]["calibrated"] != costs["calibrated"]  # measured again
    result = frames[-1]["result_json"] | {"pass_costs": {"drift": {"target_pass": 2.4}}}
    assert "the target's 1-token passes took 2.40×" in drift_warning(result) and "Re-measure" in drift_warning(result)
    assert drift_warning(frames[-1]["result_json"] | {"pass_costs": {"drift": {}}}) == ""


def test_replay_race_shows_the_finished_runs_again_without_computing(tiny_loads):
    """Replay race reads the runs from the state: no model is loaded, the last frame equals the run's own."""
    h = Handlers(OUTPUTS, AppLimits(device="cpu"))
    last = tiny_run(h)[-1]
    assert list(h.replay_race(None, False)) == [{"status": "Nothing to replay yet: press Run first."}]
    replayed = list(h.replay_race(last["runs_state"], False))
    assert len(tiny_loads) == 1 and replayed[-1]["status"].startswith("Done")
    assert any(f["status"].startswith("Race") for f in replayed[:-1])
    assert replayed[-1]["sd_html"] == last["sd_html"] and replayed[-1]["ar_html"] == last["ar_html"]


def test_stop_ends_the_run_at_its_next_step_with_its_own_last_frame(tiny_loads):
    """Stop during the AR run: the run's next frame is its last and says "Stopped.", the hardware is free, and the
    next run (and a Stop with nothing running) is served normally."""
    h = Handlers(OUTPUTS, AppLimits(device="cpu", max_new_tokens=200))
    run = h.run_compare(TINY_PROMPT, "tiny", "ngram", "", 3, False, 0.0, 1.0, 200, False, False)
    frame = next(run)
    while not frame.get("status", "").startswith("Racing"):
        frame = next(run)
    h.stop_race()
    assert list(run) == [{"status": "Stopped."}] and not h.hardware.locked()
    h.stop_race()  # nothing running: the next run must not be stopped by it
    assert tiny_run(h, 6)[-1]["result_json"]["sd"]["tokens"] == 6
    sweep = h.run_sweep(TINY_PROMPT, "tiny", "ngram", "", 3, 0.0, 1.0, 8)
    next(sweep)
    h.stop_sweep()
    assert list(sweep)[-1] == {"table": "Stopped."} and not h.hardware.locked()


def test_closing_a_run_mid_way_stops_it_and_frees_the_hardware(tiny_loads):
    """An API client's cancel (gradio closes the generator) during the AR run releases the lock at once; the next
    run is served."""
    h = Handlers(OUTPUTS, AppLimits(device="cpu", max_new_tokens=200))
    run = h.run_compare(TINY_PROMPT, "tiny", "ngram", "", 3, False, 0.0, 1.0, 200, False, False)
    frame = next(run)
    while "ar_html" not in frame or not spans(frame["ar_html"]):
        frame = next(run)
    assert h.hardware.locked()
    run.close()
    assert not h.hardware.locked()
    assert tiny_run(h, 6)[-1]["result_json"]["sd"]["tokens"] == 6


def test_a_sampled_run_uses_the_chosen_rule_and_its_inspector_says_so(tiny_loads):
    """temperature > 0 with block verification: the engine's steps are decided by block (the inspector's JSON in
    the panel says so), the result and the summary name it; an unknown rule is refused with the choices."""
    h = Handlers(OUTPUTS, AppLimits(device="cpu"))
    last = tiny_run(h, temperature=1.0, verification="block")[-1]
    assert last["result_json"]["verification"] == "block" and "block verification (Sun et al.)" in last["stats"]
    assert '&quot;rule&quot;: &quot;block&quot;' in last["sd_html"]
    assert tiny_run(h, temperature=0.0, verification="block")[-1]["result_json"]["verification"] == "greedy"
    with pytest.warns(UserWarning):
        outs = tiny_run(h, temperature=1.0, verification="tree")
    assert len(outs) == 1 and "verification must be one of token, block, got 'tree'." in outs[0]["status"]


def test_bad_requests_are_refused_before_the_hardware_is_taken(tiny_loads):
    """A non-numeric k, a 200,000-character prompt and a local path each get one error frame; nothing loads."""
    h = Handlers(OUTPUTS, AppLimits(device="cpu"))
    for changes, match in ((dict(k="abc"), "k must be a whole number"), (dict(prompt="w1 " * 70_000), "too long"),
                           (dict(target="/tmp"), "looks like a path")):
        with pytest.warns(UserWarning):
            outs = tiny_run(h, **changes)
        assert len(outs) == 1 and match in outs[0]["status"] and "error" in outs[0]["result_json"]
    with pytest.warns(UserWarning):  # over the token cap: refused by the tokenizer, before any model work
        outs = tiny_run(Handlers(OUTPUTS, AppLimits(device="cpu", max_prompt_tokens=5)))
    assert "tokens, at most 5" in outs[-1]["status"]
    assert tiny_loads == [] and not h.hardware.locked()


def test_sweep_frames_name_only_the_events_outputs(tiny_loads):
    """Every /sweep_k frame is a dict over the sweep outputs: status lines while the runs are timed (nothing drawn
    then), then one frame with the figure, the table and the apply button, saying Done."""
    h = Handlers(OUTPUTS, AppLimits(device="cpu"))
    outs = list(h.run_sweep(TINY_PROMPT, "tiny", "ngram", "", 3, 0.0, 1.0, 8))
    assert all(isinstance(o, dict) and set(o) <= SWEEP_KEYS for o in outs)
    assert [o for o in outs if "plot" in o] == outs[-1:] and outs[-1]["table"].startswith("Done")
    assert all(set(o) == {"table"} for o in outs[:-1])
    assert outs[-1]["best"] in (1, 2, 3) and tiny_loads[0]["runtime"] == Runtime()
    assert not h.hardware.locked()


def test_rerender_hides_rejected_drafts_of_the_finished_run_only(tiny_loads):
    """Toggling "hide rejected drafts" before any run sends a skip; after one it re-renders the same text."""
    h = Handlers(OUTPUTS, AppLimits(device="cpu"))
    assert h.rerender(None, True, "") == {"sd_html": handlers_module.gr.skip()}
    last = tiny_run(h)[-1]
    hidden = h.rerender(last["runs_state"], True, last["sd_html"])["sd_html"]
    assert "hide-rejected" in hidden and committed_text(hidden) == committed_text(last["sd_html"])


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
    # partial frames come before the final one; live and then in the replay, the streamed panels only grow
    race = next(i for i, o in enumerate(outs) if o.get("status", "").startswith("Race"))
    for frames in (outs[:race], outs[race:]):
        panels = [o["sd_html"] for o in frames if "sd_html" in o and spans(o["sd_html"])] + [sd_html]
        assert len(panels) >= 2
        assert all(committed_text(b).startswith(committed_text(a)) for a, b in zip(panels, panels[1:]))
    hidden = handlers.rerender(last["runs_state"], True, sd_html)["sd_html"]
    assert "hide-rejected" in hidden and committed_text(hidden) == committed_text(sd_html)


@pytest.mark.slow
def test_errors_show_in_the_status_and_the_app_keeps_serving(handlers):
    """An unknown model, an empty prompt and a hub-only preset offline give a clear status, not a traceback."""
    hub_only = "HuggingFaceTB/SmolLM2-1.7B-Instruct"  # a hub preset: refused quickly and clearly when offline
    for args, match in (((REWRITE, "no/such-model-xyz", "ngram", "", 4, False, 0.0, 1.0, 8), "Could not load"),
                        ((REWRITE, hub_only, "model", "HuggingFaceTB/SmolLM2-135M-Instruct", 4, False, 0.0, 1.0, 8),
                         "Could not load"),
                        (("", "smollm2-135m", "ngram", "", 4, False, 0.0, 1.0, 8), "prompt is empty"),
                        ((REWRITE, "smollm2-135m", "ngram", "", 999, False, 0.0, 1.0, 8), "k must be")):
        outs = list(handlers.run_compare(*args, False, False))
        status, result = outs[-1]["status"], outs[-1]["result_json"]
        assert status.startswith("**Error:**") and match in status, status
        assert "error" in result
    assert not handlers.hardware.locked()


@pytest.mark.slow
def test_sweep_handler_plots_measured_and_theory(handlers):
    """A short sweep k = 1..2 yields a figure with the theory curve and a best k for the apply button, beside the
    k the pair starts at and the report that measured it."""
    outs = list(handlers.run_sweep(REWRITE, "smollm2-135m", "ngram", "", 2, 0.0, 1.0, 8))
    figs = [o["plot"] for o in outs if hasattr(o.get("plot"), "data")]
    assert figs and {t.name for t in figs[-1].data} >= {"measured speedup", "acceptance rate"}
    assert outs[-1]["table"].startswith("Done") and outs[-1]["best"] in (1, 2)
    start = drafter_default("ngram")
    assert f"starts at k = {start.k}: measured best in {start.evidence.report}" in outs[-1]["table"]
    assert not handlers.hardware.locked()
