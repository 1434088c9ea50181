"""Would a retrieval drafter (REST, He et al. 2024) over the target's own training answers add to the hybrid?

REST drafts by finding the longest suffix of the context in a datastore of text and proposing the continuation most
of the matches share (a trie of continuations, followed while enough of them agree). Here the datastore is what the
draft was trained on: the target's own greedy answers in a distill cache (samples.jsonl; no evaluation prompt is in
it), so the continuations are in the target's own style and cost nothing to draft.

It replays the target's greedy answers to the prompts, as scripts/tree_sim.py does, and simulates three policies
step by step: the shipped hybrid (prompt lookup where the context repeats itself, else the draft's one token; the
draft's hit at each position comes from the teacher-forced replay), the hybrid with the datastore asked between the
two ("store"), and the draft's token followed by the datastore's continuation after it ("extend"; after a wrong
draft token the datastore is assumed to propose as often as after a right one). Time is the measured verify-pass
cost by width plus the draft head's measured cost per drafted token, in 1-token target passes. A development tool:
nothing in the package retrieves.

    python scripts/retrieval_sim.py --store out/draft/cache/samples.jsonl
    python scripts/retrieval_sim.py --store out/draft/cache/samples.jsonl --prompts prompts/independent.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from draft_agreement import target_answers  # noqa: E402  (beside this script)
from tree_sim import head_costs, sample_ranks  # noqa: E402
from specdemo.compare import load_pair  # noqa: E402
from specdemo.drafters import HybridDrafter, cut_at_eos  # noqa: E402
from specdemo.engine import encode_prompt  # noqa: E402
from specdemo.prompts import DEFAULT_PROMPTS  # noqa: E402
from specdemo.sweep import forward_seconds  # noqa: E402

K = 8  # the hybrid's k in the README's runs
MAX_MATCH = 8


class Store:
    """The answers as one array (-1 between them), indexed by every 2-gram's end position."""

    def __init__(self, path: Path, eos: int):
        tokens = []
        for line in path.open():
            s = json.loads(line)
            tokens += s["ids"][s["prompt_len"] :] + [-1]
        self.tokens = np.array(tokens)
        self.eos = eos
        self.index = defaultdict(list)
        for end in range(1, len(tokens) - 1):
            if tokens[end - 1] >= 0 and tokens[end] >= 0:
                self.index[tokens[end - 1], tokens[end]].append(end)
        self.index = {key: np.array(ends) for key, ends in self.index.items()}

    def propose(self, ctx: list[int], min_match: int, agree: float, support: int, k: int) -> list[int]:
        """The continuation of the longest suffix match (at least min_match tokens): each next token is the one most
        matches continue with, while at least `support` of them and a share `agree` of those left do."""
        ends = self.index.get(tuple(ctx[-2:])) if len(ctx) >= 2 else None
        if ends is None:
            return []
        length = np.full(len(ends), 2)
        for back in range(2, min(MAX_MATCH, len(ctx))):  # how far back each match goes, up to MAX_MATCH
            more = (length == back) & (ends - back >= 0)
            more[more] = self.tokens[ends[more] - back] == ctx[-1 - back]
            length[more] += 1
        if length.max() < min_match:
            return []
        ends, out = ends[length == length.max()], []
        for j in range(1, k + 1):
            nxt = self.tokens[np.minimum(ends + j, len(self.tokens) - 1)]
            values, counts = np.unique(nxt, return_counts=True)
            best = counts.argmax()
            if values[best] < 0 or counts[best] < support or counts[best] < agree * len(ends):
                break
            out.append(int(values[best]))
            ends = ends[nxt == values[best]]
            if values[best] == self.eos:
                break
        return out


def agreed(proposal: list[int], truth: list[int]) -> int:
    """How many leading proposed tokens the target's own continuation `truth` confirms."""
    n = 0
    for a, b in zip(proposal, truth):
        if a != b:
            break
        n += 1
    return n


def simulate(samples, hits, store, lookup, policy, setting, verify, c) -> tuple[float, float]:
    """(estimated speedup, tokens per verify pass) of a policy (None, "store" or "extend") over the answers, with
    the hybrid's prompt lookup (`lookup`) first."""
    eos = frozenset([store.eos])
    tokens = cost = passes = 0.0
    for s, hit in zip(samples, hits):
        ids, p = s["ids"], s["prompt_len"] + 1  # the first answer token comes from the prefill
        while p < len(ids):
            ctx = ids[:p]
            length, end = lookup.match(ctx)
            proposal, drafted = [], 0
            if length >= lookup.min_ngram:
                proposal = cut_at_eos(ids[end + 1 : end + 1 + K], eos)
            elif policy == "store":
                proposal = store.propose(ctx, *setting, K)
            if proposal:
                accepted = agreed(proposal, ids[p:])
                width = 1 + len(proposal)
            else:  # the draft's one token, then (extend) the store's continuation after it
                extra = store.propose(ids[: p + 1], *setting, K - 1) if policy == "extend" and p + 1 < len(ids) else []
                accepted = int(hit.get(p, False))
                if accepted:
                    accepted += agreed(extra, ids[p + 1 :])
                width, drafted = 2 + len(extra), 1
            gain = min(accepted + 1, len(ids) - p)
            tokens, cost, passes, p = tokens + gain, cost + verify[width] + drafted * c, passes + 1, p + gain
    return tokens / cost, tokens / passes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True, help="a distill cache's samples.jsonl (the draft's training answers)")
    p.add_argument("--prompts", default=DEFAULT_PROMPTS)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args(argv)
    pair = load_pair("smollm2-135m", "model", None)
    lookup = HybridDrafter(pair.drafter).lookup
    samples, _ = target_answers(pair, args.prompts, args.limit, args.max_new_tokens)
    hits = []  # per sample, {token position: the draft's top choice there was the target's token}
    for (r, rows), s in zip(sample_ranks(pair, samples, 1), samples):
        hits.append({i + 2: bool(r[i, 0] == 1) for i in np.flatnonzero(rows)})
    store = Store(Path(args.store), pair.target.tokenizer.eos_token_id)
    probe = encode_prompt(pair.target.tokenizer, "Explain why the sky is blue in two short paragraphs.") * 3
    seconds = forward_seconds(pair.target.model, probe, range(1, K + 2), repeats=7)
    verify = {w: s / seconds[1] for w, s in seconds.items()}
    c = head_costs(pair, [1])[1] / seconds[1]
    print(f"datastore: {len(store.tokens):,} tokens; verify cost by width: "
          + ", ".join(f"{w}: {v:.2f}" for w, v in verify.items()) + f"; draft head step {c:.3f}")
    base = simulate(samples, hits, store, lookup, None, None, verify, c)
    print(f"\nshipped hybrid: {base[0]:.3f}x estimated, {base[1]:.2f} tokens per pass\n")
    print("| policy | min match | agree | support | estimated speedup | against the hybrid | tokens per pass |")
    print("|---|---|---|---|---|---|---|")
    for policy, setting in itertools.product(("store", "extend"),
                                             itertools.product((2, 3, 4), (0.5, 0.7, 0.9), (1, 2, 4, 8))):
        speed, per_pass = simulate(samples, hits, store, lookup, policy, setting, verify, c)
        print(f"| {policy} | {setting[0]} | {setting[1]} | {setting[2]} | {speed:.3f}× | {speed / base[0] - 1:+.1%} "
              f"| {per_pass:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
