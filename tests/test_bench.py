"""The benchmark: prompt files, report keys and aggregates, honest transformers anchors, forward timing."""

import json

import pytest
import torch

from specdemo.bench import (ForwardTimer, assistant_k, bench_prompt, build_report, main, markdown, parse_ks,
                            target_modules, write_outputs)
from specdemo.compare import Pair
from specdemo.config import GenerationConfig
from specdemo.drafters import ModelDrafter, NgramDrafter
from specdemo.loading import LoadedModel
from specdemo.prompts import PromptItem, read_prompts

REQUIRED_ROW = {"id", "category", "k", "ar_tokens_per_s", "sd_tokens_per_s", "speedup", "mean_accepted",
                "acceptance_rate", "identical"}


def tiny_pair(model, tok, drafter, kind) -> Pair:
    return Pair(LoadedModel("tiny", model, tok, torch.device("cpu"), torch.float32, "folder"), drafter, kind, None)


def tiny_rows(pair, ks, anchors=True):
    items = [PromptItem("a", "extractive", "w3 w5 w7 w3 w5 w9 w2"), PromptItem("b", "chat", "w1 w2 w3 w1 w2 w4"),
             PromptItem("c", "chat", "w9 w8 w7 w6")]
    config = GenerationConfig(max_new_tokens=10)
    timers = (ForwardTimer(target_modules(pair.target.model)), None)
    rows, runs = [], {}
    try:
        for it in items:
            ids = pair.target.tokenizer(it.prompt)["input_ids"]
            rows += bench_prompt(pair, it, ids, ks, config, timers, anchors, runs)
    finally:
        timers[0].remove()
    return rows, runs


def test_read_prompts_both_shapes(tmp_path):
    """`prompt` strings and MT-Bench `turns` lists (first turn) both read; blank lines skipped; limit honoured."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": 7, "category": "chat", "prompt": "hello"}\n\n'
                    '{"question_id": 81, "category": "writing", "turns": ["first turn", "second"]}\n'
                    '{"prompt": "third"}\n')
    items = read_prompts(path)
    assert [(i.id, i.category, i.prompt) for i in items] == [
        ("7", "chat", "hello"), ("81", "writing", "first turn"), ("4", "uncategorized", "third")]
    assert len(read_prompts(path, limit=2)) == 2


def test_parse_ks():
    assert parse_ks("4") == [4]
    assert parse_ks("1, 2,4,8") == [1, 2, 4, 8]
    assert parse_ks("auto") == "auto"
    with pytest.raises(ValueError):
        parse_ks("0")


def test_report_keys_and_pooled_aggregates(tiny_target, tiny_tok, tmp_path):
    """bench.json has the required keys; overall and per-category speedups are total AR time / total SD time."""
    pair = tiny_pair(tiny_target, tiny_tok, NgramDrafter(), "ngram")
    rows, runs = tiny_rows(pair, [1, 3])
    assert len(rows) == 6 and sorted(runs) == [1, 3]
    report = build_report({"k": [1, 3]}, {"cpu": "test"}, rows)
    assert {"config", "machine", "results", "by_category", "overall", "anchors"} <= set(report)
    for r in report["results"]:
        assert REQUIRED_ROW <= set(r)
        assert r["identical"]  # greedy prompt lookup is lossless
    o = report["overall"]
    assert {"speedup", "mean_accepted", "acceptance_rate", "identical_fraction"} <= set(o)
    assert o["speedup"] == pytest.approx(sum(r["ar_seconds"] for r in rows) / sum(r["sd_seconds"] for r in rows))
    assert o["acceptance_rate"] == pytest.approx(sum(r["accepted"] for r in rows) / sum(r["drafted"] for r in rows))
    assert o["identical_fraction"] == 1.0
    chat = [r for r in rows if r["category"] == "chat"]
    assert report["by_category"]["chat"]["speedup"] == pytest.approx(
        sum(r["ar_seconds"] for r in chat) / sum(r["sd_seconds"] for r in chat))
    a = report["anchors"]
    assert {"hf_generate_tokens_per_s", "ar_vs_hf_generate", "hf_assisted_speedup", "hf_prompt_lookup_speedup"} <= set(a)
    assert a["hf_prompt_lookup_speedup"] > 0 and a["hf_assisted_speedup"] is None
    assert a["hf_generate_identical_fraction"] == 1.0  # transformers' greedy tokens are ours
    assert a["hf_prompt_lookup_identical_fraction"] == 1.0
    assert report["overhead"]["ar_ms_per_step"] >= 0 and 0 < report["overhead"]["ar_forward_fraction"] <= 1

    write_outputs(report, tmp_path)
    loaded = json.loads((tmp_path / "bench.json").read_text())
    assert loaded["overall"]["speedup"] == pytest.approx(o["speedup"])
    assert "| category |" in (tmp_path / "bench.md").read_text()
    assert ("Baseline check failed" in (tmp_path / "bench.md").read_text()) == (a["ar_vs_hf_generate"] < 0.95)
    slow = {**report, "anchors": {**a, "ar_vs_hf_generate": 0.56}}  # the H200 check's first run, before its fix
    assert "**Baseline check failed:** our autoregressive loop ran at 0.56×" in markdown(slow)
    assert "plotly" in (tmp_path / "bench.html").read_text().lower()


def test_assisted_anchor_rows(tiny_target, tiny_draft, tiny_tok):
    """With a draft model, the anchor is transformers' assisted generation, and its greedy tokens are ours."""
    pair = tiny_pair(tiny_target, tiny_tok, ModelDrafter(tiny_draft), "model")
    rows, _ = tiny_rows(pair, [2])
    assert all(r["hf_assisted_identical"] and "hf_prompt_lookup_seconds" not in r for r in rows)
    report = build_report({}, {}, rows)
    assert report["anchors"]["hf_assisted_speedup"] > 0 and report["anchors"]["hf_prompt_lookup_speedup"] is None


