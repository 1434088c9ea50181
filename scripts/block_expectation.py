"""Each verification rule's expected accepted length on real drafts, exactly per drafted block: no timing.

Sampled decoding runs (token-wise rule) on a prompt set; at every verify step the drafted block, its q rows and the
target's p rows go through verify.expected_accepted, which gives both rules' expected number of accepted drafts for
that very block (token-wise: sum_i prod_{j<=i} min(1, p/q); block: sum_i i P(tau = i), Sun et al. Alg. 2). Averaged
over the steps (blocks drawn from q) each is that rule's expected accepted length on these contexts, paired on the same
blocks, so the difference carries far less noise than two sampled bench runs. The rule is wrapped in ROW_RULES, the
table the engine reads, only inside this script.

    python scripts/block_expectation.py --draft smollm2-135m-draft --k 2,4 --temperature 1.0,0.7 --out out/x.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdemo.config import GenerationConfig, SamplingConfig  # noqa: E402
from specdemo.engine import (
    encode_prompt,  # noqa: E402
    verify,  # noqa: E402
)
from specdemo.engine.loop import decode  # noqa: E402
from specdemo.measure.compare import load_pair  # noqa: E402
from specdemo.prompts import DEFAULT_PROMPTS, read_prompts  # noqa: E402


def recorded(steps: list[dict]):
    """rejection_accept_rows, also recording both rules' expectations for each row's block it is given."""
    inner = verify.rejection_accept_rows

    def rule(drafted, lengths, draft_probs, target_probs, generators, draws):
        for r, n in enumerate(lengths.tolist()):
            if n:
                q = None if draft_probs is None else draft_probs[r, :n]
                steps.append({"k": n, **verify.expected_accepted(drafted[r, :n], q, target_probs[r, : n + 1])})
        return inner(drafted, lengths, draft_probs, target_probs, generators, draws)

    return rule


def summary(steps: list[dict]) -> dict:
    """Mean expected accepted drafts per rule over the blocks, and the paired difference's standard error."""
    gain = [s["block"] - s["token"] for s in steps]
    return {"blocks": len(steps), "token": statistics.fmean(s["token"] for s in steps),
            "block": statistics.fmean(s["block"] for s in steps), "gain": statistics.fmean(gain),
            "gain_se": statistics.stdev(gain) / len(gain) ** 0.5 if len(gain) > 1 else None,
            "blocks_with_gain": sum(g > 1e-9 for g in gain) / len(gain),
            "min_gain": min(gain), "max_gain": max(gain)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", default=None, help="the draft (default: the target's trained draft)")
    p.add_argument("--drafter", default="model")
    p.add_argument("--k", default="2,4")
    p.add_argument("--temperature", default="1.0,0.7")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    pair = load_pair(args.target, args.drafter, args.draft, "cpu", None)
    tok = pair.target.tokenizer
    prompts = [encode_prompt(tok, it.prompt) for it in read_prompts(args.prompts, args.limit)]
    results = []
    for temperature in (float(t) for t in args.temperature.split(",")):
        for k in (int(x) for x in args.k.split(",")):
            steps: list[dict] = []
            verify.ROW_RULES["token"] = recorded(steps)
            for seed, ids in enumerate(prompts):
                config = GenerationConfig(max_new_tokens=args.max_new_tokens, num_draft_tokens=k, seed=seed,
                                          sampling=SamplingConfig(temperature), tree="off")  # block judges chains
                for _ in decode(pair.target.model, tok, [ids], config, pair.drafter, text=False):
                    pass
            verify.ROW_RULES["token"] = verify.rejection_accept_rows
            # every drafted block counts, also those the length limit or a confidence gate cut short of k
            row = {"drafter": args.drafter, "draft": pair.draft_name, "temperature": temperature, "k": k,
                   "prompts": len(prompts), "full_blocks": sum(s["k"] == k for s in steps) / max(len(steps), 1),
                   **summary(steps)}
            print(json.dumps(row), flush=True)
            results.append(row)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
