"""Command line: `python -m specdemo generate|bench|distill|serve-config|export|space ...`. Environment and argv are
read here only."""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import replace

from . import checks
from .checks import arg
from .cliargs import TREE_HELP, add_placement_args, add_runtime_args, placement_args, runtime_args
from .config import (
    BUNDLED_ID,
    DEFAULT_DRAFTER,
    MAX_K_ENGINE,
    MIN_K,
    VERIFICATION_RULES,
    GenerationConfig,
    SamplingConfig,
    drafter_default,
    k_defaults_help,
    runtime_from_env,
    tree_default,
)
from .drafters.registry import add_flags, cli_help, kinds, names, options_from

G, S = GenerationConfig(), SamplingConfig()
VERIFICATION_HELP = ("how sampled drafts are accepted: token (token-wise rejection sampling, Leviathan et al.) or "
                     "block (block verification, Sun et al.: the block is judged jointly); both keep the target's "
                     "distribution; greedy ignores it")


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="autoregressive then speculative decoding on one prompt")
    p.add_argument("--prompt", required=True)
    p.add_argument("--target", default=BUNDLED_ID, help="hub id, local folder, or the bundled 'smollm2-135m'")
    p.add_argument("--draft", help="draft model id or folder (same tokenizer as the target)")
    p.add_argument("--drafter", choices=names(), type=arg(checks.drafter), default=DEFAULT_DRAFTER,
                   help=cli_help(DEFAULT_DRAFTER))
    p.add_argument("--k", type=arg(checks.k), default=None,
                   help=f"draft tokens per step ({MIN_K}..{MAX_K_ENGINE}; default: {k_defaults_help()})")
    p.add_argument("--dynamic-k", action="store_true", help="adapt k per step (+2 after a full acceptance, else -1)")
    p.add_argument("--tree", type=arg(checks.tree), default=None, help=TREE_HELP)
    p.add_argument("--temperature", type=arg(checks.temperature), default=S.temperature, help="0 is greedy")
    p.add_argument("--top-p", type=arg(checks.top_p), default=S.top_p)
    p.add_argument("--top-k", type=arg(checks.top_k), default=S.top_k)
    p.add_argument("--verification", choices=VERIFICATION_RULES, type=arg(checks.verification), default=S.verification,
                   help=VERIFICATION_HELP)
    p.add_argument("--max-new-tokens", type=arg(checks.max_new_tokens), default=G.max_new_tokens)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--seed", type=arg(checks.seed), default=G.seed)
    p.add_argument("--device", type=arg(checks.device), default=None, help="auto (default), cpu, cuda, cuda:1, mps")
    add_placement_args(p)
    add_runtime_args(p)
    add_flags(p, "generate")
    p.add_argument("--dtype", default=None, help="fp32, bf16, fp16 (default: bf16/fp16 on GPU, fp32 on CPU)")
    p.add_argument("--no-chat-template", action="store_true")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--json", action="store_true", help="end with one JSON object")


def run_generate(args) -> int:
    from .drafters.resolve import starting_k
    from .measure.compare import compare, load_pair
    from .models.placement import placement_line

    kind, runtime = args.drafter, runtime_args(args, os.environ)
    checks.prompt(args.prompt)  # every value is checked before any model loads (argparse checked the numbers)
    checks.pair(args.target, kind, args.draft, args.trust_remote_code)
    checks.device(args.draft_device, "draft device")
    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens, num_draft_tokens=args.k or G.num_draft_tokens, dynamic_k=args.dynamic_k,
        sampling=SamplingConfig(args.temperature, args.top_k, args.top_p, args.verification),
        stop_strings=tuple(args.stop),
        seed=args.seed, use_chat_template=not args.no_chat_template, tree=args.tree or tree_default(kind),
    )
    config.validate()
    checks.prompt_tokens(args.target, args.prompt, args.max_new_tokens, runtime, not args.no_chat_template,
                         args.trust_remote_code)
    pair = load_pair(args.target, kind, args.draft, args.device, args.dtype, args.draft_device, args.trust_remote_code,
                     runtime=runtime, placement=placement_args(args), drafter_options=options_from(args))
    if args.k is None:  # after loading: a hub head is in the local cache now, with its recorded k
        config = replace(config, num_draft_tokens=starting_k(kind, args.target, args.draft, runtime)[0])
        config.validate()
    result = compare(pair, args.prompt, config)
    if args.json:
        print(json.dumps(result, ensure_ascii=False))
        return 0
    ar, sd = result["ar"], result["sd"]
    print(f"target {result['target']}  drafter {result['drafter']} ({result['draft'] or 'prompt lookup'})  "
          f"k={result['k']}  device {result['device']}")
    print(placement_line(result["placement"]))
    print(f"\n--- autoregressive: {ar['tokens']} tokens, {ar['tokens_per_s']:.1f} tok/s\n{ar['text']}")
    print(f"\n--- speculative: {sd['tokens']} tokens, {sd['tokens_per_s']:.1f} tok/s, "
          f"acceptance {sd['acceptance_rate']:.2f}, mean accepted {sd['mean_accepted']:.2f} tokens/pass\n{sd['text']}")
    print(f"\nspeedup {result['speedup']:.2f}x  identical tokens: {result['identical']}")
    if result.get("mismatch"):
        print(f"first difference: {result['mismatch']}")
    return 0


