"""The benchmark's report: pooled figures over result rows (overall, by category, by k, the anchors, overheads), the
bench.json object. Pure functions of the rows; nothing here runs a model. Its markdown and HTML are in outputs.py."""

from __future__ import annotations

import logging
from itertools import zip_longest

from ...serve.serve_config import (
    VLLM_METHODS,  # vLLM's speculative methods the bench runs beside plain decoding
)
from ..spec_metrics import pool
from .timing import ratio

log = logging.getLogger(__name__)

HONEST_BASELINE = 0.95  # our AR loop's speed over generate's below which a report's speedups are not figures


def aggregate(rows: list[dict]) -> dict:
    """Pooled figures over result rows: speedup = total AR seconds / total SD seconds; acceptance over all drafts."""
    ar_s = sum(r["ar_seconds"] for r in rows)
    sd_s = sum(r["sd_seconds"] for r in rows)
    steps = sum(r["steps"] for r in rows)
    drafted = sum(r["drafted"] for r in rows)
    out = {
        "speedup": ratio(ar_s, sd_s),
        "mean_accepted": ratio(sum(r["spec_tokens"] for r in rows), steps),
        "acceptance_rate": ratio(sum(r["accepted"] for r in rows), drafted),
        "identical_fraction": ratio(sum(bool(r["identical"]) for r in rows), len(rows)),
        "ar_seconds": ar_s, "sd_seconds": sd_s,
        "ar_tokens_per_s": ratio(sum(r["ar_tokens"] for r in rows), ar_s),
        "sd_tokens_per_s": ratio(sum(r["sd_tokens"] for r in rows), sd_s),
        "prompts": len(rows),
    }
    if rows and all("speculative_decoding" in r for r in rows):  # vLLM's names, pooled as its counters pool
        out["speculative_decoding"] = pool([r["speculative_decoding"] for r in rows])
    for name in ("hf_generate", "hf_assisted", "hf_prompt_lookup"):
        have = [r for r in rows if f"{name}_seconds" in r]
        if have and name != "hf_generate":
            base = sum(r["hf_generate_seconds"] for r in have)
            out[f"{name}_speedup"] = ratio(base, sum(r[f"{name}_seconds"] for r in have))
            out[f"{name}_tokens_per_s"] = ratio(sum(r[f"{name}_tokens"] for r in have),
                                                 sum(r[f"{name}_seconds"] for r in have))
    return out


def anchors_summary(rows: list[dict]) -> dict:
    """The transformers comparisons, pooled over rows that have them."""
    have = [r for r in rows if "hf_generate_seconds" in r]
    if not have:
        return {}
    hf_s = sum(r["hf_generate_seconds"] for r in have)
    hf_tok = sum(r["hf_generate_tokens"] for r in have)
    ar_tps = ratio(sum(r["ar_tokens"] for r in have), sum(r["ar_seconds"] for r in have))
    best, baseline = ratio(hf_tok, hf_s), "generate"
    static = [r for r in have if "hf_static_seconds" in r]
    static_tps = None
    if static:  # on a GPU: generate() with a static cache and a compiled forward; the check takes the faster one
        static_tps = ratio(sum(r["hf_static_tokens"] for r in static), sum(r["hf_static_seconds"] for r in static))
        if static_tps is not None and (best is None or static_tps > best):
            best, baseline = static_tps, "generate, static cache, compiled"
    out = {
        "hf_generate_tokens_per_s": ratio(hf_tok, hf_s),
        "hf_static_tokens_per_s": static_tps,
        "ar_tokens_per_s": ar_tps,
        "baseline": baseline,  # what the baseline check compares our AR with: transformers' faster plain decoding
        "ar_vs_hf_generate": ratio(ar_tps, best),
        "hf_generate_identical_fraction": ratio(sum(bool(r["hf_generate_identical"]) for r in have), len(have)),
        "hf_assisted_speedup": None,
        "hf_prompt_lookup_speedup": None,
    }
    for name in ("hf_assisted", "hf_prompt_lookup"):
        sub = [r for r in have if f"{name}_seconds" in r]
        if sub:
            base = sum(r["hf_generate_seconds"] for r in sub)
            out[f"{name}_speedup"] = ratio(base, sum(r[f"{name}_seconds"] for r in sub))
            out[f"{name}_tokens_per_s"] = ratio(sum(r[f"{name}_tokens"] for r in sub),
                                                 sum(r[f"{name}_seconds"] for r in sub))
            out[f"{name}_identical_fraction"] = ratio(sum(bool(r[f"{name}_identical"]) for r in sub), len(sub))
            ours = aggregate(sub)
            out[f"ours_vs_{name}_tokens_per_s"] = ratio(ours["sd_tokens_per_s"], out[f"{name}_tokens_per_s"])
    return out




