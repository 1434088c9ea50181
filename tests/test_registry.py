"""The drafter registry: a kind registered once reaches the CLI, the bench, the app, the request checks, compare and
serve-config; drafts.resolve_draft tells the shipped draft, EAGLE-3 heads and causal LMs apart by their files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama
from test_eagle3 import LAYERS, VOCAB, random_head

from specdemo.config import TRAINED_DRAFT_ID, GenerationConfig
from specdemo.drafters import Drafter, DraftRequest, Proposal, registry
from specdemo.drafters.registry import DrafterKind
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

TOY = "repeat-last"


class RepeatLast(Drafter):
    """Proposes the context's last token again, k times (deterministic: q = 1)."""

    name = TOY

    def begin(self, prompts, target_hidden=None) -> None:
        pass

    def propose(self, request: DraftRequest) -> list[Proposal]:
        return [Proposal(tokens=[ids[-1]] * k) for ids, k in zip(request.ids, request.ks)]


@pytest.fixture
def toy_kind():
    """A toy kind registered for one test, removed after, so other tests never see it."""
    kind = registry.register(DrafterKind(TOY, "repeat the last token", lambda target, draft, options: (
        RepeatLast(), None, None), needs_draft=False, vllm_method="ngram", sglang_method="NGRAM",
        help="proposes the last token again"))
    yield kind
    registry.unregister(TOY)
    assert TOY not in registry.names()


def test_the_builtin_kinds_in_order():
    """model, ngram, hybrid, as the app and the CLI list them, with the app's names."""
    assert registry.names()[:3] == ("model", "ngram", "hybrid")
    assert [k.label for k in registry.kinds()[:3]] == ["draft model", "prompt lookup", "draft + lookup"]
    assert [k.needs_draft for k in registry.kinds()[:3]] == [True, False, True]
    with pytest.raises(ValueError, match="unknown drafter 'magic'; choose one of model, ngram, hybrid"):
        registry.get("magic")
    with pytest.raises(ValueError, match="already registered"):
        registry.register(registry.get("ngram"))


def test_registry_imports_nothing_heavy():
    """registry and drafts import neither torch nor gradio: the factories import when they build."""
    code = "import sys, specdemo.drafters.registry, specdemo.drafters.resolve; print(sorted({'torch', 'gradio'} & set(sys.modules)))"
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root).stdout
    assert out.strip() == "[]"


def test_a_registered_kind_reaches_the_cli_and_the_bench(toy_kind, capsys):
    """generate's and serve-config's --drafter list it with its help; the bench's parser accepts it."""
    from specdemo.__main__ import main
    from specdemo.measure.bench.cli import parser

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "{model,ngram,hybrid,suffix,repeat-last}" in text and "proposes the last token again" in text
    assert parser()._option_string_actions["--drafter"].choices[-1] == TOY
    assert parser().parse_args(["--drafter", TOY]).drafter == TOY


def test_a_registered_kind_reaches_the_app(toy_kind):
    """The app's Drafter radio offers it under its label; make_request accepts it and drops a draft it takes none of."""
    import gradio as gr

    from specdemo.app.race import AppLimits, make_request
    from specdemo.app.ui import build_demo

    demo = build_demo()
    radios = [b for b in demo.blocks.values() if isinstance(b, gr.Radio) and b.label == "Drafter"]
    assert len(radios) == 1
    assert [tuple(c) for c in radios[0].choices][-1] == ("repeat the last token", TOY)
    request = make_request("a prompt", "", TOY, "some/draft", 3, False, 0.0, 1.0, 16, AppLimits())
    assert request.drafter == TOY and request.draft is None


def test_a_registered_kind_reaches_compare_and_serve_config(toy_kind, tiny_target, tiny_tok, capsys):
    """compare.make_drafter builds it through its factory, and greedy speculative decoding with it equals the
    target's own output; serve-config maps it to its vLLM and SGLang methods and refuses a --draft for it."""
    from specdemo.__main__ import main
    from specdemo.measure.compare import make_drafter

    drafter, name, calibration = make_drafter(None, TOY, None)
    assert isinstance(drafter, RepeatLast) and name is None and calibration is None
    config, prompt = GenerationConfig(max_new_tokens=20, num_draft_tokens=3), [5, 6, 7, 5, 6]
    ar = generated_ids(list(autoregressive(tiny_target, tiny_tok, prompt, config)))
    assert generated_ids(list(speculative(tiny_target, tiny_tok, drafter, prompt, config))) == ar
    assert main(["serve-config", "--drafter", TOY, "--k", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"] == "ngram" and out["speculative_config"]["method"] == "ngram"
    assert "--speculative-algorithm NGRAM" in out["sglang"]
    assert main(["serve-config", "--drafter", TOY, "--draft", "x"]) == 2
    assert f"--drafter {TOY} (repeat the last token) uses none" in capsys.readouterr().err


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