def _serve_help() -> str:
    """serve-config's --drafter help: each registered kind's vLLM method."""
    fixed = [f"'{k.name}' -> {k.vllm_method}" for k in kinds() if k.vllm_method]
    by_draft = ", ".join(f"'{k.name}'" for k in kinds() if not k.vllm_method)
    return "; ".join(fixed + [f"{by_draft} -> the draft's: eagle3 (an EAGLE-3 head, e.g. from `python -m specdemo "
                              f"export`) or draft_model (any causal LM)"])


def _serve_config_parser(sub) -> None:
    p = sub.add_parser("serve-config", help="print the `vllm serve` (and SGLang) command for a target, drafter and k")
    p.add_argument("--target", default=BUNDLED_ID, help="hub id, local folder, or the bundled 'smollm2-135m'")
    p.add_argument("--drafter", choices=names(), type=arg(checks.drafter), default=DEFAULT_DRAFTER,
                   help=_serve_help())
    p.add_argument("--draft", help="draft model id or folder (an exported EAGLE-3 folder for eagle3)")
    p.add_argument("--k", type=arg(checks.k), default=None,
                   help=f"draft tokens per step (default: the tuned k in --sweep, else {k_defaults_help()})")
    p.add_argument("--sweep", metavar="JSON", help="a bench.json or sweep result: take its measured best k")
    p.add_argument("--verification", choices=VERIFICATION_RULES, type=arg(checks.verification), default=S.verification,
                   help="token: vLLM's default rejection sampling; block: rejection_sample_method 'block'")
    p.add_argument("--tensor-parallel-size", type=arg(checks.count("tensor parallel size")), default=1,
                   help="GPUs per model replica (vLLM -tp)")
    p.add_argument("--pipeline-parallel-size", type=arg(checks.count("pipeline parallel size")), default=1,
                   help="pipeline stages, e.g. one per node")
    p.add_argument("--ray", action="store_true",
                   help="--distributed-executor-backend ray (multi-node; implied by --pipeline-parallel-size > 1)")
    add_flags(p, "serve-config")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the command lines")


def run_serve_config(args) -> int:
    from .drafters.resolve import starting_k
    from .serve.serve_config import (
        k_from_report,
        plan,
        sglang_command,
        vllm_serve_command,
    )

    checks.pair(args.target, args.drafter, args.draft)
    runtime = runtime_from_env(os.environ)
    k, source = args.k, "--k"
    if k is None and args.sweep:
        k, where = k_from_report(args.sweep)
        source = f"{args.sweep} ({where})"
    if k is None:
        k, source = starting_k(args.drafter, args.target, args.draft, runtime)
    k = checks.k(k)  # a k read from --sweep too
    p = plan(args.target, args.drafter, args.draft, k, runtime, args.verification, options_from(args))
    extra: list[str] = []
    if args.tensor_parallel_size > 1:
        extra += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    if args.pipeline_parallel_size > 1:
        extra += ["--pipeline-parallel-size", str(args.pipeline_parallel_size)]
    if args.ray or args.pipeline_parallel_size > 1:
        extra += ["--distributed-executor-backend", "ray"]
    vllm_cmd = vllm_serve_command(p.target, p.speculative_config, extra)
    sglang_extra = (f" --tp-size {args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else "") + (
        f" --pp-size {args.pipeline_parallel_size}" if args.pipeline_parallel_size > 1 else "")
    sglang_cmd = sglang_command(p.target, p.method, k, p.draft_path, p.lookup, p.sglang_method, p.suffix) + sglang_extra
    if args.json:
        print(json.dumps({"target": p.target, "method": p.method, "k": k, "k_source": source,
                          "speculative_config": p.speculative_config, "vllm": vllm_cmd, "sglang": sglang_cmd,
                          "notes": list(p.notes)}))
        return 0
    print(f"# {args.target}, drafter {args.drafter} -> vLLM method {p.method}, k = {k} from {source}")
    for note in p.notes:
        print(f"# note: {note}")
    print(vllm_cmd)
    print("# SGLang (flags from its documentation; not run by specdemo):")
    print(sglang_cmd)
    return 0


