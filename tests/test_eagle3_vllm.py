"""The EAGLE-3 round trip through an engine no one here wrote: vLLM (its own venv; skipped without it) loads the
bundled target with the shipped head, in our checkpoint format, under speculative method eagle3; its greedy output is
its plain output and ours, and its acceptance, from its own spec-decode counters, is ours on the same prompts and k
(four dev prompts, 48 tokens, k = 2, our confidence gate off: the acceptance rate and the first position's acceptance
within 5 points). SPECDEMO_EAGLE3_HEAD names another head folder, or "logit-lens" for an untrained, deterministic
head."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from test_vllm import NEEDS_VLLM, vllm_python

from specdemo.measure.bench import main as bench_main
from specdemo.measure.bench.vllm import VLLM_PYTHON_ENV
from specdemo.models.eagle3 import default_aux_layer_ids, save_eagle3
from specdemo.train.heads import build_eagle3_head

# another head folder to check instead of the shipped one; "logit-lens": the untrained deterministic head below
HEAD_ENV = "SPECDEMO_EAGLE3_HEAD"
SHIPPED = Path(__file__).resolve().parent.parent / "specdemo" / "data" / "smollm2-135m-draft"  # an EAGLE-3 head


def logit_lens_head(target, folder, subset_size: int = 8192):
    """An untrained but useful EAGLE-3 head: fc passes the last aux layer's state through, the midlayer adds nothing
    (o_proj and down_proj zero), and norm and lm_head are the target's, so its first draft is the target's "logit lens"
    at layer L - 3 over the first `subset_size` ids; later drafts repeat it. Deterministic, no training."""
    h, layers = target.config.hidden_size, target.config.num_hidden_layers
    head = build_eagle3_head(target, torch.arange(subset_size), default_aux_layer_ids(layers))
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, 2 * h :].copy_(torch.eye(h))  # aux ids are sorted: (2, L // 2, L - 3)
        head.midlayer.self_attn.o_proj.weight.zero_()
        head.midlayer.mlp.down_proj.weight.zero_()
    save_eagle3(head, folder, {"target": "smollm2-135m", "note": "logit lens at layer L - 3 (test head)"})
    return folder


def ungated_copy(folder, out):
    """A copy of a head folder whose specdemo.json has no min_confidence (the drafter's confidence gate)."""
    shutil.copytree(folder, out, ignore=shutil.ignore_patterns("cache", "train_log.jsonl"))
    meta = out / "specdemo.json"
    if meta.exists():
        meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != "min_confidence"}))
    return out


@pytest.mark.slow
@NEEDS_VLLM
def test_vllm_eagle3_is_greedy_identical_and_accepts_what_ours_accepts(tmp_path, monkeypatch):
    """The bench with --anchors vllm and --draft an EAGLE-3 folder on the bundled model, k = 2, four dev prompts:
    vLLM's eagle3 and plain outputs equal our autoregressive output, both engines draft, they accept the same number
    of drafts (within 10%), and vLLM's acceptance rate (accepted / drafted tokens, from vllm:spec_decode_* counters)
    is within 5 points of ours, as is its acceptance at the first draft position. The head is the shipped one (its
    folder as distill wrote it: vLLM reads it unchanged; 98 drafts accepted by ours, 93 by vLLM, acceptance 0.511
    and 0.516 on 2026-12-02), or SPECDEMO_EAGLE3_HEAD (the logit-lens head: 9 drafts
    accepted on each side here, per prompt 4 / 2 / 2 / 1 in both engines, acceptance 0.026 ours, 0.025 vLLM's)."""
    from specdemo.models.loading import load_model

    monkeypatch.setenv(VLLM_PYTHON_ENV, str(vllm_python()))
    folder = os.environ.get(HEAD_ENV) or str(SHIPPED)
    if folder == "logit-lens":
        folder = logit_lens_head(load_model("smollm2-135m", device="cpu", dtype="fp32").model, tmp_path / "head")
    else:  # vLLM has no confidence gate: ours is switched off (min_confidence) so both draft k every step
        folder = ungated_copy(folder, tmp_path / "head")
    out = tmp_path / "bench"
    assert bench_main(["--limit", "4", "--max-new-tokens", "48", "--k", "2", "--draft", str(folder), "--anchors",
                       "vllm", "--out", str(out), "--quiet", "--no-theory"]) == 0
    report = json.loads((out / "bench.json").read_text())
    assert not report["config"]["vllm"]["failed"], report["config"]["vllm"]["failed"]
    v = report["anchors"]["vllm"]
    diffs = {r["id"]: {m: r.get(f"vllm_{m}_mismatch") for m in ("plain", "eagle3")} for r in report["results"]}
    assert v["plain_identical_fraction"] == 1.0 and v["eagle3_identical_fraction"] == 1.0, diffs
    assert report["overall"]["identical_fraction"] == 1.0
    drafted = sum(r["vllm_eagle3_draft_tokens"] for r in report["results"])
    assert drafted > 0 and sum(r["drafted"] for r in report["results"]) > 0
    ours, theirs = (sum(r[key] for r in report["results"]) for key in ("accepted", "vllm_eagle3_accepted"))
    assert ours > 0 and abs(ours - theirs) <= max(2, ours // 10), (ours, theirs)  # the same drafts accepted
    assert abs(v["eagle3_acceptance_rate"] - v["ours_acceptance_rate"]) <= 0.05, v
    ours_first = _ours_first_position(report["results"])
    assert abs(v["eagle3_per_position_acceptance"][0] - ours_first) <= 0.05, (v, ours_first)


def _ours_first_position(rows: list[dict]) -> float:
    """Our acceptance at the first draft position: steps whose first drafted token was accepted, over drafting steps."""
    steps = sum(r["ours_drafting_steps"] for r in rows)
    first = sum(sum(r["accepted_histogram"][1:]) for r in rows)  # steps with at least one accepted draft
    return first / steps if steps else 0.0
