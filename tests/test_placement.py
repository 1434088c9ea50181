"""Device maps (issue 31) with real accelerate on a tiny random llama saved to a folder: part of it on the CPU, part on
disk. Greedy losslessness and KV rollback across the hooks, the fast linears under them, the draft head reading
offloaded weights, the placement fields of the result JSON, the draft on its own device, and max-memory parsing."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import WORDS, save_tiny_folder, tiny_llama, tiny_tokenizer

from specdemo.config import (
    GenerationConfig,
    Placement,
    Runtime,
    parse_max_memory,
    placement_from,
)
from specdemo.drafters import ModelDrafter, NgramDrafter
from specdemo.engine import autoregressive, generated_ids, speculative
from specdemo.measure.compare import compare, load_pair, pair_placement
from specdemo.models.eagle3_head import build_head
from specdemo.models.loading import ModelLoadError, load_model
from specdemo.models.placement import (
    execution_device,
    is_offloaded,
    module_ranges,
    placement_line,
    weight_of,
)

PROMPT = "w3 w5 w7 w3 w5 w9 w2 w3 w5 w7 w3 w5"
CPU_ONLY = Runtime(fast_linear=False)


# ---- parsing ----

def test_max_memory_parses_into_accelerates_dict_with_int_gpu_keys():
    """GPU indices become ints (cuda:1 too), cpu and disk stay names, sizes keep their spelling."""
    pairs = parse_max_memory("0=20GiB, cuda:1=5GB,cpu=60GiB")
    assert pairs == ((0, "20GiB"), (1, "5GB"), ("cpu", "60GiB"))
    assert Placement("auto", pairs).max_memory_dict() == {0: "20GiB", 1: "5GB", "cpu": "60GiB"}
    assert parse_max_memory("cpu=1000000") == (("cpu", "1000000"),) and parse_max_memory("") == ()


@pytest.mark.parametrize("text", ["0:20GiB", "gpu=1GiB", "cpu=lots", "cpu=20XB", "cpu=", "cpu=1GiB,cpu=2GiB"])
def test_bad_max_memory_is_refused_with_the_expected_form(text):
    with pytest.raises(ValueError, match="max-memory"):
        parse_max_memory(text)


def test_placement_needs_a_known_device_map_for_limits():
    """Memory limits or an offload folder without a device map, or an unknown strategy, are refused."""
    with pytest.raises(ValueError, match="needs a device map"):
        placement_from(None, "cpu=1GiB")
    with pytest.raises(ValueError, match="needs a device map"):
        placement_from("", None, "/tmp/x")
    with pytest.raises(ValueError, match="unknown device map"):
        placement_from("everywhere")
    assert placement_from("Auto", "cpu=1GiB", " ").as_dict() == {"device_map": "auto", "max_memory": {"cpu": "1GiB"},
                                                                  "offload_folder": None}


def test_module_ranges_join_consecutive_numbered_siblings():
    names = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2", "model.layers.5", "lm_head"]
    assert module_ranges(names) == ["model.embed_tokens", "model.layers.0-2", "model.layers.5", "lm_head"]


# ---- a tiny model on the CPU and disk ----

@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A 6-layer tiny llama and its tokenizer, saved as a model folder."""
    path = tmp_path_factory.mktemp("tiny-target")
    save_tiny_folder(path, layers=6)
    return str(path)


@pytest.fixture(scope="module")
def draft_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-draft")
    tiny_llama(len(WORDS) + 1, seed=2, sharpness=8.0, layers=1).cpu().save_pretrained(path)
    tiny_tokenizer(WORDS).save_pretrained(path)
    return str(path)


def offload(tmp_path) -> Placement:
    """A CPU limit the embeddings and the first layers fit in; the rest of the model goes to disk."""
    return placement_from("sequential", "cpu=60KB", str(tmp_path / "offload"))


@pytest.fixture
def mapped(folder, tmp_path):
    return load_model(folder, device="cpu", runtime=CPU_ONLY, placement=offload(tmp_path))


