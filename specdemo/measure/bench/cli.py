"""`python -m specdemo bench` flags, turned once into a BenchConfig; the one-line summary. argv and the environment
are read here (the flags' defaults come from BenchConfig, the drafter kinds from the registry)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import torch

from ... import checks
from ...checks import arg
from ...cliargs import TREE_HELP, add_placement_args, add_runtime_args, placement_args, runtime_args
from ...config import DEFAULT_DRAFTER, k_defaults_help
from ...drafters.registry import add_flags, cli_help, names, options_from
from ...engine import GenerationError
from ...models.loading import ModelLoadError, TokenizerMismatchError
from .batch_report import batch_baseline_warning
from .batch_run import run_batch_bench
from .outputs import baseline_warning
from .run import BenchConfig, run_bench
from .vllm import VLLM_PYTHON_ENV, VllmOptions, VllmUnavailable

ANCHORS = ("hf", "vllm")

D = BenchConfig()
DESCRIPTION = """`python -m specdemo bench`: our autoregressive and speculative decoders on a prompt set, against
transformers.

For each prompt: autoregressive, then speculative at each k (greedy unless told otherwise), one after the other;
with --anchors also transformers' generate (plain, assisted, prompt lookup) at the same k on the same input ids, and
with --anchors vllm (or hf,vllm) vLLM's plain, ngram, suffix (for --drafter suffix) and eagle3 decoding in its own
venv and process, after ours. Suffix decoding's cache of earlier answers is carried across the prompts in order, as
a server carries it (--suffix-cold: emptied before each prompt).
Writes bench.json, bench.md and bench.html. Forward passes are timed by hooks, so the per-step cost outside the
model (drafting logic, acceptance, rollback, detokenization) is reported too.
"""


def parser() -> argparse.ArgumentParser:
    p = checks.Parser(prog="python -m specdemo bench", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", default=D.prompts, help="JSONL prompt file (default: the in-repo dev set, %(default)s)")
    p.add_argument("--limit", type=arg(checks.count("limit")), default=D.limit, help="only the first N prompts")
    p.add_argument("--target", default=D.target)
    p.add_argument("--draft", help="draft model id or folder (implies --drafter model unless hybrid is asked for)")
    p.add_argument("--drafter", choices=names(), type=arg(checks.drafter), default=D.drafter,
                   help=f"default: '{DEFAULT_DRAFTER}' with --draft or a target's trained draft (the bundled one's), "
                        "else 'ngram'; " + cli_help())
    p.add_argument("--k", default=D.k, help="draft tokens per step: N, a list like 1,2,4,8, or 'auto' (default: "
                                            f"{k_defaults_help()})")
    p.add_argument("--temperature", type=arg(checks.temperature), default=D.temperature, help="0 is greedy")
    p.add_argument("--verification", default=D.verification,
                   help="how sampled drafts are accepted: token (rejection sampling, Leviathan et al.), block (block "
                        "verification, Sun et al.), or both as token,block: each k runs under each rule, in one "
                        "report (default %(default)s)")
    p.add_argument("--max-new-tokens", type=arg(checks.max_new_tokens), default=D.max_new_tokens)
    p.add_argument("--seed", type=arg(checks.seed), default=D.seed)
    p.add_argument("--anchors", nargs="?", const="hf", default=None, metavar="hf,vllm",
                   help="also time reference engines on the same inputs: 'hf' (the default of a bare --anchors) is "
                        "transformers' generate, assisted generation and prompt lookup; 'vllm' is vLLM's plain, "
                        "ngram and eagle3 decoding in its own venv (`bash run.sh vllm`, or "
                        f"{VLLM_PYTHON_ENV}), run after ours; 'hf,vllm' both")
    p.add_argument("--vllm-eagle3", metavar="DIR",
                   help="with --anchors vllm: an EAGLE-3 folder from `python -m specdemo export` for vLLM's eagle3 "
                        "(default: --draft when it is one)")
    p.add_argument("--vllm-threads-bind", metavar="CPUS",
                   help="with --anchors vllm: VLLM_CPU_OMP_THREADS_BIND for vLLM's CPU worker, e.g. 0-1 (default: "
                        "vLLM's 'auto', which keeps one core for its scheduler process)")
    add_flags(p, "bench")
    p.add_argument("--suffix-cold", action="store_true",
                   help="empty what the drafter keeps across requests (suffix decoding's cache of earlier answers) "
                        "before each prompt (default: carried across the prompts in order, as a server carries it; "
                        "vLLM's suffix method then keeps no earlier answers)")
    p.add_argument("--tree", type=arg(lambda text: ",".join(checks.trees(text))), default=D.tree,
                   help=TREE_HELP + "; a list like off,auto,16 runs each k under each setting, chains against trees "
                                    "at the same drafter, in one report (by_tree in bench.json)")
    p.add_argument("--out", default=D.out, help="output folder for bench.json, bench.md, bench.html "
                                                "(default %(default)s, git-ignored)")
    p.add_argument("--device", default=D.device)
    add_placement_args(p)
    add_runtime_args(p)
    p.add_argument("--dtype", default=D.dtype)
    p.add_argument("--threads", type=arg(checks.count("threads")), default=None,
                   help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-chat-template", action="store_true")
    p.add_argument("--no-theory", action="store_true", help="skip the verify-cost micro-benchmark and theory curve")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--batch-size", dest="batch_sizes", default=D.batch_sizes,
                   help="batch sizes like 1,2,4,8,16: batched AR and SD (and, with --anchors, generate on the same "
                        "padded batches) at each size, the speedup against batch size and where it drops below 1; "
                        "--k takes one value or 'auto' (k chosen per batch size from measured costs)")
    p.add_argument("--max-batches", type=arg(checks.count("max batches")), default=D.max_batches,
                   help="with --batch-size: at most this many batches per batch size (default: all)")
    return p


def parse_anchors(text: str | None) -> set[str]:
    """None -> no anchors; 'hf' / 'vllm' / 'hf,vllm' -> those names."""
    names = {n.strip().lower() for n in (text or "").split(",") if n.strip()}
    unknown = names - set(ANCHORS)
    if unknown:
        raise ValueError(f"--anchors takes a comma list of {', '.join(ANCHORS)}; got {', '.join(sorted(unknown))}")
    return names


def bench_config(args: argparse.Namespace, env=os.environ) -> BenchConfig:
    """The flags as a BenchConfig (the only place a Namespace is read), each value checked (checks) before any file is
    read or model loaded."""
    anchors = parse_anchors(args.anchors)
    vllm = VllmOptions(python=env.get(VLLM_PYTHON_ENV) or None, eagle3=args.vllm_eagle3,
                       threads_bind=args.vllm_threads_bind)
    config = BenchConfig(prompts=args.prompts, limit=args.limit, target=args.target, draft=args.draft,
                         drafter=args.drafter, k=args.k, temperature=args.temperature, verification=args.verification,
                         max_new_tokens=args.max_new_tokens, seed=args.seed, anchors="hf" in anchors,
                         vllm="vllm" in anchors, vllm_options=vllm, out=args.out,
                         device=args.device, dtype=args.dtype, chat_template=not args.no_chat_template,
                         placement=placement_args(args), draft_device=args.draft_device,
                         theory=not args.no_theory, quiet=args.quiet, runtime=runtime_args(args, env),
                         batch_sizes=args.batch_sizes, max_batches=args.max_batches,
                         drafter_options=options_from(args), suffix_cold=args.suffix_cold, tree=args.tree)
    if config.k is not None:  # None: the measured starting k, resolved once the pair is known
        checks.ks(config.k)
    checks.verifications(config.verification, config.temperature)
    checks.pair(config.target, config.drafter_kind, config.draft)
    checks.device(config.device)
    checks.device(config.draft_device, "draft device")
    return config


def summary_line(report: dict) -> str:
    """Speedup, acceptance, identical outputs, the anchors and the overheads, in one line."""
    o, a, ov = report["overall"], report.get("anchors") or {}, report.get("overhead") or {}
    line = (f"speedup {o['speedup']:.2f}x  mean accepted {o['mean_accepted']:.2f}  "
            f"acceptance {o['acceptance_rate']:.2f}  identical {o['identical_fraction']:.2f}")
    if "ar_vs_hf_generate" in a:
        line += f"  | AR/HF generate {a['ar_vs_hf_generate']:.3f}"
        for n in ("hf_prompt_lookup", "hf_assisted"):
            if a.get(f"{n}_speedup") is not None:
                line += f"  {n} speedup {a[f'{n}_speedup']:.2f}x"
    v = a.get("vllm") or {}
    if v:
        line += f"  | vLLM plain {v['plain_tokens_per_s']:.1f} tok/s, our AR / vLLM plain {v['ar_vs_vllm_plain']:.2f}"
        for m in ("ngram", "suffix", "eagle3"):
            if v.get(f"{m}_speedup") is not None:
                line += f", vLLM {m} speedup {v[f'{m}_speedup']:.2f}x"
    if "sd_ms_per_step" in ov:
        line += f"  | overhead AR {ov['ar_ms_per_step']:.2f} ms/step, SD {ov['sd_ms_per_step']:.2f} ms/step"
    return line


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        config = bench_config(args)
        if not Path(args.prompts).is_file():
            raise checks.refused("the prompt file", args.prompts, "an existing JSONL file")
        if args.threads:
            torch.set_num_threads(args.threads)
        report = run_batch_bench(config) if config.batch_sizes else run_bench(config)
    except (ModelLoadError, TokenizerMismatchError, GenerationError, VllmUnavailable, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if config.batch_sizes:
        return _batch_done(report, args.out)
    print(summary_line(report))
    for f in (report["config"].get("vllm") or {}).get("failed") or []:
        print(f"warning: vLLM {f['name']} (k = {f['k']}) failed: {f['error']}", file=sys.stderr)
    if (report["config"].get("vllm") or {}).get("tree_note"):
        print(f"note: {report['config']['vllm']['tree_note']}", file=sys.stderr)
    warning = baseline_warning(report.get("anchors") or {})
    if warning:
        print(warning.replace("**", ""), file=sys.stderr, end="")
    print(f"wrote {Path(args.out) / 'bench.json'}, bench.md, bench.html")
    return 0


def batch_summary_lines(report: dict) -> list[str]:
    """One line per batch size (throughput, speedup, k, the baseline check), then where speculation stops paying."""
    lines = []
    for b, p in report["by_batch_size"].items():
        line = (f"B={b}: AR {p['ar_tokens_per_s']:.1f} tok/s, SD {p['sd_tokens_per_s']:.1f} tok/s, speedup "
                f"{p['speedup']:.2f}x (k {p['k']}, auto k {p['auto_k']}), mean accepted {p['mean_accepted']:.2f}, "
                f"verify cost {p['verify_cost']:.2f}, identical {p['identical_fraction']:.2f}")
        if p.get("ar_vs_hf_generate") is not None:
            line += f" | AR/HF generate {p['ar_vs_hf_generate']:.3f}"
        lines.append(line)
    cross = report.get("crossover_batch_size")
    lines.append(f"speculation stops paying at batch size {cross}" if cross is not None
                 else "speculation pays at every measured batch size")
    return lines


def _batch_done(report: dict, out: str) -> int:
    print("\n".join(batch_summary_lines(report)))
    warning = batch_baseline_warning(report)
    if warning:
        print(warning.replace("**", ""), file=sys.stderr, end="")
    print(f"wrote {Path(out) / 'bench.json'}, bench.md, bench.html")
    return 0
