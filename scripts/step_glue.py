"""What a speculative step does on the host outside the passes CUDA graphs replace, measured on the CPU: the bundled
pair under `--graphs on` (the static runner, uncaptured), with the one-read path forced on as under a captured target
(engine.loop.ONE_READ = "always") and the head's greedy trees grown on the device (DEVICE_TREES = "always"). Per
step: wall milliseconds outside the captured regions (the target's and a draft LM's passes, engine.static.Storage.run;
the head's passes, greedy chains and trees: HeadStorage.run and .chain, eagle3_device_tree.grow), and the aten calls
there (views and no-op conversions left out), by the specdemo function that made them. On a GPU each such call is an
eager kernel launch or a host-side op between replays, the time the GPU may sit idle.

    python scripts/step_glue.py --drafter model --k 2          # the trained head; --drafter ar: autoregressive
    python scripts/step_glue.py --drafter ngram --k 4 --rounds 5
    python scripts/step_glue.py --drafter model --draft smollm2-135m --k 2   # a draft LM (here the target itself)
    python scripts/step_glue.py --drafter model --k 3 --tree 8    # the head's greedy trees, grown on the device

Prints JSON. Time it with nothing else running; only figures from one sitting compare.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from specdemo.config import GenerationConfig, Runtime  # noqa: E402
from specdemo.drafters import eagle3_device_tree  # noqa: E402
from specdemo.engine import decode, encode_prompt, loop  # noqa: E402
from specdemo.measure.compare import load_pair  # noqa: E402
from specdemo.measure.glue import Calls, Outside  # noqa: E402

PROMPT = "Write a short story about a robot who learns to paint."


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="model", help="a registered drafter, or ar")
    ap.add_argument("--draft", default=None, help="the drafter's draft (a draft LM's id), else its default")
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tree", default="off", help="--tree's setting: off (chains), auto or a node budget; the head's "
                    "greedy trees grow on the device, as where its runner captures")
    args = ap.parse_args()
    torch.set_num_threads(2)
    loop.ONE_READ = "always"
    eagle3_device_tree.DEVICE_TREES = "always"
    pair = load_pair("smollm2-135m", "ngram" if args.drafter == "ar" else args.drafter, args.draft, device="cpu",
                     runtime=Runtime(graphs="on"))
    model, tokenizer = pair.target.model, pair.target.tokenizer
    drafter = None if args.drafter == "ar" else pair.drafter
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, num_draft_tokens=args.k, tree=args.tree)
    ids = encode_prompt(tokenizer, PROMPT)
    outside = Outside()
    with outside.watching():
        list(decode(model, tokenizer, [ids], config, drafter))  # first-use costs stay out
        host = []
        for _ in range(args.rounds):
            outside.seconds = 0.0
            start = time.perf_counter()
            steps = len(list(decode(model, tokenizer, [ids], config, drafter)))
            host.append((time.perf_counter() - start - outside.seconds) / steps)
        calls = Calls(outside)
        with torch.inference_mode(), calls:
            steps = len(list(decode(model, tokenizer, [ids], config, drafter)))
    print(json.dumps({"drafter": args.drafter, "draft": args.draft, "k": args.k, "tree": args.tree, "steps": steps,
                      "host_ms_outside_graphs_per_step": round(1e3 * statistics.median(host), 3),
                      "rounds_ms": [round(1e3 * h, 3) for h in host],
                      "aten_calls_outside_graphs_per_step": round(sum(calls.ops.values()) / steps, 1),
                      "by_function": {w: round(n / steps, 2) for w, n in calls.where.most_common(12)},
                      "by_op": {o: round(n / steps, 2) for o, n in calls.ops.most_common(12)}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
