"""HTML for the two text panels: every token a span, colored by what happened to it. No gradio, no models.

A span's text is the event's own text delta split over its tokens, so the committed text in a panel always
equals the concatenation of the events' text (special tokens and split multi-byte characters stay exact).
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from .engine import StepEvent
from .text import token_texts

# kind -> (css class, legend label); "plain" is the autoregressive panel, where every token is the target's own
KINDS = {
    "plain": ("tok-plain", "autoregressive token"),
    "target": ("tok-target", "target's own token (prefill, or no draft)"),
    "accepted": ("tok-accepted", "accepted draft token"),
    "rejected": ("tok-rejected", "rejected draft token (never committed)"),
    "correction": ("tok-correction", "target's correction after a rejection"),
    "bonus": ("tok-bonus", "bonus token after a full acceptance"),
}
COMMITTED = ("plain", "target", "accepted", "correction", "bonus")

CSS = """
.tok-panel { white-space: pre-wrap; font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 14px;
  line-height: 1.6; min-height: 220px; max-height: 420px; overflow-y: auto; padding: 8px;
  border: 1px solid var(--border-color-primary, #ddd); border-radius: 6px; }
.tok-panel span { border-radius: 3px; }
.tok-plain { }
.tok-target { background: rgba(148, 163, 184, 0.30); }
.tok-accepted { background: rgba(34, 197, 94, 0.35); }
.tok-rejected { background: rgba(239, 68, 68, 0.22); color: #b91c1c; text-decoration: line-through; }
.tok-correction { background: rgba(249, 115, 22, 0.45); }
.tok-bonus { background: rgba(59, 130, 246, 0.40); }
.hide-rejected .tok-rejected { display: none; }
.tok-legend { display: flex; flex-wrap: wrap; gap: 6px 10px; }
.tok-legend span { padding: 1px 6px; white-space: nowrap; }
.panel-stats { font-size: 13px; margin-bottom: 4px; opacity: 0.85; }
"""


@dataclass(frozen=True)
class Segment:
    """One displayed token: its kind (a key of KINDS) and its text."""

    kind: str
    text: str


def split_text(pieces: list[str], text: str) -> list[str]:
    """Share `text` among tokens whose standalone decodings are `pieces`; the parts always join to `text`.

    A piece that does not continue the text (a special token, half of a multi-byte character) gets "",
    and whatever is left over goes to the last token.
    """
    parts, rest = [], text
    for piece in pieces:
        if piece and rest.startswith(piece):
            parts.append(piece)
            rest = rest[len(piece) :]
        else:
            parts.append("")
    if parts and rest:
        parts[-1] += rest
    return parts


def event_segments(event: StepEvent, tokenizer, speculative: bool) -> list[Segment]:
    """The segments one step adds: committed tokens in order, with rejected drafts where they were proposed."""
    texts = split_text(token_texts(tokenizer, event.tokens), event.text)
    if not speculative:
        return [Segment("plain", t) for t in texts]
    if event.kind != "spec":
        return [Segment("target", t) for t in texts]
    out = []
    for i, text in enumerate(texts):
        if i == event.num_accepted:  # the rejected drafts sit just before the target's correction
            out += [Segment("rejected", t) for t in token_texts(tokenizer, event.rejected)]
        if i < event.num_accepted:
            kind = "accepted"
        elif event.correction is not None:
            kind = "correction"
        elif event.bonus is not None:
            kind = "bonus"
        else:
            kind = "target"  # the drafter proposed nothing this step
        out.append(Segment(kind, text))
    return out


def segments_html(segments: list[Segment], hide_rejected: bool = False, stats: str = "") -> str:
    """A panel: an optional stats line, then one span per segment."""
    spans = "".join(f'<span class="{KINDS[s.kind][0]}">{html.escape(_shown(s))}</span>' for s in segments)
    panel_class = "tok-panel hide-rejected" if hide_rejected else "tok-panel"
    head = f'<div class="panel-stats">{html.escape(stats)}</div>' if stats else ""
    return f'{head}<div class="{panel_class}">{spans}</div>'


def _shown(segment: Segment) -> str:
    """Rejected drafts never reach the text, so their line breaks are drawn as a symbol rather than taken."""
    return segment.text.replace("\n", "\u21b5") if segment.kind == "rejected" else segment.text


def panel_stats(tokens: int, seconds: float) -> str:
    """The line above a panel: token count, tokens/s and seconds of the run's own compute."""
    rate = tokens / seconds if seconds > 0 else 0.0
    return f"{tokens} tokens · {rate:.1f} tokens/s · {seconds:.2f} s"


def legend_html() -> str:
    """The color key for the speculative panel."""
    keys = ("target", "accepted", "rejected", "correction", "bonus")
    items = "".join(f'<span class="{KINDS[k][0]}">{html.escape(KINDS[k][1])}</span>' for k in keys)
    return f'<div class="tok-legend">{items}</div>'
