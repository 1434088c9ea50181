"""The offload regime in one run (docs/devices.md): the bundled target fully in memory, then with part of it
forced to disk by accelerate's device map; for each, the cost of a forward pass of 1, 2, 4, 8 new tokens, the AR speed,
and the speculative speedup at several k for prompt lookup and the trained draft. Prints a table, writes JSON.

    python scripts/offload_regime.py --limit 2 --max-new-tokens 32 --ks 1,2,4 --out out/offload
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdemo.config import (
    BUNDLED_ID,
    GenerationConfig,
    placement_from,
    runtime_from_env,
)
from specdemo.engine import encode_prompt
from specdemo.engine.timing import forward_seconds
from specdemo.measure.compare import Pair, make_drafter, warmup
from specdemo.measure.tune_k import run_ar, run_sd
from specdemo.models.loading import load_model
from specdemo.prompts import DEFAULT_PROMPTS, read_prompts

WIDTHS = (1, 2, 4, 8)


def regime(name: str, loaded, prompts: list[list[int]], ks: list[int], config: GenerationConfig) -> dict:
    """Pass costs, then per prompt AR once and SD per drafter and k; totals over the prompts."""
    passes = forward_seconds(loaded.model, prompts[:1], WIDTHS, repeats=2)
    drafters = {kind: make_drafter(loaded, kind, None)[0] for kind in ("ngram", "model")}
    for kind, drafter in drafters.items():  # untimed: every code path once
        warmup(Pair(loaded, drafter, kind, None), prompts[:1], replace(config, num_draft_tokens=max(ks)))
    ar_s, ar_tokens, sd = 0.0, 0, {}
    for ids in prompts:
        ar = run_ar(Pair(loaded, drafters["ngram"], "ngram", None), ids, config)
        ar_s, ar_tokens = ar_s + ar.wall_seconds, ar_tokens + ar.tokens
        for kind, drafter in drafters.items():
            for k in ks:
                run = run_sd(Pair(loaded, drafter, kind, None), ids, replace(config, num_draft_tokens=k))
                row = sd.setdefault(f"{kind} k={k}", {"seconds": 0.0, "tokens": 0, "passes": 0, "identical": 0})
                row["seconds"] += run.wall_seconds
                row["tokens"] += run.tokens
                row["passes"] += run.stats.steps + 1  # the verify passes and the prefill
                row["identical"] += run.ids == ar.ids
    for row in sd.values():
        row["speedup"] = ar_s / row["seconds"]
        row["mean_accepted"] = row["tokens"] / row["passes"]
    return {"regime": name, "placement": loaded.where(), "pass_seconds": passes,
            "pass_cost": {w: s / passes[1] for w, s in passes.items()},
            "ar_tokens_per_s": ar_tokens / ar_s, "ar_seconds": ar_s, "sd": sd}


def table(results: list[dict], num_prompts: int) -> str:
    lines = ["| regime | pass 1 / 2 / 4 / 8 tokens (s) | 8-token / 1-token | AR tok/s | " + " | ".join(
        results[0]["sd"]) + " |", "|" + "---|" * (4 + len(results[0]["sd"]))]
    for r in results:
        p = r["pass_seconds"]
        cells = [f"{v['speedup']:.2f}× ({v['mean_accepted']:.2f}/pass, {v['identical']}/{num_prompts})"
                 for v in r["sd"].values()]
        lines.append(f"| {r['regime']} | {' / '.join(f'{p[w]:.3f}' for w in WIDTHS)} | {r['pass_cost'][8]:.2f} | "
                     f"{r['ar_tokens_per_s']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    p.add_argument("--limit", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--ks", default="1,2,4")
    p.add_argument("--max-memory", default="cpu=150MiB",
                   help="the offloaded regime's limits: cpu=150MiB puts most layers on disk; on a GPU, "
                        "0=80MiB,cpu=8GiB keeps the embeddings and head on it and streams the layers from CPU memory")
    p.add_argument("--device", default="cpu", help="the in-memory regime's device (cpu, cuda)")
    p.add_argument("--out", default="out/offload")
    args = p.parse_args()
    runtime = runtime_from_env(os.environ)
    ks = [int(k) for k in args.ks.split(",")]
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    started, load = time.time(), os.getloadavg()[0]
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for name, placement in (("in memory", None), ("offloaded", placement_from("auto", args.max_memory, folder))):
            loaded = load_model(BUNDLED_ID, device=args.device, runtime=runtime,
                                **({"placement": placement} if placement else {}))
            items = read_prompts(args.prompts, args.limit)
            prompts = [encode_prompt(loaded.tokenizer, it.prompt) for it in items]
            results.append(regime(name, loaded, prompts, ks, config))
    report = {"max_memory": args.max_memory, "prompts": args.prompts, "limit": args.limit,
              "max_new_tokens": args.max_new_tokens, "ks": ks, "load_average": [load, os.getloadavg()[0]],
              "wall_seconds": time.time() - started, "results": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "offload.json").write_text(json.dumps(report, indent=1) + "\n")
    text = table(results, args.limit)
    (out / "offload.md").write_text(text + "\n")
    print(text)
    print(f"load average {load:.1f} at start, {os.getloadavg()[0]:.1f} at end; {time.time() - started:.0f} s; "
          f"wrote {out / 'offload.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
