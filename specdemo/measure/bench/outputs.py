"""The benchmark report's files: bench.json, and bench.md and bench.html rendered from the report object
(report.build_report; the batch sweep's from batch_report). Pure functions of the report."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ...models.placement import placement_line
from ...serve.serve_config import (
    VLLM_METHODS,  # vLLM's speculative methods the bench runs beside plain decoding
)
from .report import HONEST_BASELINE

log = logging.getLogger(__name__)


def write_outputs(report: dict, out: Path, markdown_of=None, html_of=None) -> None:
    """bench.json, bench.md and bench.html in `out`: the markdown and the HTML of `report` by markdown_of and
    html_of (this module's markdown and html unless given: the batch sweep gives its own)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / "bench.md").write_text((markdown_of or markdown)(report), encoding="utf-8")
    try:
        (out / "bench.html").write_text((html_of or html)(report), encoding="utf-8")
    except ImportError:  # plotly is optional for the CLI
        log.warning("plotly is not installed; skipped bench.html")


def fmt(x, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def md_table(header: list[str], rows: list[list]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(x) for x in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _hybrid_line(c: dict) -> str:
    if "hybrid_cap" not in c:  # the hybrid's calibration in words (HybridCalibration.as_dict)
        return ""
    return f"; hybrid: {c['hybrid_cap']}"


def baseline_warning(anchors: dict) -> str:
    """A loud line when our autoregressive loop ran slower than transformers' generate on the same inputs."""
    ratio = (anchors or {}).get("ar_vs_hf_generate")
    if ratio is None or ratio >= HONEST_BASELINE:
        return ""
    which = anchors.get("baseline", "generate")
    return (f"**Baseline check failed:** our autoregressive loop ran at {ratio:.2f}× the speed of transformers' "
            f"`{which}` on the same inputs (at least {HONEST_BASELINE} is required), so this report's speedups are "
            f"measured against a slow baseline and are not figures to report.\n")


def markdown(report: dict) -> str:
    """Markdown tables: overall, by category, by k, overhead, the transformers anchors, per prompt."""
    cfg, mach, o = report["config"], report["machine"], report["overall"]
    anchors = report.get("anchors") or {}
    warning = baseline_warning(anchors)
    c = {"target": "?", "drafter": "?", "draft": None, "k": "?", "temperature": "?", "max_new_tokens": "?",
         "num_prompts": len(report["results"]), "prompts": "?", **cfg}
    m = {"cpu": "?", "cores": "?", "torch_threads": "?", "device": "?", "dtype": "?", "torch": "?",
         "transformers": "?", **mach}
    parts = [
        f"# Speculative decoding benchmark\n\n"
        f"target `{c['target']}`, drafter `{c['drafter']}`{' (' + str(c['draft']) + ')' if c['draft'] else ''}, "
        f"k = {c['k']}, temperature {c['temperature']}, {c['max_new_tokens']} new tokens, "
        f"{c['num_prompts']} prompts from `{Path(str(c['prompts'])).name}`"
        f"{_hybrid_line(c)}\n\n"
        + (f"placement: {placement_line(c['placement'])}\n\n" if c.get("placement") else "")
        + (f"draft trees (--tree {c['tree']['setting']}): {c['tree']['note']}; {c['tree']['tree_steps']} of "
           f"{c['tree']['drafted_steps']} steps verified a tree\n\n" if c.get("tree") else "") +
        f"machine: {m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch threads), "
        f"{m['device']} {m['dtype']}{', linear products ' + m['linears'] if m.get('linears') else ''}, "
        f"torch {m['torch']}, transformers {m['transformers']}; "
        f"load average {fmt((m.get('load_average_start') or [None])[0])} at start, "
        f"{fmt((m.get('load_average_end') or [None])[0])} at end\n\n"
        f"Speedup = total autoregressive seconds / total speculative seconds (wall clock, perf_counter); "
        f"mean accepted = tokens per verify pass, bonus included.\n",
        *([warning] if warning else []),
        "## Overall\n\n" + md_table(
            ["speedup", "AR tok/s", "SD tok/s", "mean accepted", "acceptance", "identical"],
            [[o["speedup"], o["ar_tokens_per_s"], o["sd_tokens_per_s"], o["mean_accepted"], o["acceptance_rate"],
              o["identical_fraction"]]]),
    ]
    anchor_cols = [n for n in ("hf_prompt_lookup", "hf_assisted") if anchors.get(f"{n}_speedup") is not None]
    cat_rows = []
    for c, a in report["by_category"].items():
        cat_rows.append([c, a["prompts"], a["speedup"], *[a.get(f"{n}_speedup") for n in anchor_cols],
                         a["mean_accepted"], a["acceptance_rate"], a["identical_fraction"]])
    parts.append("## By category\n\n" + md_table(
        ["category", "rows", "speedup (ours)", *[f"speedup ({n})" for n in anchor_cols], "mean accepted",
         "acceptance", "identical"], cat_rows))
    theory = report.get("theory")
    by_point = {p["k"]: p for p in theory["points"]} if theory else {}
    k_rows = []
    for k, a in report["by_k"].items():
        p = by_point.get(int(k), {})
        k_rows.append([k, a["speedup"], *[a.get(f"{n}_speedup") for n in anchor_cols], a["mean_accepted"],
                       a["acceptance_rate"], p.get("alpha"), p.get("c"), p.get("verify_cost"),
                       p.get("expected_speedup")])
    parts.append("## By k\n\n" + md_table(
        ["k", "speedup (ours)", *[f"speedup ({n})" for n in anchor_cols], "mean accepted", "acceptance", "alpha",
         "c", "verify cost", "theory speedup"], k_rows))
    if theory:
        parts.append(
            f"Theory (Leviathan et al.): pooled alpha {theory['alpha']:.3f}, c {theory['c']:.3f}; best k "
            f"{theory['best_k']} (measured best {theory['best_measured_k']}). Verify cost = seconds per verify step "
            f"over seconds per autoregressive step, as measured in the runs; the curve uses a forward-pass "
            f"micro-benchmark: " + ", ".join(f"k={k}: {v:.2f}" for k, v in list(theory["verify_costs"].items())[:8])
            + ".\n")
    if report.get("by_verification"):
        parts.append(verification_markdown(report["by_verification"]))
    if report.get("by_tree"):
        parts.append(tree_markdown(report["by_tree"], report.get("tree_verify_costs") or {}, cfg.get("trees") or {}))
    if "ar_vs_hf_generate" in anchors:
        rows = [[f"our AR tok/s / HF {anchors.get('baseline', 'generate')} tok/s (the faster)",
                 anchors["ar_vs_hf_generate"]],
                ["HF generate tok/s", anchors["hf_generate_tokens_per_s"]],
                *([["HF generate, static cache, compiled, tok/s", anchors["hf_static_tokens_per_s"]]]
                  if anchors.get("hf_static_tokens_per_s") else []),
                ["our AR tok/s", anchors["ar_tokens_per_s"]],
                ["HF generate tokens identical to ours", anchors["hf_generate_identical_fraction"]]]
        for n in anchor_cols:
            rows += [[f"{n} speedup (over HF generate)", anchors[f"{n}_speedup"]],
                     [f"{n} tok/s", anchors[f"{n}_tokens_per_s"]],
                     [f"our SD tok/s / {n} tok/s", anchors[f"ours_vs_{n}_tokens_per_s"]],
                     [f"{n} tokens identical to our AR", anchors[f"{n}_identical_fraction"]]]
        parts.append("## transformers anchors (same ids, k, max_new_tokens, clock)\n\n" + md_table(["", "value"], rows))
    if anchors.get("vllm") or cfg.get("vllm"):
        parts.append(vllm_markdown(report))
    ov = report.get("overhead") or {}
    if report["results"] and "ar_ms_per_step" not in ov:
        parts.append("Our runs' passes bypassed the forward hooks (CUDA graph replays or compiled passes: see each "
                     "row's `runner`), so no forward time or overhead is given for them; `scripts/step_profile.py` "
                     "profiles a step.\n")
    if ov:
        parts.append("## Per-step time outside model forwards\n\n" + md_table(
            ["measure", "ms per target pass"], [[k.replace("_ms_per_step", ""), v] for k, v in ov.items()
                                                if k.endswith("_ms_per_step")])
            + "\nForward fraction (time inside forwards / wall): " + ", ".join(
                f"{k.replace('_forward_fraction', '')} {v:.3f}" for k, v in ov.items()
                if k.endswith("_forward_fraction"))
            + "\n")
    prompt_rows = [[r["id"], r["category"], r["k"], r["ar_tokens_per_s"], r["sd_tokens_per_s"], r["speedup"],
                    r.get("hf_prompt_lookup_tokens_per_s", r.get("hf_assisted_tokens_per_s")),
                    r["mean_accepted"], r["acceptance_rate"], r["identical"]] for r in report["results"]]
    parts.append("## Per prompt\n\n" + md_table(
        ["id", "category", "k", "AR tok/s", "SD tok/s", "speedup", "HF assisted/PLD tok/s", "mean accepted",
         "acceptance", "identical"], prompt_rows))
    gaps = report.get("mismatch_top2_logit_gaps")
    if gaps:
        parts.append(f"Greedy mismatches: {len(gaps)}; target top-2 logit gaps at the first difference: "
                     + ", ".join(f"{g:.4f}" for g in gaps) + "\n")
    return "\n".join(parts)


def verification_markdown(by_rule: dict) -> str:
    """Each verification rule at each k on the same prompts and seeds (the overall and by-k tables pool the rules)."""
    rows = [[rule, k, a["mean_accepted"], a["acceptance_rate"], a["sd_tokens_per_s"], a["speedup"]]
            for rule, by_k in by_rule.items() for k, a in by_k.items()]
    return ("## By verification rule\n\nThe same prompts, seeds and autoregressive runs under each rule; the tables "
            "above pool the rules.\n\n" + md_table(["rule", "k", "mean accepted", "acceptance", "SD tok/s",
                                                      "speedup"], rows))


def tree_markdown(by_tree: dict, verify_costs: dict, plans: dict) -> str:
    """Chains against trees at the same drafter: each tree setting at each k on the same prompts (tokens per pass,
    passes that verified a tree, speedups), then what a verify pass cost by the nodes it verified, per setting."""
    rows = [[tree, k, a["mean_accepted"], a["tree_steps"], a["sd_tokens_per_s"], a["speedup"], a["vs_chains"]]
            for tree, by_k in by_tree.items() for k, a in by_k.items()]
    costs = [[tree, n, c["passes"], c["ms_per_pass"], c["vs_1_token_pass"]]
             for tree, by_nodes in verify_costs.items() for n, c in by_nodes.items()]
    said = "".join(f"- `--tree {t}`: {p['note']}; {p['tree_steps']} of {p['drafted_steps']} drafting passes verified "
                   f"a tree\n" for t, p in plans.items())
    return ("## Chains against trees\n\nThe same prompts, k and autoregressive runs under each `--tree` setting; "
            "tokens per pass include the bonus; speedup is over the autoregressive runs, `vs chains` over the "
            "`--tree off` runs. The tables above pool the settings.\n\n" + said + "\n"
            + md_table(["trees", "k", "tokens per pass", "passes with a tree", "SD tok/s", "speedup", "vs chains"],
                       rows)
            + "\nVerify passes by the nodes they verified (a pass of n nodes is n + 1 tokens wide), from the runs' "
              "own steps:\n\n"
            + md_table(["trees", "nodes", "passes", "ms per pass", "× a 1-token pass"], costs))


def vllm_markdown(report: dict) -> str:
    """The vLLM section: each engine's speedup over its own plain decoding beside the absolute tokens/s, which engine
    is faster at batch 1 and where each spends a target pass (its model forward vs the rest), by category."""
    v, c = report["anchors"].get("vllm") or {}, report["config"]
    meta = c.get("vllm") or {}
    text = ("## vLLM (same prompt ids, k, max_new_tokens and EOS ids; its own engine, venv and process, run after "
            "ours)\n\n")
    for f in meta.get("failed") or []:
        text += f"**vLLM {f['name']} (k = {f['k']}) failed:** {f['error']}\n\n"
    if meta.get("tree_note"):  # our rows drafted trees: what vLLM's rows are beside them (bench.vllm.tree_note)
        text += f"**Draft trees:** {meta['tree_note']}.\n\n"
    if not v:
        return text
    methods = [m for m in VLLM_METHODS if v.get(f"{m}_tokens_per_s") is not None]
    drafter = f"{c.get('drafter', '?')}" + (f" ({c['draft']})" if c.get("draft") else "")
    ks = ", ".join(map(str, c["k"])) if isinstance(c.get("k"), list) else c.get("k", "?")
    rows = [["ours", "autoregressive", v["ar_tokens_per_s"], 1.0, None, None, None, 1.0],
            ["ours", f"{drafter}, k = {ks}", v["ours_tokens_per_s"], v["ours_speedup"],
             v["ours_acceptance_rate"], v["ours_mean_accepted"], v["ours_tokens_per_pass"],
             v["ours_identical_fraction"]],
            ["vLLM", "plain", v["plain_tokens_per_s"], 1.0, None, None, None, v["plain_identical_fraction"]]]
    rows += [["vLLM", m, v[f"{m}_tokens_per_s"], v[f"{m}_speedup"], v[f"{m}_acceptance_rate"],
              v[f"{m}_mean_accepted"], v[f"{m}_tokens_per_pass"], v[f"{m}_identical_fraction"]] for m in methods]
    text += md_table(["engine", "decoding", "tok/s", "speedup over its own plain", "acceptance",
                    "mean accepted (per drafting step)", "tokens per verify pass", "identical to our AR"], rows)
    faster = "our loop" if v["ar_vs_vllm_plain"] >= 1 else "vLLM"
    text += (f"\nAt batch 1 on this machine {faster} decodes faster: our autoregressive run makes "
             f"{v['ar_tokens_per_s']:.1f} tok/s, vLLM's plain decoding {v['plain_tokens_per_s']:.1f} tok/s "
             f"(ours / vLLM = {v['ar_vs_vllm_plain']:.2f}).")
    if v.get("plain_forward_ms_per_pass") is not None and v.get("ar_forward_ms_per_pass") is not None:
        fa, oa = v["ar_forward_ms_per_pass"], v["ar_outside_forward_ms_per_pass"]
        fv, ov = v["plain_forward_ms_per_pass"], v["plain_outside_forward_ms_per_pass"]
        where = "the model forward" if abs(fv - fa) >= abs(ov - oa) else "the work outside the forward"
        text += (f" A target pass costs us {fa + oa:.2f} ms ({fa:.2f} in the model forward, {oa:.2f} outside it) "
                 f"and vLLM {fv + ov:.2f} ms ({fv:.2f} in the forward, {ov:.2f} outside it: scheduler, "
                 f"inter-process queues, input preparation, sampling, detokenization), so most of the difference "
                 f"is {where}.")
    passes = [["our AR", v.get("ar_forward_ms_per_pass"), v.get("ar_outside_forward_ms_per_pass"),
               v.get("ar_target_passes")],
              ["vLLM plain", v.get("plain_forward_ms_per_pass"), v.get("plain_outside_forward_ms_per_pass"),
               v.get("plain_target_passes")]]
    passes += [[f"vLLM {m}", v.get(f"{m}_forward_ms_per_pass"), v.get(f"{m}_outside_forward_ms_per_pass"),
                v.get(f"{m}_target_passes")] for m in methods]
    text += "\n\n" + md_table(["run", "forward ms per target pass", "outside-forward ms per target pass",
                               "target passes"], passes)
    text += ("\nForward = the target model's forward and logits, timed by hooks inside each engine's worker (a "
             "draft model or the lookup is outside it). vLLM's mean accepted is its own metric, 1 + accepted / "
             "steps that drafted; tokens per verify pass counts every pass after the prefill, like ours.\n")
    text += _per_position_markdown(v, methods)
    cats = v.get("by_category") or {}
    if cats and methods:
        text += "\n" + md_table(["category", "rows", "ours speedup", *[f"vLLM {m} speedup" for m in methods],
                                "ours tok/s", "vLLM plain tok/s", *[f"vLLM {m} tok/s" for m in methods]],
                               [[cat, a["prompts"], a["ours_speedup"], *[a.get(f"{m}_speedup") for m in methods],
                                 a["ours_tokens_per_s"], a["plain_tokens_per_s"],
                                 *[a.get(f"{m}_tokens_per_s") for m in methods]] for cat, a in cats.items()])
    if meta:
        versions = sorted({str(m["vllm"]) for m in meta.get("methods", []) if m.get("vllm")})
        text += (f"\nvLLM {', '.join(versions)} from `{meta.get('python')}`, model `{meta.get('model')}`, CPU "
                 f"threads bind {meta.get('threads_bind')}, enforce_eager {meta.get('enforce_eager')}, lookup "
                 f"window {meta.get('lookup')}; load average {fmt((meta.get('load_average_start') or [None])[0])} "
                 f"before vLLM's runs, {fmt((meta.get('load_average_end') or [None])[0])} after.\n")
    gaps = [r[f"vllm_{m}_mismatch"]["top2_logit_gap"] for r in report["results"] for m in ("plain", *methods)
            if r.get(f"vllm_{m}_mismatch")]
    if gaps:
        text += (f"\nvLLM greedy outputs that differ from our AR: {len(gaps)}; our target's top-2 logit gaps at the "
                 f"first difference: " + ", ".join(f"{g:.4f}" for g in gaps) + "\n")
    return text


def _per_position_markdown(v: dict, methods: list[str]) -> str:
    """Ours and vLLM's own per-request metrics (speculative_decoding, vLLM's names) pooled, position by position."""
    ours, theirs = v.get("ours_speculative_decoding"), {m: v.get(f"{m}_speculative_decoding") for m in methods}
    theirs = {m: d for m, d in theirs.items() if d}
    if not ours or not theirs:
        return ""
    runs = [("ours", ours), *((f"vLLM {m}", d) for m, d in theirs.items())]
    per_pos = {name: d.get("num_accepted_tokens_per_pos") or [] for name, d in runs}
    width = max(map(len, per_pos.values()))
    rows = [[name, d["num_spec_steps"], d["num_draft_tokens"], d["num_accepted_draft_tokens"],
             d["mean_acceptance_length"], d["draft_acceptance_rate"], *(per_pos[name] + [None] * width)[:width]]
            for name, d in runs]
    return ("\n\n`speculative_decoding` (vLLM's names; vLLM's own per-request metrics and its per-position counter):"
            "\n\n" + md_table(["run", "num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens",
                                "mean_acceptance_length", "draft_acceptance_rate",
                                *[f"accepted at position {i + 1}" for i in range(width)]], rows))


def html(report: dict) -> str:
    """Plotly figures (charts.bench_*): speedup by category; speedup and acceptance against k beside the theoretical
    curve; with vLLM, tokens/s of ours and of vLLM's methods."""
    from .. import charts

    vllm = (report.get("anchors") or {}).get("vllm") or {}
    figures = [charts.bench_speedup_by_category(report, VLLM_METHODS), charts.bench_against_k(report)]
    if vllm:
        figures.append(charts.bench_vllm_throughput(vllm, VLLM_METHODS))
    body = "".join(f.to_html(full_html=False, include_plotlyjs=i == 0) for i, f in enumerate(figures))
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>specdemo bench</title></head><body>"
            f"<h1>Speculative decoding benchmark</h1><pre>{json.dumps(report['overall'], indent=1)}</pre>{body}"
            f"</body></html>\n")
