"""The page without a server: the layout (components, events, API names and their outputs order), and the token
rendering and charts it shows. The handlers' own tests are in test_handlers.py."""

from __future__ import annotations

import ast
from pathlib import Path

import gradio as gr
import pytest

from specdemo import charts
from specdemo.config import MAX_K, PRESETS, Runtime
from specdemo.engine import StepEvent
from specdemo.handlers import AppLimits, Handlers
from specdemo.render import Segment, event_segments, segments_html, split_text
from specdemo.ui import CUSTOM, build_demo, preset_choices

PACKAGE = Path(__file__).resolve().parent.parent / "specdemo"
COMPARE_INPUTS = ["Prompt", "Target model id", "Drafter", "Draft model id (same tokenizer)", "k (draft tokens per step)",
                  "dynamic k", "temperature (0 = greedy)", "top-p", "max new tokens", "hide rejected drafts",
                  "replay at measured pace"]


@pytest.fixture(scope="module")
def demo():
    return build_demo(AppLimits(max_new_tokens=64), Runtime(cache_dir="/nowhere"))


def event(demo: gr.Blocks, api_name: str):
    return next(fn for fn in demo.fns.values() if fn.api_name == api_name)


def test_compare_endpoint_keeps_its_inputs_and_outputs_order(demo):
    """/compare takes the README's 11 inputs in order; outputs[7] is the result JSON, [6] the status line."""
    fn = event(demo, "compare")
    assert [c.label for c in fn.inputs] == COMPARE_INPUTS
    assert [type(c).__name__ for c in fn.outputs] == ["HTML", "HTML", "Plot", "Plot", "Plot", "Markdown", "Markdown",
                                                      "JSON", "State"]
    assert [c.elem_id for c in fn.outputs[:2]] == ["ar-panel", "sd-panel"] and fn.outputs[6].elem_id == "status"
    assert fn.outputs == fn.fn.__self__.outputs.race.order()  # the handler's dict keys are the event's outputs


def test_sweep_endpoint_keeps_its_inputs_and_outputs_order(demo):
    """/sweep_k takes the run's inputs with the largest k in k's place and updates plot, table, best k, button."""
    fn = event(demo, "sweep_k")
    assert [c.label for c in fn.inputs] == COMPARE_INPUTS[:4] + ["largest k"] + COMPARE_INPUTS[6:9]
    assert [type(c).__name__ for c in fn.outputs] == ["Plot", "Markdown", "State", "Button"]
    assert fn.outputs == fn.fn.__self__.outputs.sweep.order()


def test_only_the_two_endpoints_are_public(demo):
    """Presets, Stop, hide-rejected and "Use best k" are page events, not API endpoints."""
    info = demo.get_api_info()
    assert set(info["named_endpoints"]) == {"/compare", "/sweep_k"} and not info["unnamed_endpoints"]


def test_the_handlers_get_the_apps_limits_and_runtime(demo):
    """build_demo hands its AppLimits and Runtime to one Handlers object shared by every event."""
    owners = {fn.fn.__self__ for fn in demo.fns.values() if isinstance(getattr(fn.fn, "__self__", None), Handlers)}
    assert len(owners) == 1
    (h,) = owners
    assert h.limits == AppLimits(max_new_tokens=64) and h.runtime == Runtime(cache_dir="/nowhere")


def test_sliders_take_their_ranges_from_config_and_limits(demo):
    """k runs to config.MAX_K and max new tokens to the server's cap; the presets respect the allowlist."""
    sliders = {c.label: c for c in demo.blocks.values() if isinstance(c, gr.Slider)}
    assert sliders["k (draft tokens per step)"].maximum == MAX_K
    assert sliders["max new tokens"].maximum == 64
    only_bundled = preset_choices(AppLimits(allowlist=("org/none",)))
    assert only_bundled == [p.label for p in PRESETS if p.offline] + [CUSTOM]


def test_only_the_ui_and_its_handlers_import_gradio():
    """No module of the package but ui.py and handlers.py imports gradio (charts and render stay plain)."""
    importers = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "gradio" or n.startswith("gradio.") for n in names):
                importers.add(path.relative_to(PACKAGE).as_posix())
    assert importers == {"ui.py", "handlers.py"}


class WordTokenizer:
    """decode() of one id is its word; enough for event_segments."""

    def __init__(self, words):
        self.words = words

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.words[i] for i in ids)


def test_split_text_always_joins_to_the_event_text():
    """Pieces that match are kept; special tokens and split characters get "" and the rest goes last."""
    assert split_text([" a", " b"], " a b") == [" a", " b"]
    assert split_text(["\ufffd", "\ufffd"], "é") == ["", "é"]
    assert split_text([" end", "<|im_end|>"], " end") == [" end", ""]


def test_event_segments_place_rejected_drafts_before_the_correction():
    """accepted, then the struck-through rejected drafts, then the target's correction; bonus after a full accept."""
    tok = WordTokenizer([" w0", " w1", " w2", " w3", " w4", " w5"])
    step = StepEvent("spec", [1, 2, 5], " w1 w2 w5", 0.1, 4, drafted=[1, 2, 3, 4], num_accepted=2, correction=5)
    kinds = [(s.kind, s.text) for s in event_segments(step, tok, speculative=True)]
    assert kinds == [("accepted", " w1"), ("accepted", " w2"), ("rejected", " w3"), ("rejected", " w4"),
                     ("correction", " w5")]
    full = StepEvent("spec", [1, 2, 3], " w1 w2 w3", 0.1, 3, drafted=[1, 2], num_accepted=2, bonus=3)
    assert [s.kind for s in event_segments(full, tok, True)] == ["accepted", "accepted", "bonus"]
    nothing = StepEvent("spec", [4], " w4", 0.1, 1, drafted=[], num_accepted=0)
    assert [s.kind for s in event_segments(nothing, tok, True)] == ["target"]
    assert [s.kind for s in event_segments(full, tok, False)] == ["plain"] * 3


def test_segments_html_escapes_and_can_hide_rejected():
    """Token text is html-escaped; hiding rejected drafts is a class on the panel."""
    out = segments_html([Segment("accepted", "<b>&"), Segment("rejected", "x")], hide_rejected=True)
    assert "&lt;b&gt;&amp;" in out and "<b>" not in out
    assert 'class="tok-panel hide-rejected"' in out
    assert "\u21b5" in segments_html([Segment("rejected", "\n")])
    assert "\n" in segments_html([Segment("correction", "\n")])


def test_running_speedup_ends_at_the_tokens_per_second_ratio():
    """The last running-speedup value equals (sd tokens/s) / (ar tokens/s) of the whole runs."""
    ar = [(0.0, 0), (1.0, 10), (2.0, 20)]
    sd = [(0.0, 0), (0.5, 8), (1.0, 20)]
    points = charts.running_speedup_points(ar, sd)
    assert points[-1] == (2.0, pytest.approx((20 / 1.0) / (20 / 2.0)))
    for fig in (charts.tokens_vs_time(ar, sd), charts.running_speedup(ar, sd), charts.accepted_histogram([1, 2])):
        assert fig.data


