"""A draft tree as the step inspector draws it: each node's outcome (accepted, rejected, not reached), p and q, and
its place (depth across, a row down; the first branch, the chain the tree grew from, on one straight line), with the
target's correction or bonus hung after the accepted path. Plain data for render.py's script; no gradio, no models."""

from __future__ import annotations

from ..engine import StepEvent
from ..engine.text import token_texts


def outcomes(parents: list[int], path: list[int], greedy: bool) -> list[str]:
    """Each node's outcome: "accepted", "rejected" or "unreached". Greedy compares every child of an accepted node
    (or of the root) with the target's top token at once; recursive rejection sampling tries siblings in index order
    and stops at the first it accepts, so the siblings after that one were never tried."""
    taken = {parents[j]: j for j in path}  # a node on the path (or the root, -1) -> its accepted child
    out = []
    for j, a in enumerate(parents):
        if taken.get(a) == j:
            out.append("accepted")
        elif (a == -1 or a in taken.values()) and (greedy or a not in taken or j < taken[a]):
            out.append("rejected")
        else:
            out.append("unreached")
    return out


def layout(parents: list[int]) -> tuple[list[int], int, int]:
    """Rows for a tree drawn left to right: leaves take consecutive rows in depth-first order (children in index
    order), an inner node its first child's row. Returns (each node's row, the root's row, the number of rows)."""
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]  # by entry: 0 is the root, j + 1 is node j
    for j, a in enumerate(parents):
        kids[a + 1].append(j + 1)
    row = [0] * (len(parents) + 1)
    leaves = 0
    stack = [(0, False)]
    while stack:  # depth first, iteratively: an entry's row is known once its children's are
        entry, done = stack.pop()
        if not kids[entry]:
            row[entry], leaves = leaves, leaves + 1
        elif done:
            row[entry] = row[kids[entry][0]]
        else:
            stack.append((entry, True))
            stack += [(c, False) for c in reversed(kids[entry])]
    return row[1:], row[0], max(leaves, 1)


def tree_info(event: StepEvent, tokenizer, greedy: bool) -> dict:
    """What the inspector draws for a step that verified a tree: its nodes (text, parent, depth, row, outcome, p of the
    target after the parent, q of the draft; None where unknown) and the committed token (the target's correction, or
    the bonus after a leaf) as one more node after the path's last node."""
    parents, path = list(event.parents), list(event.accepted_path or [])
    committed = event.correction if event.correction is not None else event.bonus
    last = path[-1] if path else -1
    shape = parents + ([last] if committed is not None else [])  # the committed token drawn as the last's child
    rows, root, count = layout(shape)
    depth = [0] * len(shape)
    for j, a in enumerate(shape):
        depth[j] = 1 if a < 0 else depth[a] + 1
    q, p = event.draft_token_probs, event.target_token_probs
    nodes = [{"text": t, "parent": a, "depth": depth[j], "row": rows[j], "outcome": o,
              "p": p[j] if j < len(p) else None, "q": q[j] if q is not None and j < len(q) else None}
             for j, (t, a, o) in enumerate(zip(token_texts(tokenizer, event.drafted), parents,
                                              outcomes(parents, path, greedy)))]
    extra = None
    if committed is not None:
        kind = "correction" if event.correction is not None else "bonus"
        extra = {"text": token_texts(tokenizer, [committed])[0], "parent": last, "depth": depth[-1], "row": rows[-1],
                 "outcome": kind, "p": _top_p(event, last + 1, committed), "q": None}
    return {"nodes": nodes, "committed": extra, "path": path, "root_row": root, "rows": count,
            "depth": max(depth, default=0)}


def _top_p(event: StepEvent, entry: int, token: int) -> float | None:
    """The target's p of `token` after verify entry `entry`, where it is among the recorded top tokens."""
    ids, probs = event.target_top_ids, event.target_top_probs
    if entry < len(ids) and token in ids[entry]:
        return probs[entry][ids[entry].index(token)]
    return None


