"""EAGLE-3 checkpoints as files (specdemo.models.eagle3) on a tiny random llama: the config's keys and detection,
save/load and export -> load with identical proposals, heads for another target and unsupported variants refused by
name, compare.make_drafter telling a head's folder by its config, hub ids cached and uncached, export's files and
refusals, and the serve hint after Tune k. Drafting with a head: test_eagle3.py."""

import json
import shlex

import pytest
import torch
from conftest import random_head, tiny_llama
from test_eagle3 import GREEDY, LAYERS, PROMPT, SAMPLED, VOCAB, proposals

from specdemo.config import GenerationConfig, Runtime
from specdemo.drafters.eagle3 import Eagle3Drafter
from specdemo.engine import autoregressive, generated_ids, speculative
from specdemo.models.eagle3 import Eagle3Config, Eagle3FormatError, is_eagle3, save_eagle3
from specdemo.models.eagle3_head import load_head


def test_config_json_has_the_engines_keys(target8):
    """config.json names the EAGLE-3 architecture, both vocab sizes, the target's hidden size and eagle_config;
    default aux ids are left out (vLLM and SGLang read explicit ids differently, the default the same)."""
    c = Eagle3Config.for_target(target8.config, 60)
    d = c.to_json()
    assert d["architectures"] == ["LlamaForCausalLMEagle3"] and d["num_hidden_layers"] == 1
    assert (d["vocab_size"], d["draft_vocab_size"], d["target_hidden_size"]) == (VOCAB, 60, 32)
    assert d["eagle_config"] == {"use_aux_hidden_state": True} and d["tie_word_embeddings"] is False
    assert c.resolve_aux(LAYERS) == (2, 4, 5)
    explicit = Eagle3Config.for_target(target8.config, 60, (1, 3, 6)).to_json()
    assert explicit["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]
    assert Eagle3Config.from_json(d) == c and is_eagle3(d) and not is_eagle3(target8.config.to_dict())


def test_save_load_round_trip_gives_identical_proposals(target8, tmp_path):
    """A saved head loads back (parameter names = checkpoint names) and proposes the same tokens and q."""
    head = random_head(target8)
    save_eagle3(head, tmp_path, dtype=torch.float32)
    from safetensors.torch import load_file

    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
            "midlayer.self_attn.q_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
    assert "embed_tokens.weight" not in names  # borrowed from the target
    assert load_file(str(tmp_path / "model.safetensors"))["midlayer.self_attn.q_proj.weight"].shape[1] == 64  # 2H
    loaded, _ = load_head(tmp_path, target8)
    ids = PROMPT + [12, 13]
    for sampling in (GREEDY, SAMPLED):
        a = proposals(Eagle3Drafter(head), target8, ids, sampling=sampling)
        b = proposals(Eagle3Drafter(loaded), target8, ids, sampling=sampling)
        assert a.tokens == b.tokens and len(a.tokens) == 4
        if a.probs is not None:
            assert torch.allclose(a.probs, b.probs, atol=1e-5)


def test_a_head_for_another_target_is_refused(target8, tmp_path):
    """Loading a head on a target with another vocabulary, width or too few layers says why."""
    save_eagle3(random_head(target8), tmp_path)
    with pytest.raises(Eagle3FormatError, match="for another target.*vocab_size 100"):
        load_head(tmp_path, tiny_llama(VOCAB + 5, seed=1, layers=LAYERS))
    with pytest.raises(Eagle3FormatError, match="2 layers"):
        load_head(tmp_path, tiny_llama(VOCAB, seed=1, layers=2))


def test_unsupported_variants_are_refused():
    """A multi-layer head or a norm_before_fc head is refused by name, not run wrongly."""
    base = Eagle3Config.for_target(tiny_llama(VOCAB, seed=1, layers=LAYERS).config, 60).to_json()
    with pytest.raises(Eagle3FormatError, match="num_hidden_layers 2"):
        Eagle3Config.from_json({**base, "num_hidden_layers": 2})
    with pytest.raises(Eagle3FormatError, match="norm_before_fc"):
        Eagle3Config.from_json({**base, "norm_before_fc": True})
    with pytest.raises(Eagle3FormatError, match="not an EAGLE-3 head"):
        Eagle3Config.from_json({**base, "architectures": ["LlamaForCausalLM"]})
    assert json.loads(json.dumps(base))  # plain JSON


def loaded_target(model, tok):
    from specdemo.models.loading import LoadedModel

    return LoadedModel("tiny-target", model, tok, model.device, model.dtype, "folder")


def test_make_drafter_detects_an_eagle3_folder_from_its_config(target8, tok100, tmp_path):
    """compare.make_drafter (the CLI's --draft, the bench, the app) turns a folder whose config.json is an EAGLE-3
    head into an Eagle3Drafter, alone or inside the hybrid, with the head's recorded k; the folder's name is not
    read."""
    from specdemo.drafters import HybridDrafter
    from specdemo.measure.compare import drafter_k, make_drafter

    folder = tmp_path / "any-name"
    save_eagle3(random_head(target8), folder, meta={"num_speculative_tokens": 3})
    target = loaded_target(target8, tok100)
    drafter, name, _ = make_drafter(target, "model", str(folder))
    assert isinstance(drafter, Eagle3Drafter) and name == str(folder) and drafter_k(drafter) == 3
    assert drafter.target_layers == (2, 4, 5)
    hybrid, _, calibration = make_drafter(target, "hybrid", str(folder))
    assert isinstance(hybrid, HybridDrafter) and isinstance(hybrid.model, Eagle3Drafter) and calibration is not None
    config = GenerationConfig(max_new_tokens=30, num_draft_tokens=3)
    ar = generated_ids(list(autoregressive(target8, tok100, PROMPT * 2, config)))
    assert generated_ids(list(speculative(target8, tok100, hybrid, PROMPT * 2, config))) == ar


def test_make_drafter_says_a_folder_without_a_config_is_no_draft(target8, tok100, tmp_path):
    """A folder that is neither an EAGLE-3 head nor a causal LM (no config.json) is refused by name, before any
    loader guesses at it."""
    from specdemo.measure.compare import make_drafter
    from specdemo.models.loading import ModelLoadError

    (tmp_path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="is not an EAGLE-3 head .*LlamaForCausalLMEagle3.* nor a causal LM"):
        make_drafter(loaded_target(target8, tok100), "model", str(tmp_path))


def test_hub_ids_detected_from_the_cached_config_and_offline_fails_clearly(target8, tok100, tmp_path, monkeypatch):
    """A hub id whose cached config.json is an EAGLE-3 head loads from the hub cache offline; an uncached hub id
    offline fails with the loader's usual clear message."""
    from huggingface_hub import constants

    from specdemo.measure.compare import make_drafter
    from specdemo.models.loading import ModelLoadError

    snapshot = tmp_path / "hub" / "models--someone--tiny-eagle3" / "snapshots" / ("0" * 40)
    save_eagle3(random_head(target8), snapshot)
    (tmp_path / "hub" / "models--someone--tiny-eagle3" / "refs").mkdir()
    (tmp_path / "hub" / "models--someone--tiny-eagle3" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    offline = Runtime(hub_offline=True)
    drafter, _, _ = make_drafter(loaded_target(target8, tok100), "model", "someone/tiny-eagle3", runtime=offline)
    assert isinstance(drafter, Eagle3Drafter)
    with pytest.raises(ModelLoadError, match="unreachable"):
        make_drafter(loaded_target(target8, tok100), "model", "someone/not-cached-eagle3", runtime=offline)


def test_export_cli_writes_checkpoint_and_flags_and_round_trips(target8, tok100, tmp_path, capsys):
    """`export` writes config.json, model.safetensors, speculative_config.json and sglang.txt with the engines' keys;
    the exported head, loaded back by the EAGLE-3 loader, proposes exactly what the original head proposes."""
    from specdemo.__main__ import main as cli_main

    head = random_head(target8, seed=2)
    save_eagle3(head, tmp_path / "trained")
    out = tmp_path / "exported"
    assert cli_main(["export", "--draft", str(tmp_path / "trained"), "--out", str(out), "--k", "3"]) == 0
    assert "vllm serve" in capsys.readouterr().out
    written = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "speculative_config.json", "sglang.txt"} <= written
    spec = json.loads((out / "speculative_config.json").read_text())
    assert spec == {"method": "eagle3", "model": str(out.resolve()), "num_speculative_tokens": 3}
    flags = shlex.split((out / "sglang.txt").read_text().splitlines()[-1])
    assert flags[flags.index("--speculative-algorithm") + 1] == "EAGLE3"
    assert flags[flags.index("--speculative-draft-model-path") + 1] == str(out.resolve())
    assert [flags[flags.index(f) + 1] for f in ("--speculative-num-steps", "--speculative-eagle-topk",
                                                 "--speculative-num-draft-tokens")] == ["3", "1", "4"]
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    back, _ = load_head(out, target8)
    original, _ = load_head(tmp_path / "trained", target8)  # the same fp16 weights the export started from
    for sampling in (GREEDY, SAMPLED):
        a = proposals(Eagle3Drafter(original), target8, PROMPT + [12], k=5, sampling=sampling, seed=3)
        b = proposals(Eagle3Drafter(back), target8, PROMPT + [12], k=5, sampling=sampling, seed=3)
        assert a.tokens == b.tokens
    from specdemo.measure.compare import drafter_k, make_drafter

    drafter, _, _ = make_drafter(loaded_target(target8, tok100), "model", str(out))
    assert drafter_k(drafter) == 3  # export's k is the exported head's recorded k
    assert drafter.min_confidence == 0.0
    gated = tmp_path / "gated"
    assert cli_main(["export", "--draft", str(out), "--out", str(gated), "--min-confidence", "0.8"]) == 0
    assert make_drafter(loaded_target(target8, tok100), "model", str(gated))[0].min_confidence == 0.8
    assert cli_main(["export", "--draft", str(gated), "--out", str(tmp_path / "ungated"), "--min-confidence", "0"]) == 0
    assert make_drafter(loaded_target(target8, tok100), "model", str(tmp_path / "ungated"))[0].min_confidence == 0.0
    capsys.readouterr()
    assert cli_main(["export", "--draft", str(out), "--out", str(tmp_path / "bad"), "--min-confidence", "1.5"]) != 0
    assert "min_confidence must be in [0, 1), got 1.5" in capsys.readouterr().err


def test_export_refuses_what_is_not_an_eagle3_head(target8, tmp_path):
    """A folder without a config.json is no draft at all, and export says so; a plain draft LM is pointed to
    serve-config."""
    from specdemo.serve.export import export_eagle3

    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "weights.safetensors").write_bytes(b"")
    with pytest.raises(Eagle3FormatError, match="not an EAGLE-3 head .*LlamaForCausalLMEagle3.* nor a causal LM"):
        export_eagle3(str(tmp_path / "other"), tmp_path / "out")
    target8.config.save_pretrained(tmp_path / "lm")
    with pytest.raises(Eagle3FormatError, match="not an EAGLE-3 head.*serve-config"):
        export_eagle3(str(tmp_path / "lm"), tmp_path / "out")


def test_serve_hint_after_tune_k_names_k_and_the_commands(target8, tmp_path):
    """After Tune k the app shows how to serve an EAGLE-3 draft at the tuned k (export, vllm serve, SGLang) and
    nothing for other drafts."""
    from specdemo.serve.export import serve_hint

    save_eagle3(random_head(target8), tmp_path / "head")
    hint = serve_hint("smollm2-135m", str(tmp_path / "head"), 3)
    assert "k = 3 in vLLM" in hint and "python -m specdemo export" in hint and "vllm serve" in hint
    assert '"num_speculative_tokens":3' in hint and "--speculative-algorithm EAGLE3" in hint
    target8.config.save_pretrained(tmp_path / "lm")
    assert serve_hint("smollm2-135m", str(tmp_path / "lm"), 3) is None
