"""Suffix decoding's earlier answers in the app belong to one browser session: the session states (app.sessions), and
the handlers on a tiny model with the real suffix drafter, two visitors side by side: one never drafts from (nor
shows) the other's answers, a visitor's own later runs do draft from its earlier ones, Clear and a closed tab forget
them, and the calibration, the Tune-k sweep and the Batch tab add nothing; the inspector names each draft's source.
The browser's view: test_browser.py."""

from __future__ import annotations

import pickle
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from test_handlers import OUTPUTS, committed_text
from test_render import REJECTED, TOK

from specdemo.app import race, sessions
from specdemo.app.batch_tab import BatchHandlers, BatchOutputs
from specdemo.app.handlers import CLEARED, Handlers
from specdemo.app.race import AppLimits
from specdemo.app.render import DRAFT_SOURCES, INSPECTOR_JS, step_info
from specdemo.app.sessions import Forgetting, Session, SessionStates
from specdemo.config import MAX_K, MAX_K_ENGINE, SuffixConfig
from specdemo.drafters.suffix import SuffixCache, SuffixTree
from specdemo.engine import StepEvent
from specdemo.measure import compare
from specdemo.models.loading import LoadedModel

PROMPT = "w3 w5 w7 w3 w5 w9 w2 w3 w5"
OTHER = "w3 w5 w7 w3 w5 w9 w2 w3 w6"  # related: the same start, another end


# ---- the session states: no model ----

def test_each_session_has_its_own_cache_and_the_least_recently_used_goes_beyond_the_cap():
    caches = SessionStates(cap=2)
    a, b = caches.get("a"), caches.get("b")
    assert a is not b and caches.get("a") is a  # kept, and "a" is now the most recently used
    caches.get("c")
    assert "b" not in caches and "a" in caches and "c" in caches and len(caches) == 2
    assert caches.get(None) is not caches.get(None) and len(caches) == 2  # no session: a cache nobody keeps
    caches.forget(["a", "nobody"])
    assert "a" not in caches and caches.get("a") is not a


def test_the_servers_marks_go_with_the_next_compute_step_once():
    marks = Forgetting()
    marks.mark("a")
    marks.mark(None)  # no session: nothing to forget
    caches = SessionStates()
    old = caches.get("a")
    step = marks.session("b")
    assert step == Session("b", ("a",)) and pickle.loads(pickle.dumps(step)) == step  # it crosses to the worker
    assert marks.session("b") == Session("b", ())  # taken
    assert step.state(caches) is caches.get("b") and "a" not in caches and caches.get("a") is not old


# ---- the handlers on a tiny model, with the real suffix drafter ----

@pytest.fixture
def tiny_models(monkeypatch, tiny_target, tiny_tok):
    """compare.load_model gives the tiny target, so the real load_pair builds the real suffix drafter with the cache
    the app hands it; the prompt check reads the tiny tokenizer; a fresh set of session states."""
    loaded = LoadedModel("tiny", tiny_target, tiny_tok, torch.device("cpu"), torch.float32, "folder")
    monkeypatch.setattr(compare, "load_model", lambda *args, **kwargs: loaded)
    monkeypatch.setattr(race, "load_tokenizer", lambda name, runtime: (tiny_tok, 256))
    caches = SessionStates()
    monkeypatch.setattr(sessions, "STATES", caches)
    return caches


def through_a_process(fn):
    """Stands where the worker stands: what goes to the compute step and comes back is pickled, so the cache can only
    be found by the session's key, never passed by reference."""
    def run(*args):
        for item in fn(*pickle.loads(pickle.dumps(args))):
            yield pickle.loads(pickle.dumps(item))
    return run


def visitor(name: str):
    return SimpleNamespace(session_hash=name)  # what gradio's gr.Request carries


def race_run(h: Handlers, who, prompt: str = PROMPT, tokens: int = 24) -> dict:
    """A suffix decoding race as `who`; the last frame."""
    last = list(h.run_compare(prompt, "tiny", "suffix", "", 8, False, 0.0, 1.0, tokens, False, False, "token",
                              visitor=who))[-1]
    assert last["status"].startswith("Done"), last["status"]
    return last


def sources(last: dict) -> set[str]:
    return {e.draft_source for e in last["runs_state"].sd_events if e.kind == "spec" and e.drafted}


