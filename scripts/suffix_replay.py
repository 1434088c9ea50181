"""Replay the target's greedy answers through model-free drafters: exact tokens per pass, and a speedup predicted
from measured pass costs, for many drafter settings in seconds instead of one bench run each.

Greedy speculative decoding commits exactly the target's greedy tokens, so a deterministic drafter's every step can be
replayed from the answer alone: propose from the committed ids, keep the longest prefix that matches the answer, and
commit one more token. The drafters are the real classes driven through their interface (begin, propose, update), and
the suffix cache is carried across the prompts in order, as the bench carries it. The predicted speedup is

    (answer tokens x cost of a 1-token pass) / sum over steps of the cost of a (drafted + 1)-token pass,

with pass costs from timing.verify_costs_for on this machine (draft logic and verify bookkeeping are left out: they
are under 1 % of a step for these drafters). The bench then times the chosen settings once.

    python scripts/suffix_replay.py --prompts specdemo/data/prompts/repetitive.jsonl --out /tmp/replay.json

With --trees 8,16 it replays suffix decoding's draft trees of those budgets and --tree auto's too, with and without
the cost-aware cut (the accepted path: the longest that follows the answer), and the ceiling of any suffix tree
(`suffix oracle`). The oracle's passes are costed as if its tree were a chain of the accepted length.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdemo.config import AUTO_TREE_NODES, GenerationConfig, SamplingConfig, SuffixConfig  # noqa: E402
from specdemo.drafters import NgramDrafter  # noqa: E402
from specdemo.drafters.base import DraftRequest, Proposal, Verdict  # noqa: E402
from specdemo.drafters.suffix import SuffixCache, SuffixDrafter, SuffixTree  # noqa: E402
from specdemo.engine import autoregressive, encode_prompt, eos_ids, generated_ids  # noqa: E402
from specdemo.engine.timing import StepCosts, verify_costs_for  # noqa: E402
from specdemo.engine.tree import TokenTree  # noqa: E402
from specdemo.models.loading import load_model  # noqa: E402


def answers(loaded, prompts: list[str], max_new_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, the target's greedy answer ids) per prompt, as the bench encodes them (chat template)."""
    config = GenerationConfig(max_new_tokens=max_new_tokens)
    out = []
    for prompt in prompts:
        ids = encode_prompt(loaded.tokenizer, prompt, True)
        out.append((ids, generated_ids(list(autoregressive(loaded.model, loaded.tokenizer, ids, config)))))
    return out


def replay(drafter, pairs, k: int, eos: frozenset[int], nodes: int = 0,
           costs: dict[int, float] | None = None) -> list[list[tuple[int, int]]]:
    """Per prompt, each step's (drafted, accepted); with `nodes`, the drafter may propose trees of that many nodes,
    and the accepted path is the longest one that follows the answer (greedy tree verification); with `costs` ({n:
    an (n+1)-token pass over a 1-token one}) they are cut as --tree auto cuts them, their branches weighed by what
    branches gave (StepCosts.extra_scale, as the engine keeps it)."""
    sampling, scale = SamplingConfig(), StepCosts(costs or {})
    steps_all = []
    for prompt, answer in pairs:
        drafter.begin([prompt])
        ids, pos, steps = list(prompt), 0, []
        while pos < len(answer):
            left = len(answer) - pos
            want = min(k, left - 1)  # the engine never drafts past the length
            request = DraftRequest([ids], [want], sampling, [None], eos, [nodes] if nodes else (), costs,
                                   scale.extra_scale())
            draft = drafter.propose(request)[0] if want > 0 else Proposal([])
            tree = TokenTree(draft.tokens, draft.parents or range(-1, len(draft.tokens) - 1))
            path, node = [], -1
            while len(path) < left - 1:
                node = next((c for c in tree.children(node) if tree.tokens[c] == answer[pos + len(path)]), None)
                if node is None:
                    break
                path.append(node)
            if draft.parents is not None and draft.values is not None:
                scale.add_extras(*tree.off_chain(draft.values, path))
            steps.append((len(tree), len(path)))
            ids += answer[pos:pos + len(path) + 1]
            pos += len(path) + 1
            drafter.update([Verdict(len(path), list(ids), path=None if draft.parents is None else path)])
        steps_all.append(steps)
    return steps_all


