"""The page without a server: the token rendering and charts it shows. The handlers' tests are in
test_handlers.py."""

from __future__ import annotations

import pytest

from specdemo import charts
from specdemo.engine import StepEvent
from specdemo.render import Segment, event_segments, segments_html, split_text

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


