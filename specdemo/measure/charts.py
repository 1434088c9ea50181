"""Plotly figures, the project's only: for the app, tokens over time, running speedup, accepted-length histogram,
where the time goes (a timeline of passes, acceptance by draft position), k sweep; for the bench's bench.html, its
report's speedups and the batch-size sweep's. No gradio.

Inputs are plain numbers (points, histograms, sweep rows) computed by specdemo.measure.metrics; nothing here times
anything.
"""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

AR_COLOR, SD_COLOR, THEORY_COLOR, DRAFT_COLOR, PREFILL_COLOR = "#64748b", "#16a34a", "#2563eb", "#f59e0b", "#a78bfa"
Points = list[tuple[float, int]]  # (seconds of the run's own compute, tokens generated so far)
Passes = list[tuple[float, float, float]]  # per step: (start, draft seconds, verify seconds) on the run's own clock


def _layout(fig: go.Figure, title: str, x: str, y: str) -> go.Figure:
    fig.update_layout(title=title, xaxis_title=x, yaxis_title=y, height=300, margin=dict(l=50, r=20, t=50, b=40),
                      legend=dict(orientation="h", y=-0.25), template="plotly_white")
    return fig


def tokens_vs_time(ar: Points, sd: Points) -> go.Figure:
    """Tokens generated against each run's own compute time."""
    fig = go.Figure()
    for name, points, color in (("autoregressive", ar, AR_COLOR), ("speculative", sd, SD_COLOR)):
        fig.add_trace(go.Scatter(x=[t for t, _ in points], y=[n for _, n in points], name=name,
                                 mode="lines+markers", line=dict(color=color, shape="hv"), marker=dict(size=4)))
    return _layout(fig, "Tokens vs time", "seconds", "tokens generated")


def running_speedup_points(ar: Points, sd: Points) -> list[tuple[float, float]]:
    """At each event time, speculative tokens/s so far over autoregressive tokens/s so far (both cumulative).

    A finished run keeps its final rate, so the last value equals metrics.speedup for the whole runs.
    """
    times = sorted({t for t, _ in ar + sd if t > 0})
    out = []
    for t in times:
        rates = []
        for points in (ar, sd):
            done = [(s, n) for s, n in points if 0 < s <= t]
            rates.append(done[-1][1] / done[-1][0] if done else None)
        if rates[0] and rates[1] is not None:
            out.append((t, rates[1] / rates[0]))
    return out


def running_speedup(ar: Points, sd: Points) -> go.Figure:
    """Speedup so far (tokens/s ratio) against time."""
    points = running_speedup_points(ar, sd)
    fig = go.Figure(go.Scatter(x=[t for t, _ in points], y=[s for _, s in points], name="speedup",
                               mode="lines", line=dict(color=SD_COLOR, shape="hv")))
    fig.add_hline(y=1.0, line=dict(color=AR_COLOR, dash="dot"))
    return _layout(fig, "Running speedup (tokens/s ratio)", "seconds", "speedup ×")


def accepted_histogram(histogram: list[int]) -> go.Figure:
    """How many speculative steps accepted 0, 1, ..., k draft tokens."""
    fig = go.Figure(go.Bar(x=list(range(len(histogram))), y=histogram, marker_color=SD_COLOR, name="steps"))
    fig.update_xaxes(dtick=1)
    return _layout(fig, "Accepted draft tokens per step", "accepted drafts in the step", "steps")


def cost_title(c: float, verify_cost: float) -> str:
    """The cost ratio c and the verify cost, as both 'where the time goes' charts show them."""
    return f"c = {c:.3f} (draft token / target pass) · verify pass = {verify_cost:.2f}× a 1-token pass"