def vllm_summary(rows: list[dict]) -> dict:
    """vLLM's figures pooled over rows that have them, beside ours on the same rows (empty without vLLM runs).

    {method}_speedup is vLLM's over vLLM's own plain decoding; {method}_mean_accepted is vLLM's own definition,
    1 + accepted / drafting steps (bonus included, steps without a draft left out); {method}_tokens_per_pass counts
    every verify pass, as our mean_accepted does; identical means the same token ids as our autoregressive run.
    """
    have = [r for r in rows if "vllm_plain_seconds" in r]
    if not have:
        return {}
    plain_s, plain_tok = (sum(r[f"vllm_plain_{f}"] for r in have) for f in ("seconds", "tokens"))
    ours = aggregate(have)
    out = {
        "plain_tokens_per_s": ratio(plain_tok, plain_s),
        "ar_tokens_per_s": ours["ar_tokens_per_s"],
        "ar_vs_vllm_plain": ratio(ours["ar_tokens_per_s"], ratio(plain_tok, plain_s)),
        "plain_identical_fraction": ratio(sum(bool(r["vllm_plain_identical"]) for r in have), len(have)),
        "ours_tokens_per_s": ours["sd_tokens_per_s"], "ours_speedup": ours["speedup"],
        "ours_acceptance_rate": ours["acceptance_rate"], "ours_tokens_per_pass": ours["mean_accepted"],
        "ours_identical_fraction": ours["identical_fraction"],
        "prompts": len(have),
    }
    if "speculative_decoding" in ours:
        out["ours_speculative_decoding"] = ours["speculative_decoding"]
    drafting = sum(r.get("ours_drafting_steps", 0) for r in have)
    out["ours_mean_accepted"] = 1 + ratio(sum(r["accepted"] for r in have), drafting) if drafting else None
    out.update(_per_step("ar", have, "ar_target_forward_s", "ar_overhead_s", "ar_target_calls"))
    out.update(_per_step("plain", have, "vllm_plain_forward_s", None, "vllm_plain_forward_calls", "vllm_plain_seconds"))
    for m in VLLM_METHODS:
        sub = [r for r in have if f"vllm_{m}_seconds" in r]
        if not sub:
            continue
        s, tok = (sum(r[f"vllm_{m}_{f}"] for r in sub) for f in ("seconds", "tokens"))
        drafts, drafted, accepted = (sum(r[f"vllm_{m}_{f}"] for r in sub)
                                     for f in ("drafts", "draft_tokens", "accepted"))
        out[f"{m}_tokens_per_s"] = ratio(tok, s)
        out[f"{m}_speedup"] = ratio(sum(r["vllm_plain_seconds"] for r in sub), s)
        out[f"{m}_acceptance_rate"] = ratio(accepted, drafted)
        out[f"{m}_mean_accepted"] = 1 + ratio(accepted, drafts) if drafts else None
        # every pass after the first token's prefill yields 1 + its accepted drafts
        passes = sum(max(1, r[f"vllm_{m}_tokens"] - 1 - r[f"vllm_{m}_accepted"]) for r in sub)
        out[f"{m}_tokens_per_pass"] = ratio(sum(r[f"vllm_{m}_tokens"] - 1 for r in sub), passes)
        out[f"{m}_identical_fraction"] = ratio(sum(bool(r[f"vllm_{m}_identical"]) for r in sub), len(sub))
        per_pos = [sum(x) for x in zip_longest(*(r[f"vllm_{m}_accepted_per_pos"] for r in sub), fillvalue=0)]
        out[f"{m}_per_position_acceptance"] = [ratio(a, drafts) for a in per_pos]  # vLLM's: over drafting steps
        if all(f"vllm_{m}_speculative_decoding" in r for r in sub):  # vLLM's own per-request dicts, beside ours
            out[f"{m}_speculative_decoding"] = pool([r[f"vllm_{m}_speculative_decoding"] for r in sub])
        out[f"ours_vs_vllm_{m}_tokens_per_s"] = ratio(aggregate(sub)["sd_tokens_per_s"], out[f"{m}_tokens_per_s"])
        out.update(_per_step(m, sub, f"vllm_{m}_forward_s", None, f"vllm_{m}_forward_calls", f"vllm_{m}_seconds"))
    return out


def _per_step(name: str, rows: list[dict], forward: str, outside: str | None, calls: str,
              seconds: str | None = None) -> dict:
    """Milliseconds per target pass inside the target's forward and outside it (wall minus forward)."""
    have = [r for r in rows if forward in r and calls in r]
    n = sum(r[calls] for r in have)
    if not have or not n:
        return {}
    fwd = sum(r[forward] for r in have)
    rest = sum(r[outside] for r in have) if outside else sum(r[seconds] for r in have) - fwd
    return {f"{name}_forward_ms_per_pass": 1000 * fwd / n, f"{name}_outside_forward_ms_per_pass": 1000 * rest / n,
            f"{name}_target_passes": n}


