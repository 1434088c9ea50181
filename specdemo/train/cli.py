"""The command line: `python -m specdemo distill --target ID --out DIR [...]` trains a draft, and `python -m specdemo
distill agreement --draft DIR [...]` measures one. The parser's defaults come from TrainConfig; the flags become a
TrainConfig once, here, and only that (or explicit arguments) goes further down.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from ..config import BUNDLED_ID, Runtime
from ..engine import eos_ids
from ..prompts import DEFAULT_PROMPTS, read_prompts
from .agreement import answer_features, held_out_table, prompt_table, target_answers
from .answers import build_data
from .config import LogFn, TrainConfig
from .features import build_features, choose_subset
from .heads import build as build_trainee
from .heads import default_layers, evaluable, load_drafter
from .training import common_prefix, train

log = logging.getLogger(__name__)

DESCRIPTION = ("Distil a draft head from a target model, using only the target's own answers: an EAGLE-3 head "
               "(specdemo.models.eagle3) in vLLM's and SGLang's checkpoint format, reading the aux layers' states "
               "(--fuse-layers, default vLLM's 2, L/2, L-3) over a --subset-size draft vocabulary; docs/eagle3.md.")
EPILOG = ("`python -m specdemo distill agreement --help`: a trained draft's teacher-forced agreement with its target "
          "on a prompt set or on a distill cache's held-out split.")


def train_parser() -> argparse.ArgumentParser:
    """The training command's flags, one per TrainConfig field, with TrainConfig's defaults."""
    D = TrainConfig  # noqa: N806  (the dataclass's class attributes are its defaults)
    p = argparse.ArgumentParser(prog="python -m specdemo distill", description=DESCRIPTION, epilog=EPILOG)
    p.add_argument("--target", required=True, help="target model id or folder (e.g. smollm2-135m)")
    p.add_argument("--out", required=True, help="asset folder to write (weights, config, train_log.jsonl)")
    p.add_argument("--work", default=D.work, help="cache folder for generated data (default: OUT/cache)")
    p.add_argument("--device", default=D.device)
    p.add_argument("--seed", type=int, default=D.seed)
    p.add_argument("--scale", type=float, default=D.scale, help="multiplies the number of generated answers")
    p.add_argument("--max-new-tokens", type=int, default=D.max_new_tokens)
    p.add_argument("--gen-batch-size", type=int, default=D.gen_batch_size,
                   help="conversations answered at once (larger batches answer faster per conversation with "
                        "--features writer, at the cost of memory)")
    p.add_argument("--max-sequences", type=int, default=D.max_sequences,
                   help="stop generating at this many sequences (0: all)")
    p.add_argument("--data-minutes", type=float, default=D.data_minutes,
                   help="time budget for answering: no batch starts after it (0: none); the written requests go "
                        "shortest first, so a cut keeps the shorter ones")
    p.add_argument("--gen-dtype", default=D.gen_dtype,
                   help="dtype of the target copy that writes instructions and answers (bf16: faster on a CPU "
                        "with AVX512-BF16); with --features target, features and labels come from the fp32 target")
    p.add_argument("--self-instruct", type=int, default=D.self_instruct,
                   help="also answer this many instructions the target writes itself (Magpie-style; 0 by default: "
                        "the written requests generalise better, docs/notes/draft-experiments.md)")
    p.add_argument("--steered-instruct", type=int, default=D.steered_instruct,
                   help="then this many self-written instructions that start with one of distill.instructions.OPENINGS "
                        "(translation, edits of a given text, extraction, formats; the target writes the rest)")
    p.add_argument("--features", default=D.features, choices=["writer", "target"],
                   help="where the features and labels come from: 'writer' (the default), the passes that write the "
                        "answers (the --gen-dtype copy; shortest prompts batched together, no pass of its own, so the "
                        "data stage takes far less time); 'target', a pass of the fp32 "
                        "target over every sequence once all are answered (what earlier drafts used)")
    p.add_argument("--instructions", default=D.instructions,
                   help="also answer the instructions in these JSONL files (comma-separated; 'written': the "
                        "project's file of 2,974 helper-written requests; 'written2': its second batch of 2,978; both "
                        "by default, as for the shipped draft; 'written3': a third batch of 2,989, not in the default "
                        "(docs/notes/draft-experiments.md); '': none)")
    p.add_argument("--subset-size", type=int, default=D.subset_size,
                   help="the draft vocabulary: the target's most frequent tokens in the answers")
    p.add_argument("--steps", type=int, default=D.steps)
    p.add_argument("--train-minutes", type=float, default=D.train_minutes,
                   help="time budget for training: fewer steps (same schedule shape) if the pace needs it")
    p.add_argument("--total-minutes", type=float, default=D.total_minutes,
                   help="time budget for the whole run: training gets what data and features left (at least 5 min)")
    p.add_argument("--batch-size", type=int, default=D.batch_size)
    p.add_argument("--max-len", type=int, default=D.max_len)
    p.add_argument("--fuse-layers", default=D.fuse_layers,
                   help="comma-separated target layers whose hidden states the head reads (its aux layers, written "
                        "to config.json; default: vLLM's 2, L/2, L-3)")
    p.add_argument("--train-dtype", default=D.train_dtype, choices=["fp32", "bf16"],
                   help="bf16: autocast the head's forward and backward (weights and optimiser stay fp32)")
    p.add_argument("--depth", type=int, default=D.depth, help="draft steps unrolled in training (training-time test)")
    p.add_argument("--decay", type=float, default=D.decay, help="loss weight ratio between successive depths")
    p.add_argument("--lr", type=float, default=D.lr)
    p.add_argument("--init-layer", type=int, default=D.init_layer,
                   help="start the head's midlayer as a copy of this target layer (-1: the last), not at random")
    p.add_argument("--weight-decay", type=float, default=D.weight_decay,
                   help="AdamW weight decay on the weight matrices")
    p.add_argument("--train-fraction", type=float, default=D.train_fraction,
                   help="train on this share of the training split only, same held-out set (a data-scaling check)")
    p.add_argument("--noise", type=float, default=D.noise, help="uniform noise on input features")
    p.add_argument("--feat-weight", type=float, default=D.feat_weight, help="weight of the smooth L1 feature loss")
    p.add_argument("--soft-weight", type=float, default=D.soft_weight,
                   help="share of the token loss taken against the target's distribution over the subset instead "
                        "of its greedy token (EAGLE trains on the distribution: 1.0)")
    p.add_argument("--skip", type=int, default=D.skip, help="leading positions without loss (default: shared prefix)")
    p.add_argument("--min-confidence", type=float, default=D.min_confidence,
                   help="confidence gate written into the asset's config (see Eagle3Drafter; docs/draft.md "
                        "says how the default was chosen)")
    p.add_argument("--log-every", type=int, default=D.log_every)
    p.add_argument("--eval-every", type=int, default=D.eval_every,
                   help="held-out evaluation every N steps (each one takes time from training)")
    p.add_argument("--data-only", action="store_true", default=D.data_only,
                   help="stop after generating data and features")
    return p


def parse_config(argv: list[str]) -> TrainConfig:
    """The training command's flags as a TrainConfig."""
    return TrainConfig(**vars(train_parser().parse_args(argv)))