def timeline(ar: Passes, sd: Passes, c: float, verify_cost: float) -> go.Figure:
    """Every pass on its run's own clock, one row per run: the autoregressive run's 1-token target passes, and each
    speculative step's draft, then its verify pass. The first step of each run is the prefill."""
    fig = go.Figure()
    rows = [("autoregressive", ar[1:], 2, "target pass (1 token)", AR_COLOR),
            ("speculative", sd[1:], 1, "draft", DRAFT_COLOR),
            ("speculative", sd[1:], 2, "verify (k + 1 tokens)", SD_COLOR)]
    for row, steps, part, name, color in rows:
        base = [s + (d if part == 2 else 0.0) for s, d, _ in steps]
        width = [v if part == 2 else d for _, d, v in steps]
        fig.add_trace(go.Bar(y=[row] * len(steps), x=width, base=base, orientation="h", name=name,
                             marker=dict(color=color, line=dict(color="white", width=0.5)),
                             hovertemplate="%{base:.3f} s + %{x:.4f} s<extra>" + name + "</extra>"))
    prefill = [(row, steps[0]) for row, steps in (("autoregressive", ar), ("speculative", sd)) if steps]
    fig.add_trace(go.Bar(y=[r for r, _ in prefill], x=[s[1] + s[2] for _, s in prefill],
                         base=[s[0] for _, s in prefill], orientation="h", name="prefill",
                         marker=dict(color=PREFILL_COLOR), hovertemplate="prefill %{x:.4f} s<extra></extra>"))
    fig.update_layout(barmode="overlay", bargap=0.35)
    fig.update_yaxes(categoryorder="array", categoryarray=["speculative", "autoregressive"])
    return _layout(fig, "Where the time goes<br><sup>" + cost_title(c, verify_cost) + "</sup>", "seconds", "")


def position_acceptance(rates: list[float], drafted: list[int], alpha: float | None, c: float,
                        verify_cost: float) -> go.Figure:
    """Acceptance by draft position i = 1..k: the share of the steps that drafted a token at i (drafted[i - 1] of
    them, written on each bar) whose drafts 1..i were all accepted (vLLM's spec_decode_num_accepted_tokens_per_pos
    over its drafts), beside alpha^i."""
    positions = list(range(1, len(rates) + 1))
    fig = go.Figure(go.Bar(x=positions, y=rates, name="measured", marker_color=SD_COLOR,
                           text=[f"of {n}" for n in drafted], textposition="outside",
                           hovertemplate="position %{x}: %{y:.0%} %{text} steps<extra></extra>"))
    if alpha is not None and rates:
        fig.add_trace(go.Scatter(x=positions, y=[alpha**i for i in positions], name=f"α^i (α = {alpha:.2f})",
                                 mode="lines+markers", line=dict(color=THEORY_COLOR, dash="dash")))
    fig.update_xaxes(dtick=1)
    fig.update_yaxes(range=[0, 1.05], tickformat=".0%")
    return _layout(fig, "Acceptance by draft position<br><sup>" + cost_title(c, verify_cost) + "</sup>",
                   "draft position i", "drafts 1..i accepted")


BLANK_TITLES = {"tokens": "Tokens vs time", "speedup": "Running speedup (tokens/s ratio)",
                "histogram": "Accepted draft tokens per step", "timeline": "Where the time goes",
                "positions": "Acceptance by draft position"}


def blank(name: str) -> go.Figure:
    """A blank figure for one of the race's plots (a key of BLANK_TITLES) before it has data. The page draws these
    on load, so the browser loads plotly before a timed run rather than during one."""
    return _layout(go.Figure(), BLANK_TITLES[name], "", "")


def k_sweep(rows: list[dict], theory: list[tuple[int, float]], best_measured: int | None,
            best_theory: int | None, best_tree: str | None = None) -> go.Figure:
    """Measured speedup and acceptance rate per k, with the theoretical speedup curve and the best k marked; with
    rows of several draft-tree settings, speedup and tokens per pass per k for each setting (k_tree_sweep).

    rows: dicts with k, speedup, acceptance_rate (and tree, mean_accepted); theory: (k, expected speedup) pairs.
    """
    if len({r.get("tree") for r in rows}) > 1:
        return k_tree_sweep(rows, theory, best_measured, best_tree)
    fig = go.Figure()
    ks = [r["k"] for r in rows]
    fig.add_trace(go.Scatter(x=ks, y=[r["speedup"] for r in rows], name="measured speedup", mode="lines+markers",
                             line=dict(color=SD_COLOR)))
    if theory:
        fig.add_trace(go.Scatter(x=[k for k, _ in theory], y=[s for _, s in theory], name="theory (α, c)",
                                 mode="lines", line=dict(color=THEORY_COLOR, dash="dash")))
    fig.add_trace(go.Scatter(x=ks, y=[r["acceptance_rate"] for r in rows], name="acceptance rate",
                             mode="lines+markers", line=dict(color="#f97316"), yaxis="y2"))
    if best_measured is not None:
        fig.add_vline(x=best_measured, line=dict(color=SD_COLOR, dash="dot"),
                      annotation_text=f"best measured k={best_measured}", annotation_position="top left")
    if best_theory is not None and best_theory != best_measured:
        fig.add_vline(x=best_theory, line=dict(color=THEORY_COLOR, dash="dot"),
                      annotation_text=f"theory k={best_theory}", annotation_position="top right")
    fig.add_hline(y=1.0, line=dict(color=AR_COLOR, dash="dot"))
    fig.update_layout(yaxis2=dict(title="acceptance rate", overlaying="y", side="right", range=[0, 1.05]))
    fig.update_xaxes(dtick=1)
    return _layout(fig, "Speedup and acceptance vs k", "k (draft tokens per step)", "speedup ×")