# The inspector's drawing of a tree (render.INSPECTOR_JS holds it, beside its helpers fmt, tok and el): SVG boxes
# and lines, one box per node coloured by its outcome, the accepted path's edges heavy, the committed token's dashed;
# hovering a box shows its p and q (an SVG <title>). Text goes in through textContent only.
TREE_JS = r"""
  const SVG = "http://www.w3.org/2000/svg";
  const svgEl = (tag, attrs) => { const e = document.createElementNS(SVG, tag);
    Object.entries(attrs || {}).forEach(([k, v]) => e.setAttribute(k, String(v))); return e; };
  const SAYS = {accepted: "accepted: on the path the target agreed with", rejected: "rejected by the target",
                unreached: "not reached: its parent was not accepted, or an earlier sibling was",
                correction: "the target's correction", bonus: "the target's bonus token after a leaf"};
  function drawTree(tree, pName, qName, deterministic) {
    const W = 96, H = 30, BW = 80, BH = 22, PAD = 4;
    const nodes = tree.nodes.concat(tree.committed ? [tree.committed] : []);
    const at = (j) => j < 0 ? [PAD, PAD + tree.root_row * H] : [PAD + nodes[j].depth * W, PAD + nodes[j].row * H];
    const width = 2 * PAD + tree.depth * W + BW, height = 2 * PAD + tree.rows * H - (H - BH);
    const svg = svgEl("svg", {viewBox: `0 0 ${width} ${height}`, width, height, class: "draft-tree"});
    nodes.forEach((n, j) => {  // the edges first, under the boxes
      const [x1, y1] = at(n.parent), [x2, y2] = at(j);
      const strong = n.outcome === "accepted" || j === tree.nodes.length;
      svg.appendChild(svgEl("line", {x1: x1 + BW, y1: y1 + BH / 2, x2, y2: y2 + BH / 2,
        class: "edge" + (strong ? " on" : "") + (j === tree.nodes.length ? " committed" : "")}));
    });
    const box = (x, y, shown, kind, hover) => {
      const g = svgEl("g", {class: "node node-" + kind});
      const title = svgEl("title"); title.textContent = hover; g.appendChild(title);
      g.appendChild(svgEl("rect", {x, y, width: BW, height: BH, rx: 4}));
      const label = svgEl("text", {x: x + BW / 2, y: y + BH / 2 + 4, "text-anchor": "middle"});
      label.textContent = shown.length > 11 ? shown.slice(0, 10) + "…" : shown;
      g.appendChild(label); svg.appendChild(g);
    };
    box(...at(-1), "start", "root", "the pending token: the target's own, chosen before this step");
    nodes.forEach((n, j) => box(...at(j), tok(n.text), n.outcome, `${tok(n.text)}: ${SAYS[n.outcome]}\n${pName} = `
      + fmt(n.p) + (j < tree.nodes.length ? `\n${qName} = ${deterministic ? "1" : fmt(n.q)}` : "")));
    return svg;
  }
"""

TREE_CSS = """
.inspector svg.draft-tree { display: block; max-width: 100%; height: auto; margin: 6px 0; }
.draft-tree text { font-family: ui-monospace, monospace; font-size: 11px; pointer-events: none; }
.draft-tree rect { stroke: #94a3b8; stroke-width: 1; }
.draft-tree .node-root rect { fill: rgba(148, 163, 184, 0.30); }
.draft-tree .node-accepted rect { fill: rgba(34, 197, 94, 0.35); stroke: #15803d; stroke-width: 2; }
.draft-tree .node-rejected rect { fill: rgba(239, 68, 68, 0.22); stroke: #b91c1c; }
.draft-tree .node-unreached rect { fill: rgba(148, 163, 184, 0.10); stroke-dasharray: 3 2; }
.draft-tree .node-correction rect { fill: rgba(249, 115, 22, 0.45); stroke: #c2410c; stroke-width: 2; }
.draft-tree .node-bonus rect { fill: rgba(59, 130, 246, 0.40); stroke: #1d4ed8; stroke-width: 2; }
.draft-tree .edge { stroke: #94a3b8; stroke-width: 1; }
.draft-tree .edge.on { stroke: #15803d; stroke-width: 2.5; }
.draft-tree .edge.committed { stroke-dasharray: 4 3; }
"""
