"""The batch-size sweep on tiny models: shared rows, pooled points, generate on the same padded batch, auto k per
batch size, the crossover, and the bench report (bench.json keys, bench.md, bench.html)."""

import json

import pytest
import torch

from specdemo.config import GenerationConfig
from specdemo.drafters import ModelDrafter, NgramDrafter
from specdemo.engine import eos_ids
from specdemo.measure.batch_sizes import (
    BatchPoint,
    BatchSweep,
    batches,
    crossover,
    crossover_interpolated,
    hf_generate_batch,
    iter_batch_sweep,
    run_batch_ar,
    shared_rows,
)
from specdemo.measure.bench.anchors import hf_kwargs
from specdemo.measure.bench.batch_report import (
    batch_baseline_warning,
    batch_markdown,
    build_batch_report,
    write_batch_outputs,
)
from specdemo.measure.bench.batch_run import batch_k, parse_batch_sizes
from specdemo.measure.bench.cli import batch_summary_lines
from specdemo.measure.compare import Pair
from specdemo.models.loading import LoadedModel

PROMPTS = [[3, 5, 7, 3, 5, 9, 2], [4, 4, 1], [9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 8], [2], [6, 6, 6, 1, 2]]
KEYS = {"ar_tokens_per_s", "sd_tokens_per_s", "speedup", "mean_accepted", "identical_fraction", "verify_cost"}


def tiny_pair(model, tok, drafter, kind) -> Pair:
    return Pair(LoadedModel("tiny", model, tok, torch.device("cpu"), torch.float32, "folder"), drafter, kind, None)


def test_every_batch_size_runs_the_same_full_batches():
    rows = shared_rows(PROMPTS, [1, 2, 4])
    assert rows == PROMPTS[:4]  # 5 prompts cut to a multiple of 4
    assert [len(b) for b in batches(rows, 2)] == [2, 2]
    cycled = shared_rows(PROMPTS[:3], [1, 8])  # fewer prompts than the largest batch: cycled to one full batch
    assert cycled == (PROMPTS[:3] * 3)[:8]
    with pytest.raises(ValueError):
        shared_rows([], [1])


def test_generate_on_a_padded_batch_matches_our_batched_autoregressive_run(tiny_target, tiny_tok):
    pair = tiny_pair(tiny_target, tiny_tok, NgramDrafter(), "ngram")
    config = GenerationConfig(max_new_tokens=12)
    eos = eos_ids(tiny_target, tiny_tok)
    hf = hf_generate_batch(tiny_target, PROMPTS, hf_kwargs(config.sampling, 12, sorted(eos)), eos)
    ours = run_batch_ar(pair, PROMPTS, config)
    assert hf.outputs == ours.outputs and hf.tokens == ours.tokens == 12 * len(PROMPTS)


@pytest.mark.parametrize("k", [2, None])
def test_sweep_reports_each_batch_size_with_identical_outputs(tiny_target, tiny_draft, tiny_tok, k):
    """Fixed k and auto k: every batch size has the bench.json keys, greedy rows equal their AR rows and their
    batch-1 (single-sequence) output, generate is measured on the same batches, and auto k is reported."""
    pair = tiny_pair(tiny_target, tiny_tok, ModelDrafter(tiny_draft), "model")
    config = GenerationConfig(max_new_tokens=10, num_draft_tokens=k or 1)
    seen = []
    sweeps = list(iter_batch_sweep(pair, PROMPTS, [4, 1, 2], config, k, anchors=True,
                                   on_run=lambda *a: seen.append(a)))
    assert [len(s.points) for s in sweeps] == [1, 2, 3]
    report = sweeps[-1].as_dict()
    assert list(report["by_batch_size"]) == ["1", "2", "4"]
    for b, p in report["by_batch_size"].items():
        assert KEYS <= set(p)
        assert p["rows"] == 4 and p["batches"] == 4 // int(b)
        assert p["identical_fraction"] == 1.0 and p["identical_to_single_fraction"] == 1.0
        assert p["hf_generate_identical_fraction"] == 1.0 and p["ar_vs_hf_generate"] > 0
        assert 0 <= p["auto_k"] <= 8 and p["k"] == (p["auto_k"] if k is None else k)
        assert p["ar_tokens"] == p["sd_tokens"] == 40
    assert ("calibrate", 4, 0) in seen and ("run", 1, 3) in seen
    assert "crossover_batch_size" in report and set(report["auto_k_by_batch_size"]) == {"1", "2", "4"}