TREE_DASH = {"off": "solid", "auto": "dash"}  # any node budget: dot


def k_tree_sweep(rows: list[dict], theory: list[tuple[int, float]], best_k: int | None,
                 best_tree: str | None) -> go.Figure:
    """Speedup (left axis) and tokens per pass (bonus included; right axis) against k, one pair of lines per
    draft-tree setting, beside the chains' theoretical speedup, the fastest point marked."""
    fig = go.Figure()
    for setting in dict.fromkeys(r["tree"] for r in rows):
        mine = [r for r in rows if r["tree"] == setting]
        ks, dash = [r["k"] for r in mine], TREE_DASH.get(setting, "dot")
        fig.add_trace(go.Scatter(x=ks, y=[r["speedup"] for r in mine], name=f"speedup, trees {setting}",
                                 mode="lines+markers", line=dict(color=SD_COLOR, dash=dash)))
        fig.add_trace(go.Scatter(x=ks, y=[r["mean_accepted"] for r in mine], name=f"tokens per pass, trees {setting}",
                                 mode="lines+markers", line=dict(color="#f97316", dash=dash), yaxis="y2"))
    if theory:
        fig.add_trace(go.Scatter(x=[k for k, _ in theory], y=[s for _, s in theory], name="theory (α, c), chains",
                                 mode="lines", line=dict(color=THEORY_COLOR, dash="dash")))
    if best_k is not None:
        fig.add_vline(x=best_k, line=dict(color=SD_COLOR, dash="dot"), annotation_position="top left",
                      annotation_text=f"best: k={best_k}, trees {best_tree}")
    fig.add_hline(y=1.0, line=dict(color=AR_COLOR, dash="dot"))
    fig.update_layout(yaxis2=dict(title="tokens per pass", overlaying="y", side="right", rangemode="tozero"))
    fig.update_xaxes(dtick=1)
    return _layout(fig, "Speedup and tokens per pass vs k, by draft-tree setting", "k (draft tokens per step)",
                   "speedup ×")


# ---- the batch-size sweep (specdemo.measure.batch_sizes): throughput and speedup against batch size ----

def _batch_axis(fig: go.Figure, sizes: list[int]) -> None:
    fig.update_xaxes(type="log", tickvals=sizes, ticktext=[str(b) for b in sizes])


def _mark_crossover(fig: go.Figure, crossover: int | None) -> None:
    if crossover is not None:
        fig.add_vline(x=crossover, line=dict(color="#dc2626", dash="dot"),
                      annotation_text=f"SD stops paying at B={crossover}", annotation_position="top left")


def batch_throughput(points: list[dict], crossover: int | None = None) -> go.Figure:
    """Total tokens/s of batched autoregressive and speculative decoding (and generate, where measured) against
    batch size. points: dicts with batch_size, ar_tokens_per_s, sd_tokens_per_s, hf_generate_tokens_per_s."""
    sizes = [p["batch_size"] for p in points]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=sizes, y=[p["ar_tokens_per_s"] for p in points], name="autoregressive",
                             mode="lines+markers", line=dict(color=AR_COLOR)))
    fig.add_trace(go.Scatter(x=sizes, y=[p["sd_tokens_per_s"] for p in points], name="speculative",
                             mode="lines+markers", line=dict(color=SD_COLOR)))
    if any(p.get("hf_generate_tokens_per_s") for p in points):
        fig.add_trace(go.Scatter(x=sizes, y=[p.get("hf_generate_tokens_per_s") for p in points],
                                 name="transformers generate", mode="lines+markers",
                                 line=dict(color=AR_COLOR, dash="dash")))
    _batch_axis(fig, sizes)
    _mark_crossover(fig, crossover)
    return _layout(fig, "Throughput vs batch size", "batch size (prompts decoded together)", "tokens/s, all rows")


