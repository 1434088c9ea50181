"""Plotly figures for the app: tokens over time, running speedup, accepted-length histogram, k sweep. No gradio.

Inputs are plain numbers (points, histograms, sweep rows) computed by specdemo.metrics; nothing here times anything.
"""

from __future__ import annotations

import plotly.graph_objects as go

AR_COLOR, SD_COLOR, THEORY_COLOR = "#64748b", "#16a34a", "#2563eb"
Points = list[tuple[float, int]]  # (seconds of the run's own compute, tokens generated so far)


def _layout(fig: go.Figure, title: str, x: str, y: str) -> go.Figure:
    fig.update_layout(title=title, xaxis_title=x, yaxis_title=y, height=300, margin=dict(l=50, r=20, t=40, b=40),
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


def k_sweep(rows: list[dict], theory: list[tuple[int, float]], best_measured: int | None,
            best_theory: int | None) -> go.Figure:
    """Measured speedup and acceptance rate per k, with the theoretical speedup curve and the best k marked.

    rows: dicts with k, speedup, acceptance_rate; theory: (k, expected speedup) pairs.
    """
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


# ---- the batch-size sweep (specdemo.batch_sweep): throughput and speedup against batch size ----

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
