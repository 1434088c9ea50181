"""A trained draft's teacher-forced agreement with its target, as markdown tables: on a prompt set, by category (the
target writes its greedy answers, the draft reads the target's true features along them, exactly as `evaluate`
scores distill's held-out split), or on a distill cache's own held-out split. No timing; loads no models itself.
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import torch

from ..config import GenerationConfig
from ..engine import autoregressive, encode_prompt, generated_ids
from ..prompts import PromptItem
from .config import Sample, TrainConfig
from .features import build_features
from .instructions import read_jsonl
from .training import common_prefix, evaluate, split_held_out, subset_index


def target_answers(target, tokenizer, items: list[PromptItem], max_new_tokens: int) -> list[Sample]:
    """The target's greedy answer to each prompt as a distill sample ({ids, prompt_len}), with its "category". The
    whole answer: scripts/draft_agreement.py, which this replaces, kept only the "ar" steps and so dropped each
    answer's first token (the prefill's)."""
    config = GenerationConfig(max_new_tokens=max_new_tokens)
    samples = []
    for item in items:
        ids = encode_prompt(tokenizer, item.prompt)
        answer = generated_ids(list(autoregressive(target, tokenizer, ids, config)))
        samples.append({"ids": ids + answer, "prompt_len": len(ids), "category": item.category})
    return samples


def answer_features(target, samples: list[Sample], layers: tuple[int, ...] = ()) -> dict:
    """build_features for these samples and layers, recorded afresh (in a temporary folder, nothing cached)."""
    with tempfile.TemporaryDirectory() as work:
        return build_features(target, samples, Path(work), batch_size=1, layers=layers)


def _slashed(xs: list[float]) -> str:
    return " / ".join(f"{x:.3f}" for x in xs)


def prompt_table(head, samples: list[Sample], data: dict, depth: int, device: torch.device) -> str:
    """Agreement at draft steps 1..depth, chain rate, estimated tokens per pass at k = depth and the share of the
    target's answer tokens inside the draft's subset, for all samples and per category (a sample's "category"). A target
    token outside the subset counts as a miss (`evaluate`), so step 1 matches a timed k = 1 run."""
    sub_index = subset_index(head)
    lines = [f"| prompts | n | top-1 agreement, steps 1..{depth} | chain rate | est. tokens per pass at k = {depth} "
             "| target tokens inside the subset |", "|---|---|---|---|---|---|"]
    categories = [s["category"] for s in samples]
    for name in ["all"] + sorted(set(categories)):
        idx = [i for i, c in enumerate(categories) if name in ("all", c)]
        m = evaluate(head, samples, data, idx, sub_index, device, depth=depth, batch_size=1, max_len=1 << 16, skip=0)
        labels = torch.cat([data["top1"][i][samples[i]["prompt_len"] - 1 : -1].long() for i in idx])
        inside = float((sub_index[labels] >= 0).float().mean())
        lines.append(f"| {name} | {len(idx)} | {_slashed(m['top1_step'])} | {_slashed(m['chain'])} | "
                     f"{m['est_mean_accepted']:.2f} | {inside:.3f} |")
    return "\n".join(lines) + "\n"


def held_out_table(target, heads: list[tuple[str, object, tuple[int, ...]]], cache: Path, depth: int) -> str:
    """distill's held-out agreement for each (name, head, aux layers), with the current `evaluate` on a cache's samples
    and distill's own defaults (seed, max length, batch size, the skipped common prefix). The features are the
    cache's own (its features.pt, written where missing); a head whose layers the cache did not record is not
    measured (recording them would run the target over the whole cache and replace what it holds)."""
    samples = read_jsonl(cache / "samples.jsonl")
    if not samples:
        raise FileNotFoundError(f"no samples.jsonl in {cache}")
    held, _ = split_held_out(samples, random.Random(TrainConfig.seed))
    path = cache / "features.pt"
    recorded = tuple(torch.load(path, mmap=True).get("layers", ())) if path.exists() else None
    lines = [f"| draft | held-out top-1 agreement, steps 1..{depth} | chain rate |", "|---|---|---|"]
    for name, head, layers in heads:
        layers = tuple(layers)
        if recorded is not None and recorded[: len(layers)] != layers:  # build_features slices a prefix only
            lines.append(f"| {name} | (reads layers {list(layers)}, the cache holds {list(recorded)}; not measured "
                         f"here) | |")
            continue
        data = build_features(target, samples, cache, layers=layers)
        m = evaluate(head, samples, data, held, subset_index(head), target.device, depth=depth,
                     batch_size=TrainConfig.batch_size, max_len=TrainConfig.max_len, skip=common_prefix(samples))
        lines.append(f"| {name} | {_slashed(m['top1_step'])} | {_slashed(m['chain'])} |")
    return "\n".join(lines) + "\n"