def main(argv: list[str] | None = None, runtime: Runtime = Runtime()) -> int:
    """`distill agreement ...` measures a draft; anything else trains one. `runtime` comes from the caller's
    environment (config.runtime_from_env, read by `python -m specdemo`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if argv and argv[0] == "agreement":
        return agreement_main(argv[1:], runtime)
    return run(parse_config(argv), runtime)


def _logger(path: Path, t_start: float) -> LogFn:
    """A LogFn that logs each record and appends it to `path` (train_log.jsonl), stamped with the run's seconds."""

    def log_fn(record: dict) -> None:
        record = {"time": round(time.perf_counter() - t_start, 1), **record}
        log.info(json.dumps(record))
        with path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    return log_fn


def run(config: TrainConfig, runtime: Runtime = Runtime()) -> int:
    """Generate data with the target, record its features, train the head and write the asset to config.out."""
    from ..models.loading import load_model

    out = Path(config.out)
    work = Path(config.work) if config.work else out / "cache"
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    t_start = time.perf_counter()
    log_fn = _logger(out / "train_log.jsonl", t_start)
    log_fn({"event": "start", "args": asdict(config)})
    loaded = load_model(config.target, device=config.device, dtype="fp32", runtime=runtime)
    target, tokenizer = loaded.model, loaded.tokenizer
    for p in target.parameters():
        p.requires_grad_(False)
    config = replace(config, fuse_layers=default_layers(config, target.config.num_hidden_layers))
    writer = (target if config.gen_dtype == "fp32"
              else load_model(config.target, device=config.device, dtype=config.gen_dtype, runtime=runtime).model)
    samples = build_data(writer, tokenizer, work, config, log_fn)
    t = time.perf_counter()
    data = build_features(writer if config.features == "writer" else target, samples, work, layers=config.layers)
    log_fn({"event": "features", "positions": sum(len(f) for f in data["features"]),
            "seconds": round(time.perf_counter() - t, 1)})
    if config.data_only:
        return 0
    subset = choose_subset(samples, data["top1"], config.subset_size, target.config.vocab_size,
                           sorted(eos_ids(target, tokenizer)))
    config = replace(config, skip=config.skip or common_prefix(samples))
    if config.total_minutes:
        config = replace(config, train_minutes=max(5.0, config.total_minutes - (time.perf_counter() - t_start) / 60))
        log_fn({"event": "train_budget", "minutes": round(config.train_minutes, 1)})
    head, save = build_trainee(config, target, subset, data)
    meta = lambda step, m: {"target": config.target, "step": step, "metrics": m,  # noqa: E731
                            "min_confidence": config.min_confidence,
                            "seconds": round(time.perf_counter() - t_start)}
    metrics = train(head, samples, data, config, loaded.device, log_fn, lambda step, m: save(out, meta(step, m)))
    log_fn({"event": "done", "total_seconds": round(time.perf_counter() - t_start, 1), **metrics})
    return 0


