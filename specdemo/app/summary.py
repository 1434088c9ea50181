"""The text around the app's runs, with no gradio: the summary under the panels, the pass costs and the machine check
in words, the drift warning, the k sweep's table."""

from __future__ import annotations

from ..drafters.registry import get
from ..measure.tune_k import Sweep
from ..models.placement import placement_line

RULE_NAMES = {"token": "token-wise rejection sampling (Leviathan et al.)",
              "block": "block verification (Sun et al.)"}  # SamplingConfig.verification, in words

def final_stats_markdown(result: dict, c: float | None = None, verify_cost: float | None = None) -> str:
    """The summary under the panels: speedup, acceptance, mean accepted length, where the speculative time went."""
    sd, ar = result["sd"], result["ar"]
    spent = max(sd["seconds"], 1e-9)
    prefill = max(sd["seconds"] - sd["draft_seconds"] - sd["verify_seconds"], 0.0)
    same = "identical" if result["identical"] else "different (expected when sampling; see the JSON when greedy)"
    lines = [
        f"**Speedup {result['speedup']:.2f}×** — speculative {sd['tokens_per_s']:.1f} tokens/s vs "
        f"autoregressive {ar['tokens_per_s']:.1f} tokens/s",
        f"- acceptance rate: **{sd['acceptance_rate']:.0%}** ({sd['accepted']} of {sd['drafted']} drafted tokens)",
        f"- mean accepted length: **{sd['mean_accepted']:.2f}** tokens per target pass (bonus/correction included), "
        f"{sd['steps']} target passes" + (f", drafts verified by {RULE_NAMES[result['verification']]}"
                                          if result.get("verification") in RULE_NAMES else ""),
        f"- speculative time: drafting {sd['draft_seconds']:.2f} s ({sd['draft_seconds'] / spent:.0%}), "
        f"verifying {sd['verify_seconds']:.2f} s ({sd['verify_seconds'] / spent:.0%}), "
        f"prefill {prefill:.2f} s ({prefill / spent:.0%})",
    ]
    if result.get("tree"):
        lines.append(f"- {tree_line(result['tree'])}")
    if c is not None and verify_cost is not None:
        lines.append(f"- {cost_line(c, verify_cost)}")
    lines.append(f"- outputs: {same}; {result['target']} on {result['device']} ({result['dtype']}), "
                 f"drafter {result['drafter']} ({result['draft'] or get(result['drafter']).label}), k={result['k']}"
                 + (" (dynamic)" if result["dynamic_k"] else ""))
    if result.get("placement"):
        lines.append(f"- placement: {placement_line(result['placement'])}")
    if result.get("pass_costs"):
        lines.append(f"- {pass_costs_line(result['pass_costs'])}")
    if result.get("runner"):
        lines.append(f"- {runner_line(result['runner'])}")
    return "\n".join(lines + _hybrid_lines(result))


def tree_line(tree: dict) -> str:
    """Draft trees in words (the result's `tree`, compare.tree_result): how many passes verified one, tokens per pass
    with them and what their first branches alone would have given, or why the run drafted chains."""
    per_pass = tree.get("tokens_per_pass")
    if not tree.get("tree_steps"):
        return (f"draft trees (--tree {tree['setting']}): none, {tree['note']}"
                + (f"; {per_pass:.2f} tokens per pass with chains" if per_pass is not None else ""))
    line = (f"draft trees (--tree {tree['setting']}, up to {tree['nodes']} nodes): **{tree['tree_steps']} of "
            f"{tree['drafted_steps']}** drafting passes verified a tree; **{per_pass:.2f}** tokens per pass "
            f"({tree['tree_tokens_per_pass']:.2f} on the tree passes)")
    chain = tree.get("first_branch_tokens_per_pass")
    if chain is not None:
        return line + (f"; their first branches alone (the chains the trees grew from) would have given "
                       f"**{chain:.2f}** on the same passes")
    return line + "; what chains give here needs a run with trees off (a sampled pass cannot be replayed as a chain)"


