"""HTML for the two text panels: every token a span, colored by what happened to it, and the step inspector's data
on the speculative spans (with the little script that shows it). No gradio, no models.

A span's text is the event's own text delta split over its tokens, so the committed text in a panel always
equals the concatenation of the events' text (special tokens and split multi-byte characters stay exact).
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass

from ..engine import StepEvent
from ..engine.text import token_texts
from .tree_view import TREE_CSS, TREE_JS, tree_info

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
#sd-panel span[data-step] { cursor: pointer; }
.tok-selected { outline: 2px solid #7c3aed; outline-offset: 0; }
.inspector { font-size: 13px; padding: 8px; border: 1px solid var(--border-color-primary, #ddd); border-radius: 6px;
  min-height: 60px; }
.inspector table { border-collapse: collapse; margin: 4px 0; }
.inspector td, .inspector th { padding: 1px 8px; text-align: left; font-family: ui-monospace, monospace; }
.inspector .why { margin-top: 4px; }
""" + TREE_CSS


@dataclass(frozen=True)
class Segment:
    """One displayed token: its kind (a key of KINDS), its text, and on the speculative panel the step (1-based)
    that drafted or committed it; the step's first segment carries the inspector's JSON for that step."""

    kind: str
    text: str
    step: int = 0  # 0: no speculative step (the autoregressive panel, the prefill token)
    info: str = ""


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


def event_segments(event: StepEvent, tokenizer, speculative: bool, step: int = 0,
                   greedy: bool = True) -> list[Segment]:
    """The segments one step adds: committed tokens in order, with rejected drafts where they were proposed. With
    `step` (the speculative step's number), they carry it and the first one the inspector's JSON (step_info)."""
    texts = split_text(token_texts(tokenizer, event.tokens), event.text)
    if not speculative:
        return [Segment("plain", t) for t in texts]
    if event.kind != "spec":
        return [Segment("target", t) for t in texts]
    out = _spec_segments(event, tokenizer, texts)
    if step and out:
        info = json.dumps(step_info(event, tokenizer, step, greedy), ensure_ascii=False)
        out = [Segment(s.kind, s.text, step, info if i == 0 else "") for i, s in enumerate(out)]
    return out


def _spec_segments(event: StepEvent, tokenizer, texts: list[str]) -> list[Segment]:
    out = []
    for i, text in enumerate(texts):
        if i == event.num_accepted:  # the rejected drafts sit just before the target's correction
            out += [Segment("rejected", t) for t in token_texts(tokenizer, event.rejected_branch)]
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


# where a step's draft came from (StepEvent.draft_source), in the inspector's words; the hybrid names its half, suffix
# decoding the text its draft continues (drafters.suffix.SOURCES); None: a drafter with one source says nothing
DRAFT_SOURCES = {
    "model": "the draft model",
    "lookup": "prompt lookup (the context's last tokens occurred before)",
    "prompt": "the prompt (suffix decoding: this request's own text)",
    "answer": "this answer, earlier in the text being written (suffix decoding)",
    "earlier": "an earlier answer in this browser session (suffix decoding's cache; Clear suffix cache forgets them)",
}
SUFFIX_SOURCES = ("prompt", "answer", "earlier")


