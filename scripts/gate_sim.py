"""Choose k and the trained draft's confidence gate from one recorded run instead of a grid of timed runs.

One greedy speculative run per prompt at the widest k records, for every step, the draft's confidence in each token
and how many the target accepted. A gate g with k tokens at most would have proposed L = 1 + (leading later tokens
with confidence >= g), capped at k, and kept min(accepted, L) + 1 tokens. Costs come from the forward-pass
micro-benchmark (a (L+1)-token verify pass in units of a 1-token pass) and the draft's measured cost per token, so
the table estimates the speedup of every (k, gate) over plain decoding. A development tool, not part of the package;
`python -m specdemo bench` then measures the chosen setting for real.

    python scripts/gate_sim.py --draft assets/smollm2-135m-draft --k 5
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdemo.compare import load_pair  # noqa: E402
from specdemo.config import GenerationConfig  # noqa: E402
from specdemo.engine import autoregressive, encode_prompt, speculative  # noqa: E402
from specdemo.prompts import DEFAULT_PROMPTS, read_prompts  # noqa: E402
from specdemo.sweep import forward_costs  # noqa: E402

GATES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
FIRST_GATES = (0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4)


def record(pair, prompts: list[list[int]], k: int, max_new_tokens: int) -> tuple[list[tuple[list[float], int]], float]:
    """[(confidences, accepted)] per speculative step, and the draft's seconds per drafted token."""
    config = GenerationConfig(max_new_tokens=max_new_tokens, num_draft_tokens=k)
    drafter = pair.drafter
    steps, draft_s, drafted = [], 0.0, 0
    for ids in prompts:
        for event in speculative(pair.target.model, pair.target.tokenizer, drafter, ids, config):
            if event.kind == "spec" and event.drafted:
                steps.append((list(drafter.confidences), event.num_accepted))
                draft_s += event.draft_seconds
                drafted += len(event.drafted)
    return steps, draft_s / max(drafted, 1)


def simulate(steps, k: int, gate: float, c: float, verify: dict[int, float],
             first_gate: float = 0.0) -> tuple[float, float]:
    """(estimated speedup over plain decoding, mean tokens per target pass) for at most k drafts and this gate;
    a first token less sure than first_gate is not proposed (a plain 1-token pass, after paying for its draft)."""
    tokens = cost = 0.0
    for conf, accepted in steps:
        if conf[0] < first_gate:
            tokens += 1
            cost += c + verify[1]
            continue
        n = 1
        while n < min(k, len(conf)) and conf[n] >= gate:
            n += 1
        tokens += min(accepted, n) + 1
        cost += n * c + verify[n + 1]
    return tokens / cost, tokens / len(steps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draft", default=None, help="trained draft folder (default: the shipped one)")
    p.add_argument("--prompts", default=DEFAULT_PROMPTS)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args(argv)
    pair = load_pair("smollm2-135m", "model", args.draft)
    pair.drafter.min_confidence = 0.0
    tok = pair.target.tokenizer
    prompts = [encode_prompt(tok, it.prompt) for it in read_prompts(args.prompts, args.limit)]
    verify = forward_costs(pair.target.model, prompts[0], list(range(1, args.k + 2)), repeats=5)
    short = GenerationConfig(max_new_tokens=32)
    events = [e for ids in prompts[:3] for e in autoregressive(pair.target.model, tok, ids, short) if e.kind == "ar"]
    per_token = sum(e.verify_seconds for e in events) / sum(len(e.tokens) for e in events)
    steps, draft_per_token = record(pair, prompts, args.k, args.max_new_tokens)
    c = draft_per_token / per_token
    print(f"{len(steps)} steps; c = {c:.3f}; verify cost by width: "
          + ", ".join(f"{w}: {v:.2f}" for w, v in sorted(verify.items())))
    print("gate \\ k  " + "  ".join(f"{k:>11}" for k in range(1, args.k + 1)))
    best = (0.0, 0, 0.0)
    for gate in GATES:
        row = []
        for k in range(1, args.k + 1):
            speedup, mean = simulate(steps, k, gate, c, verify)
            row.append(f"{speedup:5.2f}x/{mean:4.2f}")
            best = max(best, (speedup, k, gate))
        print(f"{gate:>8.1f}  " + "  ".join(row))
    print(f"best: k = {best[1]}, gate = {best[2]}, estimated {best[0]:.2f}x (estimated speedup / tokens per pass)")
    k, gate = best[1], best[2]
    print(f"first-token gate at k = {k}, gate = {gate}: " + ", ".join(
        f"{g}: {simulate(steps, k, gate, c, verify, g)[0]:.3f}x" for g in FIRST_GATES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