def test_assistant_config_gives_constant_k(tiny_draft):
    """assistant_k sets k, a constant schedule and no confidence stop where transformers reads them, then restores."""
    from transformers import GenerationConfig as HFConfig
    from transformers.generation.candidate_generator import AssistedCandidateGenerator

    gc = tiny_draft.generation_config
    before = (gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold)
    with assistant_k(tiny_draft, 3):
        assert (gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold) == (
            3, "constant", 0.0)
        gen = AssistedCandidateGenerator(torch.tensor([[1, 2, 3]]), tiny_draft, HFConfig(max_length=20), {})
        assert gen.num_assistant_tokens == 3
        assert not gen.assistant_generation_config.assistant_confidence_threshold
        assert gen.assistant_generation_config.num_assistant_tokens_schedule == "constant"
    assert (gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold) == before


def test_forward_timer_counts_nested_calls_once(tiny_target):
    """A CausalLM call runs its base model and head inside; the timer counts one call."""
    timer = ForwardTimer(target_modules(tiny_target))
    try:
        with torch.inference_mode():
            tiny_target(input_ids=torch.tensor([[1, 2, 3]]))
            tiny_target.model(input_ids=torch.tensor([[1, 2, 3]]))
    finally:
        timer.remove()
    assert timer.calls == 2 and timer.seconds > 0
    tiny_target(input_ids=torch.tensor([[1]]))
    assert timer.calls == 2  # hooks removed


def test_main_refuses_bad_k(capsys):
    assert main(["--k", "0", "--limit", "1", "--out", "/nonexistent/never"]) == 2
    assert "--k" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_cli_on_the_bundled_model(tmp_path):
    """The real CLI on 2 prompts: files written, greedy outputs identical, anchors present."""
    assert main(["--limit", "2", "--max-new-tokens", "16", "--k", "2", "--anchors", "--out", str(tmp_path),
                 "--quiet"]) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert len(report["results"]) == 2
    assert report["overall"]["identical_fraction"] == 1.0
    assert report["anchors"]["hf_generate_identical_fraction"] == 1.0
    assert (tmp_path / "bench.md").exists() and (tmp_path / "bench.html").exists()