def batch_speedup(points: list[dict], crossover: int | None = None) -> go.Figure:
    """Speculative over autoregressive throughput against batch size, each point labelled with its k, the theory's
    expected speedup at the auto k beside it, and the crossover marked."""
    sizes = [p["batch_size"] for p in points]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=sizes, y=[p["speedup"] for p in points], name="measured speedup",
                             mode="lines+markers+text", text=[f"k={p['k']}" for p in points],
                             textposition="top center", line=dict(color=SD_COLOR)))
    if any("expected_speedup" in p for p in points):
        fig.add_trace(go.Scatter(x=sizes, y=[p.get("expected_speedup") for p in points],
                                 name="theory at auto k", mode="lines+markers+text",
                                 text=[f"auto k={p.get('auto_k')}" for p in points], textposition="bottom center",
                                 line=dict(color=THEORY_COLOR, dash="dash")))
    fig.add_hline(y=1.0, line=dict(color=AR_COLOR, dash="dot"))
    _batch_axis(fig, sizes)
    _mark_crossover(fig, crossover)
    return _layout(fig, "Speedup vs batch size", "batch size (prompts decoded together)", "speedup ×")


# ---- the bench report (measure.bench.report's dict): bench.html ----

def bench_speedup_by_category(report: dict, vllm_methods: Sequence[str]) -> go.Figure:
    """Our speedup per prompt category, beside transformers' and vLLM's methods' where the report has them."""
    anchors = report.get("anchors") or {}
    cats = list(report["by_category"])
    fig = go.Figure(go.Bar(name="ours", x=cats, y=[report["by_category"][c]["speedup"] for c in cats]))
    for n in ("hf_prompt_lookup", "hf_assisted"):
        if anchors.get(f"{n}_speedup") is not None:
            fig.add_bar(name=n, x=cats, y=[report["by_category"][c].get(f"{n}_speedup") for c in cats])
    vllm = anchors.get("vllm") or {}
    for m in vllm_methods:
        if vllm.get(f"{m}_speedup") is not None:
            fig.add_bar(name=f"vLLM {m} (over vLLM plain)", x=cats,
                        y=[(vllm["by_category"].get(c) or {}).get(f"{m}_speedup") for c in cats])
    fig.add_hline(y=1.0, line_dash="dot")
    fig.update_layout(title="Speedup by category (total AR time / total SD time)", barmode="group",
                      yaxis_title="speedup")
    return fig


def bench_against_k(report: dict) -> go.Figure:
    """Speedup against k beside the theory's curve, and acceptance against k."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("speedup vs k", "acceptance vs k"))
    ks = [int(k) for k in report["by_k"]]
    by_k = list(report["by_k"].values())
    fig.add_scatter(x=ks, y=[a["speedup"] for a in by_k], mode="markers+lines", name="measured", row=1, col=1)
    theory = report.get("theory")
    if theory:
        tk = [int(k) for k in theory["theory"]]
        fig.add_scatter(x=tk, y=list(theory["theory"].values()), mode="lines", line_dash="dash",
                        name=f"theory (alpha {theory['alpha']:.2f}, c {theory['c']:.2f})", row=1, col=1)
    fig.add_scatter(x=ks, y=[a["acceptance_rate"] for a in by_k], mode="markers+lines", name="acceptance rate",
                    row=1, col=2)
    fig.add_scatter(x=ks, y=[a["mean_accepted"] for a in by_k], mode="markers+lines",
                    name="mean accepted (tokens/pass)", row=1, col=2)
    fig.update_xaxes(title_text="k (draft tokens per step)")
    return fig


def bench_vllm_throughput(vllm: dict, vllm_methods: Sequence[str]) -> go.Figure:
    """Tokens/s at batch 1 of our two runs and of vLLM's plain decoding and methods, on the same prompt ids."""
    names = ["ours AR", "ours SD", "vLLM plain", *[f"vLLM {m}" for m in vllm_methods if f"{m}_tokens_per_s" in vllm]]
    values = [vllm["ar_tokens_per_s"], vllm["ours_tokens_per_s"], vllm["plain_tokens_per_s"],
              *[vllm[f"{m}_tokens_per_s"] for m in vllm_methods if f"{m}_tokens_per_s" in vllm]]
    fig = go.Figure(go.Bar(x=names, y=values))
    fig.update_layout(title="tokens/s at batch 1: ours and vLLM on the same prompt ids", yaxis_title="tokens/s")
    return fig