def oracle(pairs, k: int, config: SuffixConfig) -> list[list[tuple[int, int]]]:
    """The ceiling of any suffix tree draft: each step accepts the longest continuation of the answer (up to k) that
    either tree (the request's, the earlier answers') holds after some match of the context's suffix; drafted is
    reported as that length."""
    earlier, steps_all = SuffixTree(config.max_tree_depth), []
    for n, (prompt, answer) in enumerate(pairs):
        own = SuffixTree(config.max_tree_depth)
        own.extend(0, prompt)
        ids, pos, steps = list(prompt), 0, []
        while pos < len(answer):
            best = 0
            for tree in (own, earlier):
                for _, node, _ in tree.matches(ids, k, config):
                    length = 0
                    while length < min(k, len(answer) - pos - 1) and node.children and \
                            answer[pos + length] in node.children:
                        node = node.children[answer[pos + length]]
                        length += 1
                    best = max(best, length)
            steps.append((best, best))
            own.extend(0, answer[pos:pos + best + 1])
            ids += answer[pos:pos + best + 1]
            pos += best + 1
        earlier.extend(n, answer)
        steps_all.append(steps)
    return steps_all


def predict(steps_all, costs: dict[int, float]) -> dict:
    """Tokens per pass and the speedup the pass costs predict (costs[w]: a w-token pass over a 1-token pass)."""
    widest = max(costs)
    tokens = [sum(a + 1 for _, a in st) for st in steps_all]
    cost = [sum(costs[min(d + 1, widest)] for d, _ in st) for st in steps_all]
    steps = [s for st in steps_all for s in st]
    drafted, accepted = sum(d for d, _ in steps), sum(a for _, a in steps)
    return {"tokens_per_pass": sum(tokens) / len(steps), "predicted_speedup": sum(tokens) / sum(cost),
            "passes": len(steps), "drafted": drafted, "accepted": accepted,
            "acceptance": accepted / drafted if drafted else 0.0,
            "per_prompt_speedup": [round(t / c, 3) for t, c in zip(tokens, cost)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default="specdemo/data/prompts/repetitive.jsonl")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k-max", type=int, default=32, help="widest pass to time and the largest k to replay")
    ap.add_argument("--trees", default="", help="node budgets of draft trees to replay too (e.g. 8,16), with the "
                    "ceiling any suffix tree could reach (oracle)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    loaded = load_model("smollm2-135m", device="cpu")
    prompts = [json.loads(line)["prompt"] for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    t0 = time.perf_counter()
    pairs = answers(loaded, prompts, args.max_new_tokens)
    print(f"answers: {sum(len(a) for _, a in pairs)} tokens in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    # one prompt at a time (B = 1, as the replay decodes), the mean over the first three
    timed = [verify_costs_for(loaded.model, [p], k_max=args.k_max) for p, _ in pairs[:3]]
    costs = {1: 1.0} | {k + 1: sum(t[k] for t in timed) / len(timed) for k in timed[0]}
    eos = frozenset(eos_ids(loaded.model, loaded.tokenizer))

    rows = []
    for k in (4, 8):
        rows.append({"drafter": "ngram", "k": k} | predict(replay(NgramDrafter(), pairs, k, eos), costs))
    for k, factor, prob in itertools.product((8, 16, 32), (1.0, 2.0, 4.0), (0.0, 0.05, 0.1, 0.2, 0.3)):
        if k > args.k_max:
            continue
        config = SuffixConfig(max_spec_factor=factor, min_token_prob=prob)
        cache = SuffixCache(config.max_tree_depth, config.max_cached_requests)
        rows.append({"drafter": "suffix", "k": k, "max_spec_factor": factor, "min_token_prob": prob}
                    | predict(replay(SuffixDrafter(cache, config), pairs, k, eos), costs))
    ratios = {n: costs[n + 1] for n in range(1, args.k_max + 1)}  # {drafted: pass cost}, as the drafters take them
    for k in (8, 16) if args.trees else ():
        for aware, nodes in itertools.product((False, True), (0, "auto", *map(int, args.trees.split(",")))):
            cache = SuffixCache(SuffixConfig.max_tree_depth, SuffixConfig.max_cached_requests)
            drafter = SuffixDrafter(cache, pass_costs=ratios, cost_aware=aware)
            auto = nodes == "auto"  # as engine.loop.tree_plan sizes it: up to AUTO_TREE_NODES, cut by the costs
            steps = replay(drafter, pairs, k, eos, min(AUTO_TREE_NODES, args.k_max) if auto else nodes,
                           ratios if auto else None)
            rows.append({"drafter": "suffix", "k": k, "cost_aware": aware, "tree": nodes or "off"}
                        | predict(steps, costs))
        rows.append({"drafter": "suffix oracle", "k": k} | predict(oracle(pairs, k, SuffixConfig()), costs))
    for row in rows:
        print({key: (round(v, 3) if isinstance(v, float) else v) for key, v in row.items()
               if key != "per_prompt_speedup"})
    if args.out:
        Path(args.out).write_text(json.dumps({"pass_costs": costs, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
