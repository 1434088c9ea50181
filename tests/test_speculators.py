"""EAGLE-3 heads in the speculators format: the config and the weight names both ways, `export --format speculators`
of the shipped head loaded back by `--draft` with every tensor equal and identical output (slow), and the real vLLM
(its own venv; skipped without it) serving the folder alone, its greedy tokens equal to ours on three prompts."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_vllm import NEEDS_VLLM

from specdemo.__main__ import main
from specdemo.measure.bench.vllm import VLLM_PYTHON_ENV
from specdemo.models import speculators
from specdemo.models.eagle3 import Eagle3Config, read_config, recorded_k

SHIPPED = Path(__file__).resolve().parent.parent / "specdemo" / "data" / "smollm2-135m-draft"


def test_config_round_trip_keeps_every_eagle3_field_and_names_the_verifier_and_k():
    """raw -> speculators -> raw parses to the same Eagle3Config; the speculators dict has what vLLM's
    SpeculatorsConfig.validate_speculators_config requires, with k and the verifier."""
    raw = json.loads((SHIPPED / "config.json").read_text())
    spec = speculators.from_raw(raw, 3, "org/target", ["LlamaForCausalLM"])
    sc = spec["speculators_config"]
    assert spec["speculators_model_type"] == "eagle3" and isinstance(spec["transformer_layer_config"], dict)
    assert sc["proposal_methods"][0]["speculative_tokens"] == 3 and sc["verifier"]["name_or_path"] == "org/target"
    assert speculators.is_speculators_eagle3(spec) and speculators.recorded_k(spec) == 3
    back = Eagle3Config.from_json(speculators.to_raw(spec))
    assert back == replace(Eagle3Config.from_json(raw), architecture="Eagle3LlamaForCausalLM")  # vLLM's name
    assert "norm_before_residual" in spec  # vLLM's default when it is absent (true) is not speculators' (false)


def test_weight_names_map_both_ways_and_verifier_copies_are_dropped():
    tensors = {"midlayer.mlp.up_proj.weight": torch.ones(1), "fc.weight": torch.ones(1), "d2t": torch.ones(1)}
    spec = speculators.to_speculators_tensors(tensors)
    assert set(spec) == {"layers.0.mlp.up_proj.weight", "fc.weight", "d2t"}
    assert speculators.to_raw_tensors({**spec, "verifier_norm.weight": torch.ones(1)}).keys() == tensors.keys()


@pytest.mark.slow
def test_export_speculators_then_draft_loads_it_losslessly(tmp_path, capsys):
    """`export --format speculators` of the shipped head, then the folder as a draft: it is an EAGLE-3 head with
    k = 2, every tensor equal to the shipped head's, and greedy decoding proposes and outputs the same tokens."""
    from specdemo.config import GenerationConfig
    from specdemo.drafters.eagle3 import load_eagle3
    from specdemo.drafters.resolve import resolve_draft
    from specdemo.engine import encode_prompt, speculative
    from specdemo.models.loading import load_model

    out = tmp_path / "head"
    assert main(["export", "--draft", "smollm2-135m-draft", "--out", str(out), "--k", "2",
                 "--format", "speculators"]) == 0
    assert f"vllm serve {out.resolve()}" in capsys.readouterr().out
    assert speculators.is_speculators_eagle3(json.loads((out / "config.json").read_text()))
    assert resolve_draft(str(out), "smollm2-135m").is_head and recorded_k(out) == 2 and read_config(out)
    target = load_model("smollm2-135m", device="cpu", dtype="fp32")
    ours, theirs = load_eagle3(SHIPPED, target), load_eagle3(out, target)
    a, b = ours.head.state_dict(), theirs.head.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    config = GenerationConfig(max_new_tokens=24, num_draft_tokens=2)
    ids = encode_prompt(target.tokenizer, "Write a haiku about rain")
    runs = [[(e.drafted, e.tokens) for e in speculative(target.model, target.tokenizer, d, ids, config)]
            for d in (ours, theirs)]
    assert runs[0] == runs[1]


@pytest.mark.slow
@NEEDS_VLLM
def test_vllm_serves_the_speculators_export_alone_with_our_greedy_output(tmp_path):
    """LLM(model=HEAD) with no target and no speculative_config: vLLM reads the verifier and k from the folder,
    drafts (its spec-decode counters move) and its greedy tokens equal our autoregressive tokens on three prompts."""
    from specdemo.config import GenerationConfig
    from specdemo.engine import autoregressive, encode_prompt, eos_ids
    from specdemo.measure.bench.vllm import (
        VllmOptions,
        build_request,
        driver_env,
        require_python,
        run_driver,
    )
    from specdemo.models.loading import load_model
    from specdemo.prompts import DEFAULT_PROMPTS, read_prompts

    head = tmp_path / "head"
    assert main(["export", "--draft", "smollm2-135m-draft", "--out", str(head), "--k", "2",
                 "--format", "speculators"]) == 0
    target = load_model("smollm2-135m", device="cpu", dtype="fp32")
    max_new = 32
    prompts = [(p.id, encode_prompt(target.tokenizer, p.prompt)) for p in read_prompts(DEFAULT_PROMPTS, limit=3)]
    config = GenerationConfig(max_new_tokens=max_new)
    ours = {pid: [t for e in autoregressive(target.model, target.tokenizer, ids, config) for t in e.tokens]
            for pid, ids in prompts}
    method = {"name": "speculators", "k": None, "speculative_config": None}
    request = build_request(str(head), prompts, sorted(eos_ids(target.model, target.tokenizer)), max_new, [method])
    result = run_driver(require_python(os.environ.get(VLLM_PYTHON_ENV)), request, tmp_path / "vllm",
                        driver_env(VllmOptions(), os.environ), 1800)
    (run,) = result["methods"]
    assert "error" not in run, run
    assert {p["id"]: p["token_ids"] for p in run["prompts"]} == ours
    assert sum(p["counters"]["num_drafts"] for p in run["prompts"]) > 0  # it speculated, with our head