def test_max_batches_caps_the_batches_of_each_size(tiny_target, tiny_tok):
    pair = tiny_pair(tiny_target, tiny_tok, NgramDrafter(), "ngram")
    sweep = list(iter_batch_sweep(pair, PROMPTS, [1, 2, 4], GenerationConfig(max_new_tokens=6, num_draft_tokens=2),
                                  2, max_batches=1))[-1]
    assert [(p.batch_size, p.batches, p.rows) for p in sweep.points] == [(1, 1, 1), (2, 1, 2), (4, 1, 4)]
    assert all(p.identical_to_single_fraction == 1.0 for p in sweep.points)


def _point(b, speedup, ratio=1.0, k=4):
    return BatchPoint(b, 1, b, k, k, 10, 1.0, 10, 1.0 / speedup, 10.0, 10.0 * speedup, speedup, 2.0, 0.5, 1.0,
                      1.2, 1.3, speedup, {"verify_costs": {"1": 1.1, "2": 1.2, "4": 1.5, "8": 2.0},
                                          "one_pass_seconds": 0.01, "alpha": 0.6, "c": 0.05, "k": 4},
                      ar_vs_hf_generate=ratio, hf_generate_tokens_per_s=10.0 / ratio)


def test_crossover_is_the_first_batch_size_where_speculation_stops_paying():
    points = [_point(1, 1.8), _point(2, 1.4), _point(4, 1.1), _point(8, 0.8), _point(16, 1.05)]
    assert crossover(points) == 8
    assert crossover_interpolated(points) == pytest.approx(2 ** (2 + 0.1 / 0.3))
    assert crossover(points[:3]) is None and crossover_interpolated(points[:3]) is None


def test_auto_k_turning_speculation_off_is_where_it_stops_paying_whatever_the_noise_says():
    """At k = 0 both runs do the same work: a measured 1.17x there is noise, and speculation has stopped paying."""
    points = [_point(1, 1.3), _point(2, 1.22), _point(4, 1.02), _point(8, 1.17, k=0), _point(16, 0.85, k=0)]
    assert crossover(points) == 8
    assert crossover_interpolated(points) == pytest.approx(8.0)


def test_batch_report_files_and_the_baseline_check(tmp_path):
    sweep = BatchSweep([_point(1, 1.5), _point(2, 1.2, ratio=0.9), _point(4, 0.9)], "4")
    report = build_batch_report({"target": "tiny", "drafter": "ngram", "k_arg": "4", "rows": 4}, {"cpu": "x"},
                                sweep.as_dict())
    write_batch_outputs(report, tmp_path)
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["crossover_batch_size"] == 4 and set(data["by_batch_size"]) == {"1", "2", "4"}
    md = (tmp_path / "bench.md").read_text()
    assert "stops paying at batch size **4**" in md and "| B |" in md
    assert "B=2: 0.90" in batch_baseline_warning(report) and "Baseline check failed" in md
    assert "Speedup vs batch size" in (tmp_path / "bench.html").read_text()
    lines = batch_summary_lines(report)
    assert lines[-1] == "speculation stops paying at batch size 4" and "AR/HF generate 0.900" in lines[1]
    assert "Baseline" not in batch_markdown(build_batch_report({}, {}, BatchSweep([_point(1, 1.5)], "4").as_dict()))


def test_batch_flags_are_checked():
    assert parse_batch_sizes("4, 1,2,2") == [1, 2, 4]
    for bad in ("", "0,2", "two"):
        with pytest.raises(ValueError, match="--batch-size"):
            parse_batch_sizes(bad)
    assert batch_k("auto") is None and batch_k("3") == 3
    with pytest.raises(ValueError, match="one value"):
        batch_k("1,2")


def test_the_batch_sweep_refuses_vllm_anchors(capsys):
    from specdemo.measure.bench import main

    assert main(["--batch-size", "1,2", "--anchors", "vllm", "--limit", "1", "--out", "/nonexistent/never"]) == 2
    assert "not part of the batch sweep" in capsys.readouterr().err
