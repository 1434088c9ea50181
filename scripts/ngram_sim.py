"""Replay prompt-lookup drafters against cached greedy outputs, with a measured verify-cost table.

Under greedy decoding the committed tokens are the target's own, so a drafter's acceptance can be replayed exactly
without the model; time is modelled as sum over verify passes of cost(width) (cost(1) = one AR step).
This is a development tool for specdemo.drafters.NgramDrafter, not part of the package.

    python scripts/ngram_sim.py --outputs bench_out/greedy128.json [--costs bench_out/costs.json] [--k 4]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdemo.config import GenerationConfig, SamplingConfig  # noqa: E402
from specdemo.drafters import Drafter, DraftRequest, NgramDrafter, Proposal, Verdict, cut_at_eos  # noqa: E402


class HFPromptLookup(Drafter):
    """transformers' PromptLookupCandidateGenerator: n-gram sizes 2..1, the earliest match, up to k tokens."""

    def __init__(self, max_ngram: int = 2):
        self.max_ngram = max_ngram

    def begin(self, prompt_ids, target_hidden=None):
        pass

    def propose(self, request: DraftRequest) -> Proposal:
        ids = request.ids
        n_ids = len(ids)
        for n in range(min(self.max_ngram, n_ids - 1), 0, -1):
            tail = ids[-n:]
            for start in range(0, n_ids - n + 1):
                if ids[start:start + n] == tail:
                    follow = ids[start + n:min(start + n + request.k, n_ids)]
                    if follow:
                        for i, t in enumerate(follow):
                            if t in request.eos_token_ids:
                                follow = follow[:i]
                                break
                        if follow:
                            return Proposal(follow)
                        break  # transformers stops at the first match with a non-empty slice
        return Proposal([])


class LongestMatch(NgramDrafter):
    """Candidate policy: the longest earlier match of the suffix (up to max_ngram, latest on ties unless told), and
    at most caps[L] tokens for a match of length L (k once L >= len(caps)); propose nothing when caps[L] == 0."""

    def __init__(self, max_ngram: int = 8, caps: tuple[int, ...] = (), latest: bool = True):
        super().__init__(max_ngram=max_ngram, latest=latest)
        self.caps = caps

    def propose(self, request: DraftRequest) -> Proposal:
        length, end = self.match(request.ids)
        if length == 0:
            return Proposal([])
        cap = self.caps[length] if length < len(self.caps) else request.k
        return Proposal(cut_at_eos(request.ids[end + 1 : end + 1 + min(cap, request.k)], request.eos_token_ids))


def generate_outputs(path: Path, prompts: str | None, max_new_tokens: int, limit: int | None) -> dict:
    """Greedy autoregressive outputs of the bundled target for each prompt (cached in `path`)."""
    from specdemo.compare import load_pair
    from specdemo.engine import autoregressive, encode_prompt, generated_ids, eos_ids
    from specdemo.prompts import DEFAULT_PROMPTS, read_prompts

    pair = load_pair("smollm2-135m", "ngram")
    model, tok = pair.target.model, pair.target.tokenizer
    config = GenerationConfig(max_new_tokens=max_new_tokens)
    out = json.loads(path.read_text()) if path.exists() else {"eos": sorted(eos_ids(model, tok)), "items": []}
    done = {it["id"] for it in out["items"]}
    path.parent.mkdir(parents=True, exist_ok=True)
    for it in read_prompts(prompts or DEFAULT_PROMPTS, limit):
        if it.id in done:
            continue
        ids = encode_prompt(tok, it.prompt)
        gen = generated_ids(list(autoregressive(model, tok, ids, config)))
        out["items"].append({"id": it.id, "category": it.category, "prompt_ids": ids, "out_ids": gen})
        path.write_text(json.dumps(out))  # after each prompt, so an interrupted run resumes
        print(it.id, len(gen), file=sys.stderr)
    return out


