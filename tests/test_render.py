"""The token panels' HTML (specdemo.app.render): spans per token, rejected drafts in place, escaping, and the step
inspector's data on the speculative spans."""

from __future__ import annotations

import html
import json
import re

from specdemo.app.render import (
    INSPECTOR_JS,
    Segment,
    event_segments,
    segments_html,
    split_text,
    step_info,
)
from specdemo.engine import StepEvent
from specdemo.engine.events import Inspection


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



TOK = WordTokenizer([" w0", " w1", " w2", " w3", " w4", " <&\"w5>"])
REJECTED = StepEvent("spec", [1, 2, 5], " w1 w2 <&\"w5>", 0.1, 4, drafted=[1, 2, 3, 4], num_accepted=2, correction=5,
                     k=4, inspection=Inspection(top_ids=[[1, 0], [2, 0], [5, 3], [0, 1], [1, 2]],
                                                top_probs=[[0.9, 0.1], [0.8, 0.2], [0.7, 0.2], [0.5, 0.4], [0.6, 0.3]],
                                                token_probs=[0.9, 0.8, 0.2, 0.05], top2_gap=[2.2, 1.4, 1.25, 0.2, 0.7]),
                     draft_token_probs=[0.95, 0.9, 0.6, 0.5])


def test_step_info_explains_the_first_rejection():
    """Each drafted token's outcome with its p and q; at the first rejected position the target's top tokens (its
    correction first), the logit gap there, and the committed correction."""
    info = step_info(REJECTED, TOK, step=7, greedy=True)
    assert [d["outcome"] for d in info["drafted"]] == ["accepted", "accepted", "rejected", "discarded"]
    assert [(d["p"], d["q"]) for d in info["drafted"]][2] == (0.2, 0.6)
    assert info["position"] == 3 and not info["full"] and info["gap"] == 1.25
    assert info["top"] == [{"text": ' <&"w5>', "p": 0.7}, {"text": " w3", "p": 0.2}]
    assert (info["step"], info["committed"], info["committed_kind"], info["deterministic"]) == (
        7, ' <&"w5>', "correction", False)


def test_step_info_after_a_full_acceptance_shows_the_bonus_position():
    """All drafts kept: the top tokens are those at the bonus position; prompt lookup's q is None (q = 1)."""
    full = StepEvent("spec", [1, 2, 3], " w1 w2 w3", 0.1, 3, drafted=[1, 2], num_accepted=2, bonus=3, k=2,
                     inspection=Inspection([[1], [2], [3]], [[0.9], [0.8], [0.6]], [0.9, 0.8], []),
                     draft_token_probs=None)
    info = step_info(full, TOK, step=1, greedy=False)
    assert info["full"] and info["position"] == 3 and info["top"] == [{"text": " w3", "p": 0.6}]
    assert info["deterministic"] and info["committed_kind"] == "bonus" and info["gap"] is None
    assert info["rule"] == "token"  # an event without its rule recorded: what sampling used before there were two


def test_step_info_names_the_rule_that_decided_the_step():
    """The inspector says which rule decided a step: the engine's StepEvent.verification."""
    block = StepEvent("spec", [1, 5], " w1 <&\"w5>", 0.1, 2, drafted=[1, 2], num_accepted=1, correction=5, k=2,
                      inspection=Inspection([], [], [0.5, 0.1], []), draft_token_probs=[0.6, 0.3],
                      verification="block")
    assert step_info(block, TOK, step=2, greedy=False)["rule"] == "block"
    assert step_info(REJECTED, TOK, step=1, greedy=True)["rule"] == "greedy"
    assert "Decided by" in INSPECTOR_JS and "block verification (Sun et al.)" in INSPECTOR_JS


def test_speculative_spans_carry_their_step_and_the_first_one_its_info():
    """Every segment of a step has data-step; only the first holds data-info, escaped so that it parses back to
    step_info exactly; the text of every span stays escaped."""
    segments = event_segments(REJECTED, TOK, speculative=True, step=3)
    assert [s.step for s in segments] == [3] * 5 and [bool(s.info) for s in segments] == [True] + [False] * 4
    panel = segments_html(segments)
    assert panel.count('data-step="3"') == 5 and panel.count("data-info=") == 1
    attr = re.search(r'data-info="([^"]*)"', panel).group(1)
    assert json.loads(html.unescape(attr)) == step_info(REJECTED, TOK, 3, True)
    assert "&lt;&amp;&quot;w5&gt;" in panel and '<&"w5>' not in panel
    assert "data-step" not in segments_html(event_segments(REJECTED, TOK, speculative=False))


def test_the_inspector_script_writes_text_never_html():
    """The page script fills the inspector through textContent only, so token text cannot inject markup."""
    assert "textContent" in INSPECTOR_JS and "innerHTML" not in INSPECTOR_JS
    assert "#sd-panel span[data-step]" in INSPECTOR_JS and "inspector-body" in INSPECTOR_JS
