"""What the step inspector's recording costs the speculative decoder: ms per speculative step of the engine asked to
inspect (verify.inspect_verify: one topk and a logsumexp on the verify logits) against the same engine not asked,
interleaved runs on the bundled model; plus inspect_verify alone on verify-shaped logits.

    python scripts/inspect_overhead.py --out bench/inspect-overhead     # a few minutes on a CPU (docs/app.md)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file from a clone

from specdemo.config import GenerationConfig  # noqa: E402
from specdemo.engine import encode_prompt, speculative  # noqa: E402
from specdemo.engine.verify import inspect_verify  # noqa: E402
from specdemo.measure.compare import load_pair, warmup  # noqa: E402
from specdemo.prompts import DEFAULT_PROMPTS, read_prompts  # noqa: E402


def step_ms(pair, prompt_ids: list[int], config: GenerationConfig, inspect: bool) -> tuple[float, int]:
    """Mean ms of one speculative step (draft + verify, by the engine's own clock) and the number of steps."""
    t = pair.target
    spec = [e for e in speculative(t.model, t.tokenizer, pair.drafter, prompt_ids, config, inspect=inspect)
            if e.kind == "spec"]
    return 1000 * sum(e.draft_seconds + e.verify_seconds for e in spec) / len(spec), len(spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="model")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=6, help="the first N prompts of the in-repo prompt set")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="out/inspect-overhead")
    args = ap.parse_args()

    pair = load_pair("smollm2-135m", args.drafter, device="cpu")
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, num_draft_tokens=args.k)
    prompts = [encode_prompt(pair.target.tokenizer, p.prompt) for p in read_prompts(DEFAULT_PROMPTS, args.prompts)]
    warmup(pair, prompts[:1], config)
    real = inspect_verify
    ms: dict[str, list[float]] = {"with": [], "without": []}
    for _ in range(args.repeats):
        for ids in prompts:  # interleaved, so drift of a shared machine lands on both sides alike
            for side in ("with", "without"):
                ms[side].append(step_ms(pair, ids, config, side == "with")[0])

    vocab = pair.target.model.config.vocab_size
    logits, drafted = torch.randn(args.k + 1, vocab), torch.randint(vocab, (args.k,))
    for _ in range(20):
        real(logits, None, drafted)
    start, n = time.perf_counter(), 500
    for _ in range(n):
        real(logits, None, drafted)
    alone = 1000 * (time.perf_counter() - start) / n

    report = {"drafter": args.drafter, "k": args.k, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "repeats": args.repeats, "threads": torch.get_num_threads(),
              "ms_per_step_with": statistics.median(ms["with"]),
              "ms_per_step_without": statistics.median(ms["without"]),
              "inspect_verify_ms_alone": alone, "runs": ms}
    report["overhead_ratio"] = report["ms_per_step_with"] / report["ms_per_step_without"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
