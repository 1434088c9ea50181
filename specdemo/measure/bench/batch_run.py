"""The batch-size sweep's run (bench --batch-size): the prompt set B rows at a time at each batch size, both
decoders on the same rows (specdemo.measure.batch_sizes), and its report (batch_report)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ... import checks
from ...config import GenerationConfig, SamplingConfig
from ...engine import encode_prompt
from ...prompts import read_prompts
from ..compare import load_pair, pair_placement
from .run import BenchConfig, machine_info


def parse_batch_sizes(text: str) -> list[int]:
    """'1,2,4,8,16' -> [1, 2, 4, 8, 16] (sorted, distinct, each at least 1)."""
    try:
        sizes = sorted({int(x) for x in text.replace(" ", "").split(",") if x})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        raise ValueError(f"--batch-size must be positive integers like 1,2,4,8,16, got '{text}'")
    return sizes


def batch_k(text: str) -> int | None:
    """--k for the batch sweep: one k for every batch size, or 'auto' (None: chosen per batch size)."""
    ks = checks.ks(text)
    if ks == "auto":
        return None
    if len(ks) != 1:
        raise ValueError(f"with --batch-size, --k takes one value or 'auto', got '{text}'")
    return ks[0]


def run_batch_bench(bc: BenchConfig) -> dict:
    """The batch-size sweep (specdemo.measure.batch_sizes) on the prompt set; returns the report, also written to
    bc.out."""
    from tqdm.auto import tqdm

    from ..batch_sizes import iter_batch_sweep, shared_rows
    from .batch_report import build_batch_report, write_batch_outputs

    items = read_prompts(bc.prompts, bc.limit)
    if not items:
        raise ValueError(f"no prompts in {bc.prompts}")
    for item in items:  # each fits the target's context, by the tokenizer alone, before any weights load
        checks.prompt_tokens(bc.target, item.prompt, bc.max_new_tokens, bc.runtime, bc.chat_template,
                             where=f"{bc.prompts}:{item.line}")
    start, k_source = (bc.k, "--k") if bc.k else bc.starting_k()
    k_text = str(start)
    sizes, k = parse_batch_sizes(bc.batch_sizes or ""), batch_k(k_text)
    rules = checks.verifications(bc.verification, bc.temperature)
    if len(rules) > 1:
        raise ValueError("with --batch-size, --verification takes one rule")
    if len(checks.trees(bc.tree_setting)) > 1:
        raise ValueError("with --batch-size, --tree takes one setting")
    if bc.vllm:
        raise ValueError("--anchors vllm compares at batch 1 and is not part of the batch sweep; use --anchors "
                         "(transformers' generate on the same padded batches) with --batch-size")
    kind = bc.drafter_kind
    checks.pair(bc.target, kind, bc.draft)
    config = GenerationConfig(max_new_tokens=bc.max_new_tokens,
                              sampling=SamplingConfig(bc.temperature, verification=rules[0]), num_draft_tokens=k or 1,
                              seed=bc.seed, use_chat_template=bc.chat_template, tree=bc.tree_setting)
    config.validate()
    pair = load_pair(bc.target, kind, bc.draft, bc.device, bc.dtype, bc.draft_device, runtime=bc.runtime,
                     placement=bc.placement, drafter_options=bc.drafter_options)
    prompt_ids = [encode_prompt(pair.target.tokenizer, it.prompt, config.use_chat_template) for it in items]
    rows = len(shared_rows(prompt_ids, sizes))
    machine = machine_info(pair.target.device, pair.target.dtype, pair.target.native)
    total = len(sizes) + sum(min(rows // b, bc.max_batches or rows) for b in sizes)
    sweep = None
    # every batch size decodes the same rows: none leaves an answer in a suffix drafter's cache for another to draft
    with tqdm(total=total, desc="bench", file=sys.stderr, disable=bc.quiet) as bar, pair.drafter.paused():
        for sweep in iter_batch_sweep(pair, prompt_ids, sizes, config, k, bc.anchors,
                                      on_run=lambda *_: bar.update(1), max_batches=bc.max_batches):
            pass
    if hasattr(os, "getloadavg"):
        machine["load_average_end"] = list(os.getloadavg())
    cfg = {
        "prompts": str(bc.prompts), "limit": bc.limit, "num_prompts": len(items), "rows": rows,
        "target": pair.target.name, "drafter": kind, "draft": pair.draft_name, "k_arg": k_text, "k_source": k_source,
        "batch_sizes": sizes, "max_batches": bc.max_batches, "temperature": bc.temperature,
        "verification": rules[0], "max_new_tokens": bc.max_new_tokens, "seed": bc.seed,
        "anchors": bc.anchors, "chat_template": config.use_chat_template, "placement": pair_placement(pair),
        "batching": "the prompt set in order, cut to a multiple of the largest batch size (cycled when smaller), "
                    "B at a time: every batch size runs the same rows and no batch is partial",
        "throughput": "all rows' new tokens / the wall seconds of every batch's run, per decoder",
        "speedup": "speculative tokens/s / autoregressive tokens/s at the same batch size",
        "mean_accepted": "tokens per row per verify pass, bonus/correction included",
        "verify_cost": "seconds of a B x (k+1) target pass / a B x 1 pass (micro-benchmark at that batch size)",
    }
    if pair.calibration is not None:
        cfg.update(pair.calibration.as_dict())
    report = build_batch_report(cfg, machine, sweep.as_dict())
    write_batch_outputs(report, Path(bc.out))
    return report
