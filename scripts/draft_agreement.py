"""Teacher-forced agreement of a trained draft with the target on evaluation prompts, by category.

The target writes its greedy answer to each prompt; the draft head then reads the target's true features along that
answer, exactly as `distill` evaluates its held-out split, and the table gives top-1 agreement at draft steps
1..depth and the chain rate. At step 1 this is the acceptance rate a k = 1 benchmark measures, without timing, so it
separates "the draft generalises poorly to these prompts" from "the engine feeds the draft wrongly", and shows how
many of the target's tokens lie outside the draft's vocabulary subset. A development tool, not part of the package.

    python scripts/draft_agreement.py --draft assets/smollm2-135m-draft
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdemo import distill  # noqa: E402
from specdemo.compare import load_pair  # noqa: E402
from specdemo.config import GenerationConfig  # noqa: E402
from specdemo.engine import autoregressive, encode_prompt  # noqa: E402
from specdemo.prompts import DEFAULT_PROMPTS, read_prompts  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draft", default=None, help="trained draft folder (default: the shipped one)")
    p.add_argument("--prompts", default=DEFAULT_PROMPTS)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args(argv)
    pair = load_pair("smollm2-135m", "model", args.draft)
    head, tok = pair.drafter.head, pair.target.tokenizer
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    samples, cats = [], []
    for item in read_prompts(args.prompts, args.limit):
        ids = encode_prompt(tok, item.prompt)
        answer = [t for e in autoregressive(pair.target.model, tok, ids, config) if e.kind == "ar" for t in e.tokens]
        samples.append({"ids": ids + answer, "prompt_len": len(ids)})
        cats.append(item.category)
    with tempfile.TemporaryDirectory() as work:
        data = distill.build_features(pair.target.model, samples, Path(work), batch_size=1, layers=head.c.fuse_layers)
    ev = types.SimpleNamespace(depth=args.depth, batch_size=1, max_len=1 << 16, skip=0)
    sub_index = distill.subset_index(head)
    print(f"| prompts | n | top-1 agreement, steps 1..{args.depth} | chain rate | est. tokens per pass at k = {args.depth} "
          "| target tokens inside the subset |")
    print("|---|---|---|---|---|---|")
    for name in ["all"] + sorted(set(cats)):
        idx = [i for i, c in enumerate(cats) if name in ("all", c)]
        m = distill.evaluate(head, samples, data, idx, ev, sub_index, pair.target.device)
        labels = torch.cat([data["top1"][i][samples[i]["prompt_len"] - 1 : -1].long() for i in idx])
        inside = float((sub_index[labels] >= 0).float().mean())
        print(f"| {name} | {len(idx)} | {' / '.join(f'{a:.3f}' for a in m['top1_step'])} | "
              f"{' / '.join(f'{c:.3f}' for c in m['chain'])} | {m['est_mean_accepted']:.2f} | {inside:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