def agreement_parser() -> argparse.ArgumentParser:
    """The agreement command's flags (`python -m specdemo distill agreement ...`)."""
    p = argparse.ArgumentParser(
        prog="python -m specdemo distill agreement",
        description="A trained draft's teacher-forced agreement with its target at draft steps 1..depth: the target "
                    "writes its greedy answer to each prompt and the draft reads the target's true features along it, "
                    "as distill scores its held-out split. Step 1 is the acceptance a k = 1 benchmark measures, "
                    "without timing; a target token outside the draft's vocabulary subset counts as a miss.")
    p.add_argument("--draft", nargs="+", default=None,
                   help="trained draft folders, one table each over one set of answers (default: the shipped one)")
    p.add_argument("--target", default=BUNDLED_ID, help="the target the drafts were trained for")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="JSONL prompt file (default: the dev set)")
    p.add_argument("--limit", type=int, default=None, help="the first N prompts only")
    p.add_argument("--depth", type=int, default=3, help="draft steps measured")
    p.add_argument("--max-new-tokens", type=int, default=128, help="length of the target's answers")
    p.add_argument("--held-out", default=None,
                   help="a distill cache folder: evaluate on its held-out split as distill does, not on prompts")
    p.add_argument("--device", default=None, help="auto (default), cpu, cuda, ...")
    p.add_argument("--out", default=None, help="also write the tables to this markdown file")
    return p


def agreement_main(argv: list[str], runtime: Runtime = Runtime()) -> int:
    """Print (and with --out, write) the agreement tables for each draft."""
    from ..drafters.resolve import trained_draft_path
    from ..models.loading import load_model

    args = agreement_parser().parse_args(argv)
    drafts = args.draft or [str(trained_draft_path(args.target) or "")]
    if not drafts[0]:
        raise SystemExit(f"error: no shipped draft for {args.target}; name one with --draft")
    loaded = load_model(args.target, device=args.device, runtime=runtime)
    drafters = [(folder, load_drafter(folder, loaded)) for folder in drafts]
    heads = [(folder, evaluable(d.head, loaded.model), tuple(d.target_layers)) for folder, d in drafters]
    if args.held_out:
        report = held_out_table(loaded.model, heads, Path(args.held_out), args.depth)
    else:
        items = read_prompts(args.prompts, args.limit)
        samples = target_answers(loaded.model, loaded.tokenizer, items, args.max_new_tokens)
        tables = []
        for folder, head, layers in heads:
            data = answer_features(loaded.model, samples, layers)
            tables.append((f"`{folder}`\n\n" if len(heads) > 1 else "")
                          + prompt_table(head, samples, data, args.depth, loaded.device))
        report = "\n".join(tables)
    print(report, end="")
    if args.out:
        command = " ".join(["python -m specdemo distill agreement", *argv])
        Path(args.out).write_text(f"`{command}`\n\n{report}")
    return 0
