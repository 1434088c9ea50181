"""The drafter registry: every registered kind (the toy one conftest registers among them) reaches the CLI, the
bench, serve-config, the app, compare and every losslessness test; a kind's flags set its options, and what it keeps
across requests lives in its caller's SharedState; drafters.resolve.resolve_draft tells the shipped draft, EAGLE-3
heads and causal LMs apart by their files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import test_batch
import test_engine
import torch
from bigram_drafter import BigramDrafter
from conftest import drafter_cases, loaded, random_head, tiny_llama
from test_eagle3 import LAYERS, VOCAB

from specdemo.config import TRAINED_DRAFT_ID, GenerationConfig
from specdemo.drafters import registry
from specdemo.drafters.base import SharedState
from specdemo.drafters.resolve import (
    DRAFTS,
    EAGLE3,
    LM,
    TRAINED,
    DraftError,
    resolve_draft,
)
from specdemo.engine import autoregressive, generated_ids, speculative
from specdemo.models.eagle3 import save_eagle3

TOY = "bigram"  # conftest's toy kind: tests/bigram_drafter.py and one register(...) call
PROMPT = [5, 6, 7, 5, 6, 8, 9, 5, 6]


def test_the_builtin_kinds_in_order():
    """model, ngram, hybrid, suffix, as the app and the CLI list them, with the app's names."""
    assert registry.names()[:4] == ("model", "ngram", "hybrid", "suffix")
    assert [k.label for k in registry.kinds()[:4]] == ["draft model", "prompt lookup", "draft + lookup",
                                                       "suffix decoding"]
    assert [k.needs_draft for k in registry.kinds()[:4]] == [True, False, True, False]
    with pytest.raises(ValueError, match="unknown drafter 'magic'; choose one of model, ngram, hybrid, suffix"):
        registry.get("magic")
    with pytest.raises(ValueError, match="already registered"):
        registry.register(registry.get("ngram"))


def test_registry_imports_nothing_heavy():
    """registry and drafts import neither torch nor gradio: the factories import when they build."""
    code = ("import sys, specdemo.drafters.registry, specdemo.drafters.resolve; "
            "print(sorted({'torch', 'gradio'} & set(sys.modules)))")
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root).stdout
    assert out.strip() == "[]"


def flags_of(parser) -> set[str]:
    return set(parser._option_string_actions)