def step_info(event: StepEvent, tokenizer, step: int, greedy: bool) -> dict:
    """What the inspector shows for one speculative step: each drafted token with p and q and whether it was kept,
    and at the first rejected position (or, after a full acceptance, the bonus position) the target's top tokens.

    p is the target's probability (softmax at temperature 1 when greedy; the distribution rejection sampling uses
    otherwise), q the draft's (None: a deterministic drafter such as prompt lookup, q = 1). `source` is where the
    draft came from (DRAFT_SOURCES names it in `from`), `model_free` the deterministic drafter's name. A step that
    verified a draft tree adds `tree` (tree_view.tree_info, which the script draws); its nodes' outcomes and parents
    are the tree's, and the top tokens are those after the accepted path's last node.
    """
    n = len(event.drafted)
    at = event.num_accepted  # the first rejected position; n after a full acceptance
    q = event.draft_token_probs
    drafted = [{"text": t, "outcome": "accepted" if i < at else "rejected" if i == at else "discarded",
                "p": _at(event.target_token_probs, i), "q": q[i] if q is not None and i < len(q) else None}
               for i, t in enumerate(token_texts(tokenizer, event.drafted))]
    entry, full, tree = at, at == n, None  # entry: the verify entry the target's next token came after
    if event.parents is not None:  # a tree: the outcomes are the tree's, the next token comes after the path's end
        tree = tree_info(event, tokenizer, greedy)
        for d, node in zip(drafted, tree["nodes"]):
            d["outcome"], d["parent"] = node["outcome"], node["parent"]
        entry, full = (event.accepted_path[-1] + 1 if event.accepted_path else 0), event.correction is None
    ids, probs = _at(event.target_top_ids, entry) or [], _at(event.target_top_probs, entry) or []
    top = [{"text": t, "p": p} for t, p in zip(token_texts(tokenizer, ids), probs)]
    committed = event.correction if event.correction is not None else event.bonus
    info = {"step": step, "k": event.k, "drafted": drafted, "accepted": at, "position": at + 1, "full": full,
            "top": top, "gap": _at(event.target_top2_gap, entry), "greedy": greedy, "deterministic": q is None,
            "committed": token_texts(tokenizer, [committed])[0] if committed is not None else None,
            "committed_kind": "correction" if event.correction is not None else "bonus" if n else "target",
            "rule": event.verification or ("greedy" if greedy else "token"), "source": event.draft_source,
            "from": DRAFT_SOURCES.get(event.draft_source) if n else None,
            "model_free": "suffix decoding" if event.draft_source in SUFFIX_SOURCES else "prompt lookup"}
    return info | ({"tree": tree} if tree is not None else {})


def _at(values: list | None, i: int):
    return values[i] if values is not None and 0 <= i < len(values) else None


def segments_html(segments: list[Segment], hide_rejected: bool = False, stats: str = "", inspect: bool = True) -> str:
    """A panel: an optional stats line, then one span per segment (with data-step and data-info when present, unless
    not `inspect`: a live frame leaves the inspector's data out, so the page has less to draw while runs are timed)."""
    spans = "".join(f'<span class="{KINDS[s.kind][0]}"{_data(s) if inspect else ""}>{html.escape(_shown(s))}</span>'
                    for s in segments)
    panel_class = "tok-panel hide-rejected" if hide_rejected else "tok-panel"
    head = f'<div class="panel-stats">{html.escape(stats)}</div>' if stats else ""
    return f'{head}<div class="{panel_class}">{spans}</div>'


def _data(segment: Segment) -> str:
    out = f' data-step="{segment.step}"' if segment.step else ""
    return out + (f' data-info="{html.escape(segment.info, quote=True)}"' if segment.info else "")


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


INSPECTOR_HINT = "Click a token of the speculative panel to see its step: what was drafted, what the target thought."


def inspector_html() -> str:
    """The inspector's empty panel; INSPECTOR_JS fills it on a click."""
    return f'<div class="inspector" id="inspector-body">{html.escape(INSPECTOR_HINT)}</div>'


