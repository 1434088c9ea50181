"""The race's first token and the graph runner's capture cost, as the app meets them: load the pair (capture happens
in the first run's warm-up), then time from the call to the first token of each panel, cold and warm.

    python scripts/race_first_token.py --device cuda [--graphs auto|on|off|compiled] [--drafter model] [--k 2]
        [--out FILE]

Prints (and writes) JSON: how the passes ran, capture seconds and graphs, and for each run the seconds to the first
AR and SD tokens, the speedup, and whether greedy outputs are identical.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdemo.cliargs import add_runtime_args, runtime_args  # noqa: E402
from specdemo.config import GenerationConfig  # noqa: E402
from specdemo.engine import encode_prompt, graphs  # noqa: E402
from specdemo.measure.compare import iter_compare, load_pair  # noqa: E402

PROMPT = "Write a short story about a robot who learns to paint."


def first_tokens(pair, ids: list[int], config: GenerationConfig) -> dict:
    """Seconds from the call to each panel's first token, and the run's result."""
    start, first = time.perf_counter(), {}
    for which, item in iter_compare(pair, ids, config):
        if which == "result":
            return {**{f"first_{k}_token_s": v for k, v in first.items()}, "speedup": item["speedup"],
                    "identical": item["identical"], "ar_tokens_per_s": item["ar"]["tokens_per_s"],
                    "sd_tokens_per_s": item["sd"]["tokens_per_s"]}
        first.setdefault(which, time.perf_counter() - start)
    return {}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    add_runtime_args(ap)  # --graphs, every mode config.GRAPH_MODES has
    ap.add_argument("--drafter", default="model")
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    runtime = runtime_args(args, os.environ)
    t0 = time.perf_counter()
    pair = load_pair("smollm2-135m", args.drafter, None, args.device, runtime=runtime)
    report = {"load_s": time.perf_counter() - t0, "device": args.device, "graphs": runtime.graphs}
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, num_draft_tokens=args.k)
    ids = encode_prompt(pair.target.tokenizer, PROMPT)
    report["cold"] = first_tokens(pair, ids, config)
    runner = graphs.runner_of(pair.target.model)
    report["capture_s"] = runner.capture_seconds if runner else 0.0
    report["graphs_captured"] = runner.graphs if runner else 0
    report["warm"] = first_tokens(pair, ids, config)
    report["runner"] = graphs.describe(pair.target.model)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