@pytest.mark.parametrize("name", registry.names())
def test_every_kind_reaches_the_cli_the_bench_and_serve_config(name, capsys):
    """generate's --drafter lists it with its help, and generate, bench and serve-config take its flags; serve-config
    maps it to its vLLM method (a kind that takes a draft: the target's trained draft's, eagle3)."""
    from specdemo.__main__ import main
    from specdemo.measure.bench.cli import parser

    kind = registry.get(name)
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert name in text.split("--drafter {")[1].split("}")[0].split(",") and " ".join(kind.help.split()) in text
    assert name in parser()._option_string_actions["--drafter"].choices
    assert {f.name for f in kind.flags if "bench" in f.commands} <= flags_of(parser())
    for command in ("generate", "serve-config"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = capsys.readouterr().out
        assert all((f.name in text) == (command in f.commands) for f in kind.flags)
    assert main(["serve-config", "--drafter", name, "--k", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"] == (kind.vllm_method or "eagle3") == out["speculative_config"]["method"]


@pytest.mark.parametrize("name", registry.names())
def test_every_kind_reaches_the_app(name):
    """The app's Drafter radio offers it under its label; make_request accepts it and drops a draft it takes none of."""
    import gradio as gr

    from specdemo.app.race import AppLimits, make_request
    from specdemo.app.ui import build_demo

    demo = build_demo()
    radios = [b for b in demo.blocks.values() if isinstance(b, gr.Radio) and b.label == "Drafter"]
    assert len(radios) == 1
    kind = registry.get(name)
    assert (kind.label, name) in [tuple(c) for c in radios[0].choices]
    request = make_request("a prompt", "", name, "some/draft", 3, False, 0.0, 1.0, 16, AppLimits())
    assert request.drafter == name and (request.draft is None) == (not kind.needs_draft)


def test_every_kind_is_in_every_losslessness_test():
    """The greedy and sampling tests run the cases conftest builds for every registered kind: one per model-free
    kind through its own factory, the tiny factories of the others (an EAGLE-3 head among the model's)."""
    tests = (test_engine.test_greedy_speculative_equals_autoregressive,
             test_engine.test_sampled_distribution_matches_target,
             test_batch.test_greedy_batch_equals_each_rows_single_sequence_output)
    for test in tests:
        (cases,) = [m.args[1] for m in test.pytestmark if m.name == "parametrize" and m.args[0] == "case"]
        assert [c.kind for c in cases if c.id == c.kind] == list(registry.names())  # each kind, in order
    assert {"eagle3", "hybrid-eagle3", "suffix", "hybrid-suffix", TOY} <= {c.id for c in drafter_cases()}


def test_a_new_kind_takes_its_flag_and_keeps_state_across_requests(tiny_target, tiny_tok, capsys):
    """The toy kind: its flag, parsed by generate, bench or serve-config, reaches its drafter through compare's
    make_drafter (a bad value is refused by its options' check); two requests built with one SharedState share its
    bigrams, so the second drafts from the first's answer and has more drafts accepted (both lossless); a paused run
    and a forgotten state leave nothing behind."""
    from specdemo.__main__ import main
    from specdemo.measure.bench.cli import bench_config, parser
    from specdemo.measure.compare import make_drafter

    options = bench_config(parser().parse_args(["--drafter", TOY, "--bigram-max-tokens", "2"]), env={}).drafter_options
    assert options[TOY].max_tokens == 2
    assert main(["generate", "--prompt", "w1", "--drafter", TOY, "--bigram-max-tokens", "0"]) == 2
    assert "--bigram-max-tokens=0 must be >= 1" in capsys.readouterr().err
    assert main(["serve-config", "--drafter", TOY, "--bigram-max-tokens", "2", "--json"]) == 0
    shared, target = SharedState(), loaded(tiny_target, tiny_tok)
    config = GenerationConfig(max_new_tokens=24, num_draft_tokens=4)
    ar = generated_ids(list(autoregressive(tiny_target, tiny_tok, PROMPT, config)))

    def accepted(drafter) -> int:
        events = list(speculative(tiny_target, tiny_tok, drafter, PROMPT, config))
        assert generated_ids(events) == ar
        return sum(e.num_accepted for e in events if e.kind == "spec")

    first, name, calibration = make_drafter(target, TOY, None, drafter_options=options, shared=shared)
    assert isinstance(first, BigramDrafter) and first.options.max_tokens == 2 and name is calibration is None
    cold = accepted(first)
    second = make_drafter(target, TOY, None, drafter_options=options, shared=shared)[0]
    assert second.memory is first.memory and len(shared) == 0  # the first answer is learned when the next opens
    with second.paused():
        accepted(second)
    warm = accepted(second)
    assert len(shared) == 1 and warm > cold  # the first answer only: the paused run left nothing
    second.forget()
    assert len(shared) == 0 and not first.memory.follows


# ---- resolve_draft ----

def test_resolve_the_shipped_draft_by_id_and_by_folder():
    """The shipped id and its folder are both the trained draft, an EAGLE-3 head served from that folder."""
    by_id = resolve_draft(TRAINED_DRAFT_ID, None)
    assert (by_id.kind, by_id.path, by_id.local, by_id.is_head) == (TRAINED, DRAFTS / TRAINED_DRAFT_ID, True, True)
    folder = str(DRAFTS / TRAINED_DRAFT_ID)
    by_folder = resolve_draft(folder, None)
    assert (by_folder.kind, by_folder.name, by_folder.vllm_method) == (TRAINED, folder, "eagle3")
    assert resolve_draft(None, "smollm2-135m").name == TRAINED_DRAFT_ID  # the bundled target's default draft


def test_resolve_an_eagle3_folder_a_causal_lm_and_neither(tmp_path):
    """A saved EAGLE-3 head is EAGLE3 whatever its folder's name; a saved causal LM is LM (draft_model in vLLM); a
    folder without a config.json, or no draft at all, is refused with a reason."""
    target = tiny_llama(VOCAB, seed=1, layers=LAYERS)
    save_eagle3(random_head(target), tmp_path / "plain-name")
    head = resolve_draft(str(tmp_path / "plain-name"), None)
    assert (head.kind, head.path, head.sglang_method) == (EAGLE3, tmp_path / "plain-name", "EAGLE3")
    with torch.no_grad():
        tiny_llama(VOCAB, seed=2).save_pretrained(tmp_path / "lm")
    lm = resolve_draft(str(tmp_path / "lm"), None)
    assert (lm.kind, lm.is_head, lm.vllm_method, lm.sglang_method) == (LM, False, "draft_model", "STANDALONE")
    (tmp_path / "neither").mkdir()
    (tmp_path / "neither" / "weights.safetensors").write_bytes(b"")
    with pytest.raises(DraftError, match="is not an EAGLE-3 head .* nor a causal LM: the folder has no config.json"):
        resolve_draft(str(tmp_path / "neither"), None)
    with pytest.raises(DraftError, match="no draft model given for target 'some/target'"):
        resolve_draft(None, "some/target")
