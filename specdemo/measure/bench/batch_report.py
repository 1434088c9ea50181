"""The batch-size sweep's report (bench --batch-size): bench.json, bench.md with one row per batch size and the
crossover, and bench.html with throughput and speedup against batch size. Pure functions of the sweep's dict."""

from __future__ import annotations

import json
from pathlib import Path

from .outputs import fmt, md_table, write_outputs
from .report import HONEST_BASELINE


def build_batch_report(config: dict, machine: dict, sweep: dict) -> dict:
    """The bench.json object of a batch sweep: config, machine, and batch_sizes.BatchSweep.as_dict()
    (by_batch_size, crossover_batch_size, ...)."""
    return {"config": config, "machine": machine, **sweep}


def batch_baseline_warning(report: dict) -> str:
    """A loud line naming each batch size where our batched AR loop ran slower than generate on the same batches."""
    slow = {b: p["ar_vs_hf_generate"] for b, p in report["by_batch_size"].items()
            if p.get("ar_vs_hf_generate") is not None and p["ar_vs_hf_generate"] < HONEST_BASELINE}
    if not slow:
        return ""
    where = ", ".join(f"B={b}: {r:.2f}×" for b, r in slow.items())
    return (f"**Baseline check failed** at {where}: our batched autoregressive loop ran slower than transformers' "
            f"`generate` on the same padded batches (at least {HONEST_BASELINE} is required), so the speedups at "
            f"those batch sizes are measured against a slow baseline and are not figures to report.\n")


def batch_markdown(report: dict) -> str:
    """Markdown: the setup, one row per batch size, the crossover, and the verify-cost micro-benchmark."""
    cfg, m = report["config"], {"cpu": "?", "cores": "?", "torch_threads": "?", **report["machine"]}
    points = list(report["by_batch_size"].values())
    cross = report.get("crossover_batch_size")
    anchors = any(p.get("ar_vs_hf_generate") is not None for p in points)
    rows = [[p["batch_size"], p["batches"], p["k"], p["auto_k"], p["ar_tokens_per_s"], p["sd_tokens_per_s"],
             p["speedup"], p["expected_speedup"], p["mean_accepted"], p["acceptance_rate"], p["verify_cost"],
             p["verify_cost_measured"], p["identical_fraction"],
             *([p["hf_generate_tokens_per_s"], p["ar_vs_hf_generate"], p["hf_generate_identical_fraction"]]
               if anchors else [])] for p in points]
    header = ["B", "batches", "k", "auto k", "AR tok/s", "SD tok/s", "speedup", "theory at auto k",
              "mean accepted", "acceptance", "verify cost", "verify cost (runs)", "identical",
              *(["HF generate tok/s", "AR / HF generate", "HF identical"] if anchors else [])]
    single = [p for p in points if p.get("identical_to_single_fraction") is not None]
    gaps = [g for p in points for g in p.get("mismatch_top2_logit_gaps") or []]
    parts = [
        f"# Batch speculative decoding benchmark\n\n"
        f"target `{cfg.get('target')}`, drafter `{cfg.get('drafter')}`"
        f"{' (' + str(cfg['draft']) + ')' if cfg.get('draft') else ''}, k = {cfg.get('k_arg')}, temperature "
        f"{cfg.get('temperature')}, {cfg.get('max_new_tokens')} new tokens per row, {cfg.get('rows')} rows from "
        f"{cfg.get('num_prompts')} prompts in `{Path(str(cfg.get('prompts'))).name}` ({cfg.get('batching')})\n\n"
        f"machine: {m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch threads), {m.get('device')} "
        f"{m.get('dtype')}, torch {m.get('torch')}, transformers {m.get('transformers')}; load average "
        f"{fmt((m.get('load_average_start') or [None])[0])} at start, {fmt((m.get('load_average_end') or [None])[0])}"
        f" at end\n\n"
        f"Throughput = all rows' new tokens / wall seconds; speedup = SD tok/s / AR tok/s at the same batch size; "
        f"mean accepted = tokens per row per verify pass, bonus included; verify cost = a B x (k+1) target pass over "
        f"a B x 1 pass (micro-benchmark), and in the runs: seconds per speculative step over seconds per "
        f"autoregressive step.\n",
    ]
    warning = batch_baseline_warning(report)
    if warning:
        parts.append(warning)
    parts.append("## By batch size\n\n" + md_table(header, rows))
    parts.append(f"Speculation stops paying at batch size **{cross}**"
                 + (f" (the curve crosses 1 near B = {report['crossover_batch_size_interpolated']:.1f})"
                    if report.get("crossover_batch_size_interpolated") else "") + ".\n"
                 if cross is not None else "Speculation pays at every measured batch size.\n")
    if single:
        parts.append("Rows identical to their batch-1 (single-sequence) autoregressive output: " + ", ".join(
            f"B={p['batch_size']}: {p['identical_to_single_fraction']:.2f}" for p in single) + ".\n")
    if gaps:
        parts.append(f"Greedy mismatches (SD vs AR in the same batch): {len(gaps)}; target top-2 logit gaps at the "
                     f"first difference: " + ", ".join(f"{g:.4f}" for g in gaps) + "\n")
    cal_rows = []
    for p in points:
        c = p["calibration"]
        costs = c["verify_costs"]
        cal_rows.append([p["batch_size"], c["one_pass_seconds"] * 1000, *[costs.get(str(k)) for k in (1, 2, 4, 8)],
                         c["alpha"], c["c"], c["k"]])
    parts.append("## Auto k: measured costs per batch size\n\n" + md_table(
        ["B", "B x 1 pass (ms)", "verify cost k=1", "k=2", "k=4", "k=8", "alpha (probe)", "c (probe)", "auto k"],
        cal_rows) + "\nauto k = the k in 0..8 with the best expected speedup E[tokens] / (k c + verify cost) "
        "(Leviathan et al.); 0 means no speculation.\n")
    return "\n".join(parts)


def batch_html(report: dict) -> str:
    """Plotly figures: throughput and speedup against batch size, the crossover marked (charts.batch_*)."""
    from .. import charts

    points = list(report["by_batch_size"].values())
    cross = report.get("crossover_batch_size")
    body = (charts.batch_throughput(points, cross).to_html(full_html=False, include_plotlyjs=True)
            + charts.batch_speedup(points, cross).to_html(full_html=False, include_plotlyjs=False))
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>specdemo batch bench</title></head><body>"
            f"<h1>Batch speculative decoding benchmark</h1><pre>{json.dumps(report['config'], indent=1)}</pre>"
            f"{body}</body></html>\n")


def write_batch_outputs(report: dict, out: Path) -> None:
    """bench.json, bench.md and bench.html of a batch sweep in `out`."""
    write_outputs(report, out, batch_markdown, batch_html)