def test_the_device_map_puts_part_of_the_model_on_disk(mapped):
    """Real accelerate: the embeddings on the CPU, later layers on disk (their weights on the meta device between
    passes), the inputs going to the CPU."""
    device_map = mapped.model.hf_device_map
    assert "disk" in device_map.values() and "cpu" in device_map.values()
    assert device_map["model.embed_tokens"] == "cpu"
    assert mapped.model.lm_head.weight.device.type == "meta" and is_offloaded(mapped.model.lm_head)
    assert execution_device(mapped.model) == torch.device("cpu") == mapped.device


def test_greedy_output_and_rollback_across_the_hooks_match_the_model_in_memory(mapped, folder, draft_folder):
    """AR on the offloaded target equals AR in memory; prompt lookup and a draft model on it give the same tokens,
    with rejections rolled back (the KV cache ends each step holding exactly the committed tokens but one)."""
    whole = load_model(folder, device="cpu", runtime=CPU_ONLY)
    ids = whole.tokenizer(PROMPT)["input_ids"]
    config = GenerationConfig(max_new_tokens=30, num_draft_tokens=3)
    reference = generated_ids(list(autoregressive(whole.model, whole.tokenizer, ids, config)))
    assert generated_ids(list(autoregressive(mapped.model, mapped.tokenizer, ids, config))) == reference
    draft = load_model(draft_folder, device="cpu", runtime=CPU_ONLY)
    for drafter in (NgramDrafter(), ModelDrafter(draft.model, mapped.device)):
        events = list(speculative(mapped.model, mapped.tokenizer, drafter, ids, config))
        assert generated_ids(events) == reference
        spec = [e for e in events if e.kind == "spec"]
        assert any(e.num_accepted < len(e.drafted) for e in spec), "no rejection: rollback untested"
        for e in spec:
            assert e.target_cache_length == len(ids) + e.num_generated - 1


def test_batched_decoding_across_the_hooks_matches_each_row_in_memory(mapped, folder, draft_folder):
    """The engine at a batch on the offloaded target: rows of mixed lengths, prompt lookup and a draft model
    with rejections, every row equal to the in-memory target's own greedy output for that prompt alone."""
    from specdemo.engine import decode, row_outputs

    whole = load_model(folder, device="cpu", runtime=CPU_ONLY)
    prompts = [whole.tokenizer(p)["input_ids"] for p in (PROMPT, "w4 w4 w1", "w9 w8 w7 w6 w5 w9 w8")]
    config = GenerationConfig(max_new_tokens=16, num_draft_tokens=3, use_chat_template=False)
    alone = [generated_ids(list(autoregressive(whole.model, whole.tokenizer, ids, config))) for ids in prompts]
    runs = {"ar": list(decode(mapped.model, mapped.tokenizer, prompts, config))}
    draft = load_model(draft_folder, device="cpu", runtime=CPU_ONLY)
    for name, drafter in (("ngram", NgramDrafter()), ("model", ModelDrafter(draft.model, mapped.device))):
        runs[name] = list(decode(mapped.model, mapped.tokenizer, prompts, config, drafter))
    for name, events in runs.items():
        assert row_outputs(events, len(prompts)) == alone, name
    assert any(n < len(d) for e in runs["model"] if e.kind == "spec" for n, d in zip(e.num_accepted, e.drafted)), \
        "no rejection: rollback untested"


def test_fast_linears_run_under_the_hooks_and_match(folder, tmp_path):
    """With fast linears on, offloaded linears are patched under accelerate's hook (no packed copy) and the logits
    match the unpatched offloaded model's."""
    fast = load_model(folder, device="cpu", runtime=Runtime(fast_linear=True), placement=offload(tmp_path))
    slow = load_model(folder, device="cpu", runtime=CPU_ONLY, placement=offload(tmp_path / "b"))
    head = fast.model.lm_head
    assert head._specdemo_fast and head._specdemo_packed is None and head._old_forward.__name__ == "_patched_forward"
    x = torch.tensor([fast.tokenizer(PROMPT)["input_ids"]])
    with torch.inference_mode():
        for rows in (1, 3, 12):
            a, b = fast.model(input_ids=x[:, :rows]).logits, slow.model(input_ids=x[:, :rows]).logits
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)