def replay(drafter: Drafter, prompt_ids: list[int], out_ids: list[int], k: int, eos: frozenset[int],
           cost: dict[int, float]) -> dict:
    """Mirror engine.speculative's loop on a known greedy output; returns steps, drafted, accepted, cost units."""
    drafter.begin(prompt_ids)
    n = len(out_ids)
    g = 1  # the prefill pass committed out_ids[0]
    time = 1.0 + 0.0  # the prefill is the same in both decoders; count it as one step
    steps = drafted = accepted = 0
    while g < n:
        ids = prompt_ids + out_ids[:g]
        k_step = min(k, n - g - 1)
        prop = drafter.propose(DraftRequest(ids, k_step, SamplingConfig(), None, eos)).tokens[:k_step] if k_step else []
        a = 0
        while a < len(prop) and g + a < n and prop[a] == out_ids[g + a]:
            a += 1
        commit = min(a + 1, n - g)
        steps += 1
        drafted += len(prop)
        accepted += a
        time += cost.get(len(prop) + 1, 1.0 + 0.1 * len(prop))
        drafter.update(Verdict(a, prompt_ids + out_ids[:g + commit]))
        g += commit
    return {"steps": steps, "drafted": drafted, "accepted": accepted, "time": time, "ar_time": float(n)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--outputs", default="bench_out/greedy128.json")
    ap.add_argument("--prompts", default=None)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--costs", default=None, help="JSON {width: cost} (a (w)-token pass over a 1-token pass)")
    ap.add_argument("--k", default="2,3,4,6,8")
    ap.add_argument("--generate", action="store_true", help="generate (or resume) the cached outputs first")
    args = ap.parse_args()
    path = Path(args.outputs)
    data = generate_outputs(path, args.prompts, args.max_new_tokens, args.limit) if args.generate else \
        json.loads(path.read_text())
    # default: the brief's timings (1 token 50 ms, 4 tokens 75 ms, 8 tokens 90 ms), interpolated
    cost = {1: 1.0, 2: 1.17, 3: 1.33, 4: 1.5, 5: 1.58, 6: 1.65, 7: 1.72, 8: 1.8, 9: 1.85}
    if args.costs:
        cost = {int(w): v for w, v in json.loads(Path(args.costs).read_text()).items()}
    eos = frozenset(data["eos"])
    drafters = {"hf_pld": HFPromptLookup, "ours": NgramDrafter,
                "0,2,k": lambda: LongestMatch(8, (0, 0, 2)),
                "1,2,k": lambda: LongestMatch(8, (0, 1, 2)),
                "E 0,2,k": lambda: LongestMatch(8, (0, 0, 2), latest=False),
                "E 1,2,k": lambda: LongestMatch(8, (0, 1, 2), latest=False),
                "E 0,1,k": lambda: LongestMatch(8, (0, 0, 1), latest=False),
                "E 0,2,3,k": lambda: LongestMatch(8, (0, 0, 2, 3), latest=False),
                "E16 0,2,k": lambda: LongestMatch(16, (0, 0, 2), latest=False),
                "E4 0,2,k": lambda: LongestMatch(4, (0, 0, 2), latest=False),
                }
    for k in [int(x) for x in args.k.split(",")]:
        for name, make in drafters.items():
            tot = defaultdict(lambda: defaultdict(float))
            for it in data["items"]:
                r = replay(make(), it["prompt_ids"], it["out_ids"], k, eos, cost)
                for key in ("all", it["category"]):
                    for f, v in r.items():
                        tot[key][f] += v
            cells = "  ".join(f"{c}:{v['ar_time'] / v['time']:.3f}" for c, v in tot.items())
            a = tot["all"]
            print(f"k={k} {name:8s} acc {a['accepted'] / max(a['drafted'], 1):.2f} "
                  f"tok/pass {(a['ar_time'] - 1) / a['steps']:.2f}  {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
