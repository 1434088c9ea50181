"""Would a token tree (EAGLE/SpecInfer-style: several draft candidates per step, verified in one pass with a tree
attention mask) beat the chain the engine drafts, on this machine, with the shipped draft?

It replays the target's greedy answers to the prompts (teacher forced, as scripts/draft_agreement.py does) and records
the rank of the target's token in the draft's distribution at draft steps 1..3, each step fed the target's true
token before it (which is what a tree node on the accepted path sees). A tree is a set of rank paths, e.g. (1,), (2,),
(1, 1): the top-2 candidates at step 1 and the top-1 continuation of the first. Its tokens per target pass are
1 + the depth of the deepest node on the target's path, averaged over every draftable position. Its cost is a verify
pass of 1 + |tree| tokens (measured as a chain pass of that width: the linear layers dominate at these lengths, and a
tree mask does not change their cost) plus one draft-head step per level (measured with that level's width). A
development tool: nothing in the package drafts trees.

    python scripts/tree_sim.py                     # the evaluation prompts
    python scripts/tree_sim.py --prompts prompts/independent.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from draft_agreement import answer_features, target_answers  # noqa: E402  (beside this script)
from specdemo import distill  # noqa: E402
from specdemo.compare import load_pair  # noqa: E402
from specdemo.engine import encode_prompt  # noqa: E402
from specdemo.prompts import DEFAULT_PROMPTS  # noqa: E402
from specdemo.sweep import forward_seconds  # noqa: E402

DEPTH = 3
MISS = 10**6  # rank of a token the draft cannot propose (outside its subset)


def ranks(pair, prompts: str, limit: int | None, max_new_tokens: int) -> np.ndarray:
    """(N, DEPTH): the target token's rank (1 = the draft's top choice) at each draft step, per draftable position."""
    samples, _ = target_answers(pair, prompts, limit, max_new_tokens)
    return np.concatenate([r[rows] for r, rows in sample_ranks(pair, samples, DEPTH)])


def sample_ranks(pair, samples: list[dict], depth: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per sample, (ranks (T, depth), draftable (T,) bool): row i at step d ranks the target's token at position
    i + d + 1 of the sample's ids (the draft fed the true features up to i and the true tokens up to i + d)."""
    head = pair.drafter.head
    data = answer_features(pair, samples, head)
    sub_index = distill.subset_index(head)
    out = []
    with torch.no_grad():
        for i in range(len(samples)):
            feats, tokens, labels, valid, t = distill._batch(samples, data, [i], 1 << 16, 0, depth, sub_index, "cpu")
            rows = distill._draftable_rows(samples, [i], 1 << 16, 0, t, depth)[0]
            per_step = []
            for d, g in enumerate(head.unrolled(feats[:, :t], tokens, depth), start=1):
                logits, lab, ok = head.logits(g)[0], labels[0, d : d + t], valid[0, d : d + t]
                rank = (logits > logits.gather(1, lab.clamp(min=0)[:, None])).sum(1) + 1
                per_step.append(torch.where(ok, rank, torch.full_like(rank, MISS)))
            out.append((torch.stack(per_step, 1).numpy(), rows.numpy()))
    return out


def head_costs(pair, widths, context: int = 200, repeats: int = 20) -> dict[int, float]:
    """Seconds of one draft-head step over `w` new tokens (with the logits of each) after `context` cached positions."""
    head = pair.drafter.head
    dtype, h = head.head_weight.dtype, head.c.hidden_size
    feats = torch.randn(1, context, h, dtype=dtype)
    with torch.no_grad():
        _, k, v = head(feats, torch.zeros(1, context, dtype=torch.long), torch.arange(context))
        out = {}
        for w in widths:
            x, tok, pos = torch.randn(1, w, h, dtype=dtype), torch.zeros(1, w, dtype=torch.long), torch.arange(w) + context
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                g, _, _ = head(x, tok, pos, k, v)
                head.logits(g[0]).argmax(-1)
                best = min(best, time.perf_counter() - t0)
            out[w] = best
    return out