def test_a_draft_head_reads_the_offloaded_embeddings_and_head(mapped, folder):
    """An EAGLE-3 head built on an offloaded target (eagle3_head.build_head) gets the real weights (from the offload),
    not the meta placeholders: its lm_head starts as the target's rows, its embeddings are the target's."""
    whole = load_model(folder, device="cpu", runtime=CPU_ONLY)
    assert torch.equal(weight_of(mapped.model.lm_head), whole.model.lm_head.weight)
    subset = torch.tensor([0, 3, 5, 7])
    head = build_head(mapped.model, subset, (1, 2, 3))  # the default (2, 3, 3) of a 6-layer target is not distinct
    assert head.lm_head.weight.device.type == "cpu"
    assert torch.equal(head.lm_head.weight, whole.model.lm_head.weight[subset])
    assert torch.equal(head.target_embed, whole.model.get_input_embeddings().weight)


def test_result_json_says_where_each_part_and_the_draft_live(folder, draft_folder, tmp_path):
    """compare's result has placement.target (the device map as module ranges, parameters per device, the strategy
    and limits) and placement.draft (its device); the draft loads on the device asked for."""
    placement = offload(tmp_path)
    pair = load_pair(folder, "model", draft_folder, dtype="fp32", draft_device="cpu", runtime=CPU_ONLY,
                     placement=placement)
    result = compare(pair, PROMPT, GenerationConfig(max_new_tokens=12, num_draft_tokens=2, use_chat_template=False))
    assert result["identical"]
    where = json.loads(json.dumps(result["placement"]))  # plain JSON
    t = where["target"]
    assert t["device_map"] == "sequential" and t["max_memory"] == {"cpu": "60KB"}
    assert t["offload_folder"] == placement.offload_folder and t["execution_device"] == "cpu"
    assert "model.embed_tokens" in t["parts"]["cpu"] and "lm_head" in t["parts"]["disk"]
    assert sum(t["parameters"].values()) == sum(p.numel() for p in pair.target.model.parameters())
    assert where["draft"] == {"name": draft_folder, "kind": "ModelDrafter", "device": "cpu"}
    assert "disk: " in placement_line(where) and "draft on cpu" in placement_line(where)


def test_one_device_placement_is_the_whole_model(folder):
    pair = load_pair(folder, "ngram", device="cpu", runtime=CPU_ONLY)
    where = pair_placement(pair)
    assert where["target"]["parts"] == {"cpu": ["all"]} and where["target"]["device_map"] is None
    assert where["draft"]["device"] is None


def test_disk_offload_of_a_safetensors_folder_needs_no_offload_folder(folder):
    """transformers 5 reads disk-offloaded weights straight from the checkpoint's safetensors files, so a folder model
    offloads without --offload-folder (a hub or converted model in another format would need one)."""
    loaded = load_model(folder, device="cpu", runtime=CPU_ONLY, placement=placement_from("sequential", "cpu=60KB"))
    assert "disk" in loaded.model.hf_device_map.values()


def test_an_unknown_model_under_a_device_map_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="cannot load"):
        load_model(str(tmp_path), device="cpu", runtime=CPU_ONLY, placement=placement_from("auto"))


def test_cli_generate_json_with_a_device_map(folder, tmp_path, capsys):
    """`generate --device-map ... --json` runs the offloaded target and reports the placement."""
    from specdemo.__main__ import main

    rc = main(["generate", "--target", folder, "--drafter", "ngram", "--prompt", PROMPT, "--max-new-tokens", "8",
               "--no-chat-template", "--device-map", "sequential", "--max-memory", "cpu=60KB",
               "--offload-folder", str(tmp_path / "off"), "--json"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["identical"] and "disk" in result["placement"]["target"]["parts"]