def test_two_visitors_never_draft_from_or_see_each_others_answers(tiny_models):
    """A runs a prompt; B then runs the same prompt and C a related one: each drafts from its own request only (no
    "earlier" draft, though A's answer would be the best match there); A's second run drafts from its first answer;
    after A's Clear, A's next run drafts from no earlier answer; a closed tab's cache goes too."""
    h = Handlers(OUTPUTS, AppLimits(device="cpu"), gpu=through_a_process)
    a, b = visitor("session-a"), visitor("session-b")
    first = race_run(h, a)
    assert "earlier" not in sources(first)  # the calibration run of this very prompt left nothing behind
    assert tiny_models.held("session-a") == 1 and "session-b" not in tiny_models
    for who, prompt in ((b, PROMPT), (visitor("session-c"), OTHER)):
        seen = race_run(h, who, prompt)
        assert sources(seen) and "earlier" not in sources(seen), sources(seen)
        assert '&quot;source&quot;: &quot;earlier&quot;' not in seen["sd_html"]
    assert '&quot;source&quot;: &quot;answer&quot;' in seen["sd_html"]  # how the panel writes a source
    assert tiny_models.held("session-a") == 1 and tiny_models.held("session-b") == tiny_models.held("session-c") == 1
    again = race_run(h, a)
    assert "earlier" in sources(again) and '&quot;source&quot;: &quot;earlier&quot;' in again["sd_html"]  # its own
    assert committed_text(again["sd_html"]) == first["result_json"]["sd"]["text"]  # lossless all the same
    assert h.clear_suffix_cache(a) == {"status": CLEARED}
    assert tiny_models.held("session-a") == 2  # the mark waits for the next compute step
    cleared = race_run(h, a)
    assert "earlier" not in sources(cleared) and tiny_models.held("session-a") == 1
    assert tiny_models.held("session-b") == 1  # B's cache is untouched by A's Clear
    h.forget_session(b)  # B closed the tab
    race_run(h, a, tokens=4)
    assert "session-b" not in tiny_models


def test_the_sweep_and_the_batch_tab_add_no_answer_to_any_cache(tiny_models):
    """Tune-k and the Batch tab decode the same prompts again and again: they draft from the session's cache but add
    nothing to it (nor to anyone else's), so no k or batch size drafts from another's answer."""
    h = Handlers(OUTPUTS, AppLimits(device="cpu"), gpu=through_a_process)
    a = visitor("session-a")
    race_run(h, a)
    before = tiny_models.get("session-a")
    sweep = list(h.run_sweep(PROMPT, "tiny", "suffix", "", 3, 0.0, 1.0, 12, "token", visitor=a))
    assert sweep[-1]["table"].startswith("Done"), sweep[-1]
    assert tiny_models.held("session-a") == 1 and tiny_models.get("session-a") is before
    assert before.find("suffix").recording
    batch = BatchHandlers(BatchOutputs("throughput_plot", "speedup_plot", "table"), [], h, AppLimits(device="cpu"),
                          gpu=through_a_process)
    frames = list(batch.run(f"{PROMPT}\n{OTHER}", False, "tiny", "suffix", "", 3, False, 0.0, 1.0, 8, 2, False,
                            visitor=visitor("session-c")))
    assert frames[-1]["table"].startswith("Done"), frames[-1]
    assert tiny_models.held("session-c") == 0 and tiny_models.held("session-a") == 1
    assert tiny_models.get("session-c").find("suffix").recording


# ---- the inspector's words and the k range ----

def test_the_inspector_says_where_each_draft_came_from():
    """step_info carries the step's draft source and its words (suffix decoding's three, the hybrid's two), and the
    name of a deterministic drafter for q; a step that drafted nothing names no source."""
    for source in ("prompt", "answer", "earlier", "lookup", "model"):
        info = step_info(replace(REJECTED, draft_source=source), TOK, 1, True)
        assert info["source"] == source and info["from"] == DRAFT_SOURCES[source]
        assert info["model_free"] == ("suffix decoding" if source in ("prompt", "answer", "earlier") else
                                      "prompt lookup")
    assert step_info(REJECTED, TOK, 1, True)["from"] is None  # a drafter with one source
    empty = StepEvent("spec", [1], " w1", 0.1, 1, drafted=[], num_accepted=0, k=4, draft_source="earlier")
    assert step_info(empty, TOK, 1, True)["from"] is None
    assert "earlier answer in this browser session" in DRAFT_SOURCES["earlier"]
    assert "Drafted from: " in INSPECTOR_JS and "info.model_free" in INSPECTOR_JS


def test_the_apps_k_range_holds_suffix_decodings_longest_draft():
    """Under the app's options (config.SuffixConfig's defaults) a draft is at most max_spec_factor (2) × its match
    and the match plus the draft at most the tree depth (24): 16 tokens, within the app's k range, whatever k
    allows."""
    config = SuffixConfig()
    tree = SuffixTree(config.max_tree_depth)
    text = list(range(200))
    tree.extend(0, text)
    longest = max(len(tree.speculate(text[:n], MAX_K_ENGINE, config).tokens) for n in range(2, 60))
    assert longest == 16 <= MAX_K
    assert SuffixCache().recording