def cost_line(c: float, verify_cost: float) -> str:
    """c and the verify cost in words, as the timeline and the per-position chart title them."""
    return (f"cost ratio c = {c:.3f} (a drafted token / a 1-token target pass); a verify pass costs "
            f"{verify_cost:.2f}× a 1-token pass")


PASS_NAMES = {"target_pass": "the target's 1-token passes", "verify_pass": "the verify passes",
              "draft_token": "the drafted tokens"}


def pass_costs_line(costs: dict) -> str:
    """The run's median passes beside the calibrated ones, in milliseconds (result["pass_costs"])."""
    parts = []
    for name, label in (("target_pass", "1-token target pass"), ("verify_pass", "verify pass"),
                        ("draft_token", "drafted token")):
        now, was = costs["run"].get(name), costs["calibrated"].get(name)
        if now and was:
            parts.append(f"{label} {now * 1000:.1f} ms (calibrated {was * 1000:.1f})")
    verdict = "as calibrated" if not costs.get("drift") else "**not as calibrated**"
    return f"machine check, {verdict}: " + ", ".join(parts)


def runner_line(runner: dict) -> str:
    """How the passes ran (result["runner"], engine.graphs.describe): CUDA graphs and what capturing them cost, the
    static cache uncaptured, or the eager engine and why."""
    return "passes: target " + runner["target"] + (f"; draft {runner['draft']}" if runner.get("draft") else "")


def drift_warning(result: dict) -> str:
    """"" when the run's passes cost what they cost at calibration; else a warning that names the passes and their
    ratios and offers Re-measure (result["pass_costs"]["drift"], metrics.cost_drift)."""
    drift = (result.get("pass_costs") or {}).get("drift") or {}
    if not drift:
        return ""
    parts = ", ".join(f"{PASS_NAMES[name]} took {ratio:.2f}×" for name, ratio in drift.items())
    return (f"\n\n**⚠ The machine was not as it was when this pair was calibrated:** {parts} their calibrated time. "
            "Something else was using the hardware (or had been when it was calibrated), so this ratio may not be "
            "what the engine achieves here. Press **Re-measure** to calibrate again and rerun.")


def _hybrid_lines(result: dict) -> list[str]:
    if "hybrid_cap" not in result:  # the hybrid's calibration in words (HybridCalibration.as_dict)
        return []
    return [f"- hybrid: {result['hybrid_cap']}; prompt lookup up to k where the text repeats"]


def sweep_table(result: Sweep) -> str:
    """Markdown: one line per measured k (per tree setting and k when the sweep ran several), then the fitted alpha
    and c and the theory's best k, and what each tree setting drafted."""
    several = len({p.tree for p in result.points}) > 1
    if several:
        lines = ["| trees | k | speedup | tokens per pass | acceptance | passes with a tree | theory (chains) |",
                 "|---|---|---|---|---|---|---|"]
        lines += [f"| {p.tree} | {p.k} | {p.speedup:.2f}× | {p.mean_accepted:.2f} | {p.acceptance_rate:.0%} | "
                  f"{p.tree_steps} | " + (f"{result.theory.get(p.k, 0.0):.2f}× |" if not p.tree_steps else "– |")
                  for p in result.points]
    else:
        lines = ["| k | speedup | acceptance | mean accepted | theory |", "|---|---|---|---|---|"]
        lines += [f"| {p.k} | {p.speedup:.2f}× | {p.acceptance_rate:.0%} | {p.mean_accepted:.2f} | "
                  f"{result.theory.get(p.k, 0.0):.2f}× |" for p in result.points]
    lines.append(f"\nFitted α = {result.alpha:.2f} (from mean accepted length), c = {result.c:.3f} (draft cost per "
                 f"token / target cost per token), verify cost per k as measured; theory's best k = {result.best_k}.")
    if result.trees:
        lines.append("\nDraft trees (tokens per pass: bonus included): " + "; ".join(
            f"**{setting}**: {what}" for setting, what in result.trees.items()) + ".")
    return "\n".join(lines)
