"""Teacher-forced agreement of a trained draft with the target on evaluation prompts, by category.

The target writes its greedy answer to each prompt; the draft head then reads the target's true features along that
answer, exactly as `distill` evaluates its held-out split, and the table gives top-1 agreement at draft steps
1..depth and the chain rate. At step 1 this is the acceptance rate a k = 1 benchmark measures, without timing, so it
separates "the draft generalises poorly to these prompts" from "the engine feeds the draft wrongly", and shows how
many of the target's tokens lie outside the draft's vocabulary subset. A development tool, not part of the package.

    python scripts/draft_agreement.py --draft assets/smollm2-135m-draft
    python scripts/draft_agreement.py --draft out/draft-a out/draft-b --depth 1   # one table each, one set of answers
    python scripts/draft_agreement.py --draft out/draft-a out/draft-b --held-out out/draft/cache  # distill's split

A target token outside the draft's subset counts as a miss (distill.evaluate), so step 1 matches a timed k = 1 run.
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
from specdemo.eagle import load_trained_draft  # noqa: E402
from specdemo.engine import autoregressive, encode_prompt  # noqa: E402
from specdemo.prompts import DEFAULT_PROMPTS, read_prompts  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draft", nargs="*", default=[None], help="trained draft folders (default: the shipped one)")
    p.add_argument("--prompts", default=DEFAULT_PROMPTS)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--held-out", default=None,
                   help="a distill cache folder: evaluate on its held-out split as distill does, not on prompts")
    args = p.parse_args(argv)
    if args.held_out:
        return held_out(args.draft, Path(args.held_out), args.depth)
    pair = load_pair("smollm2-135m", "model", args.draft[0])
    samples, cats = target_answers(pair, args.prompts, args.limit, args.max_new_tokens)
    for folder, head in heads(pair, args.draft):
        if len(args.draft) > 1:
            print(f"\n`{folder}`\n")
        table(head, samples, cats, answer_features(pair, samples, head), args.depth, pair.target.device)
    return 0


def target_answers(pair, prompts: str, limit: int | None, max_new_tokens: int) -> tuple[list[dict], list[str]]:
    """The target's greedy answer to each prompt as a distill sample ({ids, prompt_len}), and each prompt's category."""
    tok = pair.target.tokenizer
    config = GenerationConfig(max_new_tokens=max_new_tokens)
    samples, cats = [], []
    for item in read_prompts(prompts, limit):
        ids = encode_prompt(tok, item.prompt)
        answer = [t for e in autoregressive(pair.target.model, tok, ids, config) if e.kind == "ar" for t in e.tokens]
        samples.append({"ids": ids + answer, "prompt_len": len(ids)})
        cats.append(item.category)
    return samples, cats


def answer_features(pair, samples: list[dict], head) -> dict:
    """distill.build_features for these samples and the layers the head reads, recorded afresh (nothing cached)."""
    with tempfile.TemporaryDirectory() as work:
        return distill.build_features(pair.target.model, samples, Path(work), batch_size=1, layers=head.c.fuse_layers)


def heads(pair, drafts: list[str | None]):
    """(folder, head) for each draft: the first is the one load_pair loaded, the others are bound to the same target."""
    for i, folder in enumerate(drafts):
        yield folder, (pair.drafter if i == 0 else load_trained_draft(folder, pair.target)).head


def slashed(xs: list[float]) -> str:
    return " / ".join(f"{x:.3f}" for x in xs)


def held_out(drafts: list[str | None], cache: Path, depth: int) -> int:
    """distill's held-out agreement for each draft, recomputed with the current evaluate() on the cached data and
    distill's own defaults (seed, max length, batch size, skipped common prefix)."""
    import random

    defaults = distill.parse_args(["--target", "-", "--out", "-"])
    samples = distill._jsonl_load(cache / "samples.jsonl")
    if not samples:
        raise SystemExit(f"no samples.jsonl in {cache}")
    held, _ = distill.split_held_out(samples, random.Random(defaults.seed))
    ev = types.SimpleNamespace(depth=depth, batch_size=defaults.batch_size, max_len=defaults.max_len,
                               skip=distill._common_prefix(samples))
    pair = load_pair("smollm2-135m", "model", drafts[0])
    data = distill.build_features(pair.target.model, samples, cache)  # the cached final states (sliced if fused)
    print(f"| draft | held-out top-1 agreement, steps 1..{depth} | chain rate |\n|---|---|---|")
    for folder, head in heads(pair, drafts):
        if head.c.fuse_layers:  # its wider features would be recorded again over the whole cache: not here
            print(f"| {folder} | (reads fused layers; not measured here) | |")
            continue
        m = distill.evaluate(head, samples, data, held, ev, distill.subset_index(head), pair.target.device)
        print(f"| {folder or 'shipped'} | {slashed(m['top1_step'])} | {slashed(m['chain'])} |")
    return 0


def table(head, samples, cats, data, depth, device) -> None:
    ev = types.SimpleNamespace(depth=depth, batch_size=1, max_len=1 << 16, skip=0)
    sub_index = distill.subset_index(head)
    print(f"| prompts | n | top-1 agreement, steps 1..{depth} | chain rate | est. tokens per pass at k = {depth} "
          "| target tokens inside the subset |")
    print("|---|---|---|---|---|---|")
    for name in ["all"] + sorted(set(cats)):
        idx = [i for i, c in enumerate(cats) if name in ("all", c)]
        m = distill.evaluate(head, samples, data, idx, ev, sub_index, device)
        labels = torch.cat([data["top1"][i][samples[i]["prompt_len"] - 1 : -1].long() for i in idx])
        inside = float((sub_index[labels] >= 0).float().mean())
        print(f"| {name} | {len(idx)} | {slashed(m['top1_step'])} | {slashed(m['chain'])} | "
              f"{m['est_mean_accepted']:.2f} | {inside:.3f} |")


if __name__ == "__main__":
    sys.exit(main())