def _export_parser(sub) -> None:
    p = sub.add_parser("export", help="write an EAGLE-3 head as a checkpoint vLLM and SGLang load, with their flags")
    p.add_argument("--draft", required=True, help="an EAGLE-3 head: a folder (e.g. from `distill`) or a "
                                                  "hub id")
    p.add_argument("--out", required=True, help="the folder to write (config.json, model.safetensors, "
                                                "speculative_config.json, sglang.txt)")
    p.add_argument("--k", type=arg(checks.k), default=None,
                   help="num_speculative_tokens, recorded with where it came from (default: the tuned k in --sweep, "
                        f"else the shipped draft's best measured k, {drafter_default('model').k}, else the head's "
                        f"recorded k, else {G.num_draft_tokens})")
    p.add_argument("--sweep", metavar="JSON", help="a bench.json or sweep result: take its measured best k")
    p.add_argument("--min-confidence", type=float, default=None,
                   help="the confidence gate our EAGLE-3 drafter reads from the export (default: the head's own); "
                        "vLLM and SGLang have none, so 0 makes ours draft what they draft")
    p.add_argument("--target", default=None,
                   help="the target, for the printed serve commands and a speculators head's verifier (default: the "
                        f"one the head records, else {BUNDLED_ID})")
    p.add_argument("--format", choices=["eagle3", "speculators"], default="eagle3",
                   help="eagle3: the raw EAGLE-3 layout vLLM and SGLang load beside the target (default); speculators: "
                        "the speculators format, whose config names the target, so `vllm serve OUT` alone serves both")


def run_export(args) -> int:
    from .serve.export import export_eagle3
    from .serve.serve_config import k_from_report

    checks.model(args.draft, "draft")
    if args.target is not None:
        checks.model(args.target, "target")
    k, source = args.k, "--k"
    if k is None and args.sweep:
        k, where = k_from_report(args.sweep)
        source = f"{args.sweep} ({where})"
        k = checks.k(k)
    result = export_eagle3(args.draft, args.out, k, args.target, runtime_from_env(os.environ), args.format,
                           args.min_confidence, k_source=source if k is not None else None)
    print(f"# wrote {result.folder} (EAGLE-3, {args.format} format, k = {result.k} from {result.k_source})")
    print(result.vllm_command)
    print("# SGLang:")
    print(result.sglang_command)
    return 0


def _space_parser(sub) -> None:
    from huggingface_hub import SpaceHardware

    p = sub.add_parser("space", help="deploy the app as a Hugging Face Space (create, set variables, upload)")
    p.add_argument("space_id", metavar="SPACE_ID", type=arg(checks.space_id), help="e.g. your-name/specdemo")
    p.add_argument("--hardware", choices=[h.value for h in SpaceHardware], help="request this hardware "
                   "(default: the Space's own, cpu-basic on a new Space)")
    p.add_argument("--private", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="list every file with its size and whether it goes by LFS, "
                                                         "the variables and the hardware; no network")


def run_space(args) -> int:
    from .app.space import deploy, dry_run_lines, space_files, space_variables

    if args.dry_run:
        print("\n".join(dry_run_lines(space_files(), args.space_id, args.hardware, space_variables())))
        return 0
    print(deploy(args.space_id, args.hardware, args.private))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "distill":
        from .train import main as distill_main

        return distill_main(argv[1:], runtime_from_env(os.environ))
    if argv and argv[0] == "bench":
        from .measure.bench import main as bench_main

        return bench_main(argv[1:])
    parser = checks.Parser(prog="python -m specdemo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _serve_config_parser(sub)
    _export_parser(sub)
    _space_parser(sub)
    sub.add_parser("bench", help="benchmark against transformers' generate (see `bench --help`)")
    sub.add_parser("distill", help="train a draft for a target, or `distill agreement` to measure one "
                                  "(see `distill --help`)")
    try:
        args = parser.parse_args(argv)
    except checks.UserError as exc:  # a refused flag: one line, exit status 2, as every refusal below
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from .engine import GenerationError
    from .models.loading import ModelLoadError, TokenizerMismatchError

    try:
        runners = {"serve-config": run_serve_config, "export": run_export, "space": run_space}
        runner = runners.get(args.command, run_generate)
        return runner(args)
    except (ModelLoadError, TokenizerMismatchError, GenerationError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
