"""The one engine against the engines it replaced, in one sitting: batch-1 tokens/s for AR and every drafter (new
engine vs the single-sequence oracle, interleaved per prompt, order alternating), and the batched throughput at
B = 1..16 (new tree vs an old checkout, each batch size measured in alternating subprocesses).

    python scripts/engine_paired.py single --limit 10 --max-new-tokens 128 --out bench/one-engine
    python scripts/engine_paired.py batch --old-tree ../wt-old --out bench/one-engine

Run on a quiet machine: both sides share it in turns, never at once.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _perturbed(model):
    import torch

    model = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.std() * 0.3)
    return model


def single(args) -> dict:
    """Per drafter: tokens and engine seconds summed over the prompts, new and old, interleaved."""
    sys.path.insert(0, str(ROOT))
    import torch

    from specdemo.compare import load_pair, make_drafter
    from specdemo.config import GenerationConfig
    from specdemo.drafters import ModelDrafter
    from specdemo.engine import autoregressive, encode_prompt, speculative
    from specdemo.oracle import engine as old_engine
    from specdemo.prompts import DEFAULT_PROMPTS, read_prompts
    from tests.test_one_engine import oracle_of

    torch.set_num_threads(os.cpu_count() or 2)
    pair = load_pair("", "ngram")
    target = pair.target
    head, _, _ = make_drafter(target, "model", None)
    hybrid, _, _ = make_drafter(target, "hybrid", None)
    lm = ModelDrafter(_perturbed(target.model))
    cases = {"ar": (None, 0), "ngram": (pair.drafter, 4), "eagle3": (head, 2), "hybrid": (hybrid, 8),
             "model-lm": (lm, 2)}
    prompts = [encode_prompt(target.tokenizer, p.prompt) for p in read_prompts(DEFAULT_PROMPTS, args.limit)]
    totals = {name: {"new": [0, 0.0], "old": [0, 0.0]} for name in cases}
    m, tok = target.model, target.tokenizer

    def run(side, drafter, ids, config):
        if drafter is None:
            gen = (autoregressive if side == "new" else old_engine.autoregressive)(m, tok, ids, config)
        elif side == "new":
            gen = speculative(m, tok, drafter, ids, config)
        else:
            gen = old_engine.speculative(m, tok, oracle_of(drafter), ids, config)
        events = list(gen)
        return events[-1].num_generated, events[-1].elapsed, [t for e in events for t in e.tokens]

    for name, (drafter, k) in cases.items():  # a warm-up run of each side
        config = GenerationConfig(max_new_tokens=8, num_draft_tokens=max(k, 1))
        for side in ("new", "old"):
            run(side, drafter, prompts[0], config)
    for i, ids in enumerate(prompts):
        for name, (drafter, k) in cases.items():
            config = GenerationConfig(max_new_tokens=args.max_new_tokens, num_draft_tokens=max(k, 1))
            order = ("new", "old") if i % 2 == 0 else ("old", "new")
            outs = {}
            for side in order:
                n, s, outs[side] = run(side, drafter, ids, config)
                totals[name][side][0] += n
                totals[name][side][1] += s
            assert outs["new"] == outs["old"], (name, i)
        print(f"prompt {i + 1}/{len(prompts)}", {n: round(v["new"][0] / v["new"][1] / (v["old"][0] / v["old"][1]), 3)
                                                   for n, v in totals.items()}, flush=True)
    return {name: {"new_tok_s": v["new"][0] / v["new"][1], "old_tok_s": v["old"][0] / v["old"][1],
                   "new_over_old": (v["new"][0] / v["new"][1]) / (v["old"][0] / v["old"][1]), "tokens": v["new"][0]}
            for name, v in totals.items()}


BATCH_CHILD = r"""
import json, sys, os, time, torch
torch.set_num_threads(os.cpu_count() or 2)
from specdemo.compare import load_pair
from specdemo.config import GenerationConfig
from specdemo.engine import encode_prompt
from specdemo.prompts import DEFAULT_PROMPTS, read_prompts
import time
b, k, limit, new_tokens = (int(x) for x in sys.argv[1:5])
pair = load_pair("", "ngram")
t = pair.target
prompts = [encode_prompt(t.tokenizer, p.prompt) for p in read_prompts(DEFAULT_PROMPTS, limit)]
config = GenerationConfig(max_new_tokens=new_tokens, num_draft_tokens=k)
try:
    from specdemo.engine import decode
    def run(rows, sd):
        return list(decode(t.model, t.tokenizer, rows, config, pair.drafter if sd else None, text=False))
except ImportError:
    from specdemo.batch import batch_autoregressive, batch_speculative
    from specdemo.batch_drafters import batch_drafter
    drafter = batch_drafter(pair.drafter)
    def run(rows, sd):
        if sd:
            return list(batch_speculative(t.model, t.tokenizer, drafter, rows, config))
        return list(batch_autoregressive(t.model, t.tokenizer, rows, config))
run(prompts[:b], True); run(prompts[:b], False)  # warm-up
out = {}
for sd in (False, True):
    tokens = seconds = 0
    for start in range(0, len(prompts) - b + 1, b):
        t0 = time.perf_counter()
        events = run(prompts[start:start + b], sd)
        s = time.perf_counter() - t0
        tokens += events[-1].num_generated
        seconds += s
    out["sd" if sd else "ar"] = tokens / seconds
print(json.dumps(out))
"""


def batch(args) -> dict:
    """Per batch size: AR and prompt-lookup tokens/s of each tree, the trees alternating."""
    out = {}
    for i, b in enumerate(args.batch_sizes):
        trees = [("new", ROOT), ("old", Path(args.old_tree).resolve())]
        if i % 2:
            trees.reverse()
        row = {}
        for side, tree in trees:
            env = {**os.environ, "PYTHONPATH": str(tree)}
            res = subprocess.run([sys.executable, "-c", BATCH_CHILD, str(b), str(args.k), str(args.limit),
                                  str(args.max_new_tokens)], env=env, cwd=tree, capture_output=True, text=True,
                                 check=True)
            row[side] = json.loads(res.stdout.strip().splitlines()[-1])
        row["sd_new_over_old"] = row["new"]["sd"] / row["old"]["sd"]
        row["ar_new_over_old"] = row["new"]["ar"] / row["old"]["ar"]
        print(b, row, flush=True)
        out[str(b)] = row
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["single", "batch"])
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--old-tree", default="../wt-old")
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--out", default="bench/one-engine")
    args = p.parse_args()
    t0 = time.time()
    result = single(args) if args.what == "single" else batch(args)
    meta = {"what": args.what, "limit": args.limit, "max_new_tokens": args.max_new_tokens,
            "sitting": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)), "seconds": round(time.time() - t0),
            "cpus": os.cpu_count()}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / f"paired-{args.what}.json"
    path.write_text(json.dumps({**meta, "result": result}, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