# Runs once on page load (Blocks.launch(js=...)). One listener on the document, so panels re-rendered by every frame
# keep working; every text goes in through textContent, never as HTML.
INSPECTOR_JS = r"""
() => {
  const fmt = (x) => (x === null || x === undefined) ? "–" : Number(x).toFixed(3);
  const tok = (t) => JSON.stringify(t);
  const el = (tag, text, cls) => { const e = document.createElement(tag); if (text !== undefined) e.textContent = text;
                                   if (cls) e.className = cls; return e; };
  const row = (cells, tag) => {
    const tr = el("tr"); cells.forEach((c) => tr.appendChild(el(tag || "td", c))); return tr; };
  /*TREE*/
  function show(info) {
    const body = document.getElementById("inspector-body");
    if (!body) return;
    body.replaceChildren();
    const n = info.drafted.length;
    const what = info.tree ? `a tree of ${n} drafted nodes, ${info.accepted} accepted along its path`
                           : `${n} drafted, ${info.accepted} accepted`;
    body.appendChild(el("div", `Step ${info.step}: k = ${info.k}, ${what}`
      + (info.committed !== null ? `, then the target's ${info.committed_kind} ${tok(info.committed)}` : ""), "head"));
    const rules = {greedy: "greedy (a draft is kept while it is the target's top token)",
                   token: "token-wise rejection sampling (Leviathan et al.): each draft on its own",
                   block: "block verification (Sun et al.): the drafts judged together"};
    body.appendChild(el("div", `Decided by: ${rules[info.rule] || info.rule}`, "rule"));
    if (info.from) body.appendChild(el("div", `Drafted from: ${info.from}`, "source"));
    const pName = info.greedy ? "p (target, softmax at temperature 1)" : "p (target, as sampled)";
    const qName = info.deterministic ? `q (${info.model_free || "prompt lookup"}: 1)` : "q (draft)";
    if (info.tree) {
      body.appendChild(drawTree(info.tree, pName, qName, info.deterministic));
      body.appendChild(el("div", "Green: the accepted path; red: rejected by the target; dashed grey: not reached; "
        + "orange or blue: the target's correction or bonus. Hover a node for its p and q.", "tree-key"));
    }
    if (n) {
      const t = el("table", undefined, "drafted");
      const after = (d) => info.tree ? [d.parent < 0 ? "start" : String(d.parent + 1)] : [];
      t.appendChild(row(["#", ...(info.tree ? ["after #"] : []), "drafted", "outcome", pName, qName], "th"));
      info.drafted.forEach((d, i) => t.appendChild(row([String(i + 1), ...after(d), tok(d.text), d.outcome,
                                                          fmt(d.p), info.deterministic ? "1" : fmt(d.q)])));
      body.appendChild(t);
    }
    const where = info.full ? (n ? `every draft accepted; the bonus position ${info.position}` : "no draft this step")
                            : `first rejected position ${info.position}`;
    const off = info.drafted.filter((d) => d.outcome !== "accepted").length;
    if (info.tree && info.full && off) {
      body.appendChild(el("div", "Why: the accepted path runs to a leaf of the tree, so the target adds its bonus "
        + `token; ${off === 1 ? "the one other node lies" : `the other ${off} nodes lie`} off that path: `
        + "a rejected one "
        + (info.greedy ? "is not the target's top token after its parent"
                       : "was rejected before its accepted sibling was tried (recursive rejection sampling)")
        + ", and a node under it is never reached.", "why"));
    } else if (info.tree && !info.full) {
      const tried = info.drafted.filter((d) => d.outcome === "rejected"
        && d.parent === (info.tree.path.length ? info.tree.path[info.tree.path.length - 1] : -1)).length;
      const one = tried === 1;
      body.appendChild(el("div", `Why: at depth ${info.position}, ${one ? "the one node" : `the ${tried} nodes`} `
        + "drafted after the accepted path " + (info.greedy ? `${one ? "is" : "are"} not the target's top token.`
          : `${one ? "was" : "were"} rejected, in index order (recursive rejection sampling: a rejected node's q is `
            + "taken off p before the next sibling is tried), and the target's token came from what was left."),
        "why"));
    } else if (!info.full) {
      const d = info.drafted[info.accepted];
      const q = info.deterministic ? 1 : d.q;
      const rule = info.greedy ? ", and greedy keeps a draft only if it is the target's top token."
        : info.rule === "block" ? "; block verification keeps the drafts up to the last position whose draw passes "
          + "a threshold that weighs the whole prefix (p/q products capped at 1), so a draft with p < q may still be "
          + "kept when the next ones make up for it; here the block was cut before this one."
        : `; it was kept with probability min(1, p/q) = ${fmt(Math.min(1, d.p / q))}.`;
      body.appendChild(el("div", `Why: the draft proposed ${tok(d.text)} with q = ${fmt(q)}; the target gives it `
        + `p = ${fmt(d.p)}` + rule, "why"));
    }
    body.appendChild(el("div", `Target's top ${info.top.length} at the ${where}:`, "where"));
    const top = el("table", undefined, "top");
    top.appendChild(row(["token", pName], "th"));
    info.top.forEach((c) => top.appendChild(row([tok(c.text), fmt(c.p)])));
    body.appendChild(top);
    if (info.greedy && info.gap !== null) {
      body.appendChild(el("div", `Top-2 logit gap there: ${fmt(info.gap)} `
        + "(a near-tie would make half precision flip it)", "gap"));
    }
  }
  document.addEventListener("click", (ev) => {
    const span = ev.target.closest ? ev.target.closest("#sd-panel span[data-step]") : null;
    if (!span) return;
    const panel = span.closest(".tok-panel");
    const step = span.dataset.step;
    const first = panel.querySelector(`span[data-step="${step}"][data-info]`);
    if (!first) return;
    panel.querySelectorAll(".tok-selected").forEach((s) => s.classList.remove("tok-selected"));
    panel.querySelectorAll(`span[data-step="${step}"]`).forEach((s) => s.classList.add("tok-selected"));
    show(JSON.parse(first.dataset.info));
  });
}
""".replace("/*TREE*/", TREE_JS)
