"""AR tokens/s of the one engine against the single-sequence oracle it replaced, in one process, interleaved per
prompt (order alternating), with a timer around every target forward: tells the forward's time from the loop's.

Needs a checkout of 7838c1b (the last commit that has both): git worktree add ../wt-oracle 7838c1b, then

    python bench/one-engine/ar_forward_timer.py ../wt-oracle 6 2     # that tree, prompts, rounds
"""

import statistics
import sys
import time

sys.path.insert(0, sys.argv[1])

import torch  # noqa: E402

from specdemo.config import GenerationConfig  # noqa: E402
from specdemo.engine import autoregressive as new_ar  # noqa: E402
from specdemo.engine import encode_prompt  # noqa: E402
from specdemo.loading import load_model  # noqa: E402
from specdemo.oracle.engine import autoregressive as old_ar  # noqa: E402
from specdemo.prompts import DEFAULT_PROMPTS, read_prompts  # noqa: E402


def main(n_prompts: int, rounds: int) -> None:
    torch.set_num_threads(2)
    loaded = load_model("smollm2-135m", device="cpu")
    model, tok = loaded.model, loaded.tokenizer
    forwards: list[float] = []
    forward = model.forward

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = forward(*args, **kwargs)
        forwards.append(time.perf_counter() - start)
        return out

    model.forward = timed
    sides = {"new": new_ar, "old": old_ar}
    prompts = [encode_prompt(tok, p.prompt) for p in read_prompts(DEFAULT_PROMPTS, n_prompts)]
    for decode in sides.values():  # warm-up
        list(decode(model, tok, prompts[0], GenerationConfig(max_new_tokens=16)))
    tokens, seconds, steps = {s: 0 for s in sides}, {s: 0.0 for s in sides}, {s: [] for s in sides}
    in_forward = {s: 0.0 for s in sides}
    for r in range(rounds):
        for i, ids in enumerate(prompts):
            for side in ("new", "old") if (i + r) % 2 == 0 else ("old", "new"):
                forwards.clear()
                events = list(sides[side](model, tok, ids, GenerationConfig(max_new_tokens=128)))
                tokens[side] += events[-1].num_generated
                seconds[side] += events[-1].elapsed
                in_forward[side] += sum(forwards)
                steps[side] += forwards[1:]  # the prefill left out of the medians
    for side in sides:
        n, fw = tokens[side], steps[side]
        outside = (seconds[side] - in_forward[side]) / n
        print(f"{side}: {n / seconds[side]:.2f} tok/s, forward median {statistics.median(fw) * 1e3:.2f} ms "
              f"(p10 {sorted(fw)[len(fw) // 10] * 1e3:.2f}, p90 {sorted(fw)[9 * len(fw) // 10] * 1e3:.2f}), "
              f"outside the forward about {outside * 1e3:.3f} ms per step")
    print(f"new/old tok/s: {(tokens['new'] / seconds['new']) / (tokens['old'] / seconds['old']):.4f}")


if __name__ == "__main__":
    with torch.inference_mode():
        main(int(sys.argv[2]), int(sys.argv[3]))
