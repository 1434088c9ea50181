"""The benchmark run on tiny models: result rows, report keys and pooled aggregates, the anchors beside ours."""

import json

import pytest
import torch

from specdemo.config import GenerationConfig, SamplingConfig
from specdemo.drafters import ModelDrafter, NgramDrafter
from specdemo.engine.timing import ForwardTimer
from specdemo.measure.bench.outputs import markdown, write_outputs
from specdemo.measure.bench.report import build_report
from specdemo.measure.bench.run import bench_prompt
from specdemo.measure.bench.timing import target_modules
from specdemo.measure.compare import Pair
from specdemo.models.loading import LoadedModel
from specdemo.prompts import PromptItem

REQUIRED_ROW = {"id", "category", "k", "ar_tokens_per_s", "sd_tokens_per_s", "speedup", "mean_accepted",
                "acceptance_rate", "identical"}


def tiny_pair(model, tok, drafter, kind) -> Pair:
    return Pair(LoadedModel("tiny", model, tok, torch.device("cpu"), torch.float32, "folder"), drafter, kind, None)


def tiny_rows(pair, ks, anchors=True, config=GenerationConfig(max_new_tokens=10), rules=()):
    items = [PromptItem("a", "extractive", "w3 w5 w7 w3 w5 w9 w2"), PromptItem("b", "chat", "w1 w2 w3 w1 w2 w4"),
             PromptItem("c", "chat", "w9 w8 w7 w6")]
    timers = (ForwardTimer(target_modules(pair.target.model)), None)
    rows, runs = [], {}
    try:
        for it in items:
            ids = pair.target.tokenizer(it.prompt)["input_ids"]
            rows += bench_prompt(pair, it, ids, ks, config, timers, anchors, runs, rules=rules)
    finally:
        timers[0].remove()
    return rows, runs


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
    assert {"hf_generate_tokens_per_s", "ar_vs_hf_generate", "hf_assisted_speedup",
            "hf_prompt_lookup_speedup"} <= set(a)
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


def test_both_verification_rules_in_one_report(tiny_target, tiny_draft, tiny_tok):
    """--verification token,block: each prompt and k runs under each rule after one AR run; the report holds each
    rule's pooled figures at each k, and the markdown a table of them."""
    pair = tiny_pair(tiny_target, tiny_tok, ModelDrafter(tiny_draft), "model")
    config = GenerationConfig(max_new_tokens=10, sampling=SamplingConfig(1.0))
    rows, runs = tiny_rows(pair, [1, 3], anchors=False, config=config, rules=("token", "block"))
    assert [(r["k"], r["verification"]) for r in rows[:4]] == [(1, "token"), (1, "block"), (3, "token"), (3, "block")]
    assert len(runs[3]) == 3  # the first rule's runs feed the per-k theory
    report = build_report({"k": [1, 3]}, {}, rows)
    block = [r for r in rows if r["verification"] == "block" and r["k"] == 3]
    assert report["by_verification"]["block"]["3"]["mean_accepted"] == pytest.approx(
        sum(r["spec_tokens"] for r in block) / sum(r["steps"] for r in block))
    assert "| block | 3 |" in markdown(report)


def test_passes_the_hooks_miss_report_no_overhead(tiny_target, tiny_tok, monkeypatch):
    """Compiled passes (as CUDA graph replays) bypass the forward hooks that time them, and compiling with the hooks
    on traces them as nothing (it once failed on the clock and ran the rest uncompiled): the rows then carry no
    forward time or overhead for our runs (which would count the whole run but its prefill as overhead), the report
    none for them, and bench.md says why; the anchors keep theirs."""
    from specdemo.engine import graphs

    monkeypatch.setattr(graphs, "COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    graphs.attach(tiny_target, "compiled")
    try:
        rows, _ = tiny_rows(tiny_pair(tiny_target, tiny_tok, NgramDrafter(), "ngram"), [2])
    finally:
        graphs.detach(tiny_target)
        torch._dynamo.reset()
    assert all(r["runner"].startswith("static KV cache, compiled passes") for r in rows), rows[0]["runner"]
    assert not any(k in r for r in rows for k in ("ar_overhead_s", "sd_overhead_s", "sd_verify_logic_s"))
    report = build_report({"k": [2]}, {"cpu": "test"}, rows)
    assert "ar_ms_per_step" not in report["overhead"] and "hf_generate_ms_per_step" in report["overhead"]
    assert "bypassed the forward hooks" in markdown(report)