def accepted(r: np.ndarray, tree: list[tuple[int, ...]]) -> np.ndarray:
    a = np.zeros(len(r))
    for path in tree:
        hit = np.all(r[:, : len(path)] == np.array(path), axis=1)
        a = np.where(hit, np.maximum(a, len(path)), a)
    return a


def family() -> list[list[tuple[int, ...]]]:
    """Trees along the top-1 spine: w1 candidates at step 1, w2 under the first and u2 under the second, w3 under
    (1, 1): 374 shapes, from the chain k = 1 to 17 nodes."""
    trees = []
    for w1, w2, u2, w3 in itertools.product(range(1, 9), range(0, 5), range(0, 3), range(0, 4)):
        if (u2 and w1 < 2) or (w3 and not w2):
            continue
        tree = [(i,) for i in range(1, w1 + 1)] + [(1, j) for j in range(1, w2 + 1)]
        tree += [(2, j) for j in range(1, u2 + 1)] + [(1, 1, j) for j in range(1, w3 + 1)]
        trees.append(tree)
    return trees


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", default=DEFAULT_PROMPTS)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args(argv)
    pair = load_pair("smollm2-135m", "model", None)
    r = ranks(pair, args.prompts, args.limit, args.max_new_tokens)
    trees = family()
    widths = sorted({1 + len(t) for t in trees})
    probe = encode_prompt(pair.target.tokenizer, "Explain why the sky is blue in two short paragraphs.") * 3
    seconds = forward_seconds(pair.target.model, probe, widths, repeats=7)
    verify = {w: s / seconds[1] for w, s in seconds.items()}  # over a 1-token pass
    hc = {w: s / seconds[1] for w, s in head_costs(pair, range(1, 9)).items()}
    print(f"{len(r)} draftable positions; rank <= m at steps 1..{DEPTH}:")
    for m in (1, 2, 3, 4, 8):
        print(f"  m = {m}: " + " / ".join(f"{(r[:, d] <= m).mean():.3f}" for d in range(DEPTH)))
    print("verify pass cost by width (over 1 token): " + ", ".join(f"{w}: {verify[w]:.2f}" for w in widths))
    print("draft-head step cost by width (over a 1-token target pass): " + ", ".join(f"{w}: {c:.3f}" for w, c in hc.items()))
    scored = []
    for tree in trees:
        levels = [sum(len(q) == d for q in tree) for d in range(1, DEPTH + 1)]
        inputs = [1] + levels[:-1]  # level d's head step reads the nodes of level d - 1
        draft = sum(hc[min(w, 8)] for w, n in zip(inputs, levels) if n)
        tokens = 1 + accepted(r, tree).mean()
        scored.append((tokens / (verify[1 + len(tree)] + draft), tokens, tree))
    scored.sort(key=lambda s: -s[0])
    chain = [s for s in scored if s[2] in ([(1,)], [(1,), (1, 1)], [(1,), (1, 1), (1, 1, 1)])]
    print("\n| tree | nodes | tokens per pass | estimated speedup |\n|---|---|---|---|")
    for s, tokens, tree in scored[:8] + [c for c in sorted(chain, key=lambda c: len(c[2])) if c not in scored[:8]]:
        print(f"| {' '.join(''.join(map(str, q)) for q in tree)} | {len(tree)} | {tokens:.2f} | {s:.2f}× |")
    best_tokens = max(scored, key=lambda s: s[1])
    print(f"\nmost tokens per pass in the family: {best_tokens[1]:.2f} ({len(best_tokens[2])} nodes, {best_tokens[0]:.2f}×)")
    for m in (8, 32):  # every node of rank <= m at every step: an upper bound for trees of that width
        full = 1 + np.cumprod(r <= m, axis=1).sum(1).mean()
        print(f"a full tree of the top {m} at each of {DEPTH} steps ({sum(m ** d for d in range(1, DEPTH + 1)):,} nodes): "
              f"{full:.2f} tokens per pass")
    return 0


if __name__ == "__main__":
    sys.exit(main())
