"""Where a speculative step's time goes, chains against draft trees, for one drafter on the bundled target: per step
the draft's and the verification's milliseconds (the engine's own clocks) and, inside them, the head's and the
target's forward passes, with tokens per pass and wall milliseconds per new token. The settings take turns prompt by
prompt, so a slow spell of a shared machine falls on all of them.

    python scripts/tree_step_costs.py off:3 auto:3 8:3 6:3 --out bench/trees/step-costs     # about 3 minutes

Each setting is TREE:K (TREE as --tree: off, auto or a node budget). What it answers: whether a tree's extra tokens
per pass pay for its wider verify pass and its wider draft steps on this machine. Suffix decoding on its workload, one
round (a second would draft from the first round's answers, which its cache of earlier answers then holds):

    python scripts/tree_step_costs.py off:8 8:8 --drafter suffix --prompt-file \
        specdemo/data/prompts/repetitive.jsonl --prompts 15 --rounds 1                    # about a minute
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file from a clone

from specdemo.config import GenerationConfig  # noqa: E402
from specdemo.engine import decode, encode_prompt  # noqa: E402
from specdemo.engine.loop import auto_costs  # noqa: E402
from specdemo.engine.timing import ForwardTimer  # noqa: E402
from specdemo.measure.compare import load_pair, warmup  # noqa: E402
from specdemo.prompts import DEFAULT_PROMPTS, read_prompts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("settings", nargs="+", help="TREE:K, e.g. off:3 auto:3 8:3")
    ap.add_argument("--drafter", default="model")
    ap.add_argument("--prompts", type=int, default=8, help="the first N prompts of the prompt file")
    ap.add_argument("--prompt-file", default=str(DEFAULT_PROMPTS), help="a JSONL prompt set (default: the dev set)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="out/tree-step-costs")
    args = ap.parse_args()

    pair = load_pair("smollm2-135m", args.drafter, device="cpu")
    target, drafter = pair.target, pair.drafter
    prompts = [encode_prompt(target.tokenizer, p.prompt) for p in read_prompts(args.prompt_file, args.prompts)]
    settings = [(s.split(":")[0], int(s.split(":")[1])) for s in args.settings]
    configs = {s: GenerationConfig(max_new_tokens=args.max_new_tokens, num_draft_tokens=s[1], tree=s[0])
               for s in settings}
    for config in configs.values():
        warmup(pair, prompts[:1], config)
    head = [m for m in (getattr(getattr(drafter, "head", None), n, None) for n in ("midlayer", "lm_head")) if m]
    totals = {s: dict.fromkeys(("steps", "tokens", "draft_s", "verify_s", "target_s", "head_s", "wall_s"), 0.0)
              for s in settings}
    for _ in range(args.rounds):
        for ids in prompts:
            for s in settings:
                t_fwd = ForwardTimer([target.model.model, target.model.lm_head])
                h_fwd = ForwardTimer(head)
                t0, total = time.perf_counter(), totals[s]
                # what the drafter keeps across requests (suffix decoding's earlier answers) learns each prompt once,
                # from the last setting, as in the bench
                with drafter.paused() if s != settings[-1] else contextlib.nullcontext():
                    for e in decode(target.model, target.tokenizer, [ids], configs[s], drafter):
                        step = e.steps[0]
                        if e.kind == "spec":
                            total["steps"] += 1
                            total["tokens"] += len(step.tokens)
                            total["draft_s"] += e.draft_seconds
                            total["verify_s"] += e.verify_seconds
                        elif e.kind == "prefill":
                            t_fwd.seconds = 0.0  # the prompt's pass is no step's
                total["wall_s"] += time.perf_counter() - t0
                total["target_s"] += t_fwd.read()[0]
                total["head_s"] += h_fwd.read()[0]
                t_fwd.remove()
                h_fwd.remove()
    rows = []
    for (tree, k), t in totals.items():
        n = t["steps"]
        rows.append({"tree": tree, "k": k, "steps": int(n), "tokens_per_pass": t["tokens"] / n,
                     "draft_ms_per_step": 1000 * t["draft_s"] / n, "head_forward_ms_per_step": 1000 * t["head_s"] / n,
                     "verify_ms_per_step": 1000 * t["verify_s"] / n,
                     "target_forward_ms_per_step": 1000 * t["target_s"] / n,
                     "step_ms_per_token": 1000 * (t["draft_s"] + t["verify_s"]) / t["tokens"]})
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in rows[-1].items()}), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"what": __doc__.splitlines()[0], "drafter": args.drafter, "prompts": len(prompts),
              "prompt_file": args.prompt_file,
              "max_new_tokens": args.max_new_tokens, "rounds": args.rounds,
              "pass_costs_at_load": getattr(drafter, "pass_costs", None), "rows": rows,
              # what --tree auto sized trees by at the end: the load-time costs corrected by the steps it timed
              "auto_sized_by": {f"{t}:{k}": auto_costs(drafter, 1, c).costs() for (t, k), c in configs.items()
                                if t == "auto" and drafter.pass_costs},
              "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