def overhead_summary(rows: list[dict]) -> dict:
    """Milliseconds per target pass spent outside every model forward, for each decoder measured."""
    out = {}
    for name in ("ar", "sd", "hf_generate", "hf_assisted", "hf_prompt_lookup"):
        have = [r for r in rows if f"{name}_overhead_s" in r]
        calls = sum(r[f"{name}_target_calls"] for r in have)
        if have and calls:
            out[f"{name}_ms_per_step"] = 1000 * sum(r[f"{name}_overhead_s"] for r in have) / calls
            out[f"{name}_forward_fraction"] = ratio(
                sum(r[f"{name}_target_forward_s"] + r.get(f"{name}_draft_forward_s", 0.0) for r in have),
                sum(r[f"{name}_seconds"] for r in have))
    sd = [r for r in rows if "sd_draft_logic_s" in r]
    steps = sum(r["sd_target_calls"] for r in sd)
    if steps:
        out["sd_draft_logic_ms_per_step"] = 1000 * sum(r["sd_draft_logic_s"] for r in sd) / steps
        out["sd_verify_logic_ms_per_step"] = 1000 * sum(r["sd_verify_logic_s"] for r in sd) / steps
        out["sd_outside_engine_clock_ms_per_step"] = 1000 * sum(r["sd_outside_clock_s"] for r in sd) / steps
    return out


def tree_figures(rows: list[dict], chains: list[dict]) -> dict:
    """One tree setting's figures at one k (aggregate's, with tokens per pass as mean_accepted), the passes that
    verified a tree, the speedup over the chain rows (`chains`, --tree off, on the same prompts; None without them),
    and the verify passes' cost by the nodes they verified: milliseconds per pass and its ratio to a 1-token pass
    (the autoregressive runs' passes), pooled from the events."""
    out = aggregate(rows)
    out["tree_steps"] = sum(r["tree_steps"] for r in rows)
    out["vs_chains"] = ratio(sum(r["sd_seconds"] for r in chains), out["sd_seconds"]) if chains else None
    out["verify_by_nodes"] = verify_costs(rows)
    return out


def verify_costs(rows: list[dict]) -> dict:
    """{nodes: passes, milliseconds per verify pass, its ratio to a 1-token pass} pooled over rows' events (a pass of
    n nodes is n + 1 tokens wide; the 1-token passes are the autoregressive runs')."""
    one = ratio(sum(r.get("ar_pass_seconds", 0.0) for r in rows), sum(r.get("ar_passes", 0) for r in rows))
    pooled: dict[int, list[float]] = {}
    for r in rows:
        for nodes, (passes, seconds) in (r.get("verify_by_nodes") or {}).items():
            entry = pooled.setdefault(int(nodes), [0, 0.0])
            entry[0], entry[1] = entry[0] + passes, entry[1] + seconds
    return {str(n): {"passes": p, "ms_per_pass": 1000 * ratio(s, p),
                     "vs_1_token_pass": ratio(ratio(s, p), one) if one else None}
            for n, (p, s) in sorted(pooled.items())}


def build_report(config: dict, machine: dict, rows: list[dict], theory: dict | None = None) -> dict:
    """The bench.json object from result rows."""
    categories = sorted({r["category"] for r in rows}, key=[r["category"] for r in rows].index)
    ks = sorted({r["k"] for r in rows})
    report = {
        "config": config,
        "machine": machine,
        "results": rows,
        "by_category": {c: aggregate([r for r in rows if r["category"] == c]) for c in categories},
        "by_k": {str(k): aggregate([r for r in rows if r["k"] == k]) for k in ks},
        "overall": aggregate(rows),
        "anchors": anchors_summary(rows),
        "overhead": overhead_summary(rows),
    }
    rules = list(dict.fromkeys(r.get("verification") for r in rows))
    if len(rules) > 1:  # `bench --verification token,block`: each rule's figures at each k, over the same prompts
        report["by_verification"] = {rule: {str(k): aggregate([r for r in rows if r.get("verification") == rule
                                                               and r["k"] == k]) for k in ks} for rule in rules}
    trees = list(dict.fromkeys(r.get("tree") for r in rows))
    if len(trees) > 1:  # `bench --tree off,auto,16`: chains against trees at the same drafter, k and prompts
        report["by_tree"] = {tree: {str(k): tree_figures([r for r in rows if r.get("tree") == tree and r["k"] == k],
                                                         [r for r in rows if r.get("tree") == "off" and r["k"] == k])
                                    for k in ks} for tree in trees}
        report["tree_verify_costs"] = {tree: verify_costs([r for r in rows if r.get("tree") == tree])
                                       for tree in trees}
    vllm = vllm_summary(rows)
    if vllm:
        vllm["by_category"] = {c: vllm_summary([r for r in rows if r["category"] == c]) for c in categories}
        vllm["by_k"] = {str(k): vllm_summary([r for r in rows if r["k"] == k]) for k in ks}
        report["anchors"]["vllm"] = vllm
    if "ar_vs_hf_generate" in report["anchors"]:
        report["anchors"]["by_category"] = {c: anchors_summary([r for r in rows if r["category"] == c])
                                            for c in categories}
        report["anchors"]["by_k"] = {str(k): anchors_summary([r for r in rows if r["k"] == k]) for k in ks}
    if theory:
        report["theory"] = theory
    mism = [r["mismatch"] for r in rows if r.get("mismatch")]
    if mism:
        report["mismatch_top2_logit_gaps"] = [m["top2_logit_gap"] for m in mism]
    return report
