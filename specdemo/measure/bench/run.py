"""The benchmark run: load the pair once, warm every code path, then per prompt our autoregressive run, our
speculative run at each k and the transformers anchors, one after the other (never sharing the hardware)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ... import checks
from ...config import (
    BUNDLED_ID,
    DEFAULT_DRAFTER,
    MAX_K,
    GenerationConfig,
    Placement,
    Runtime,
    SamplingConfig,
    tree_default,
)
from ...drafters.base import SharedState
from ...drafters.registry import get, options_of
from ...drafters.resolve import default_draft, starting_k
from ...engine import encode_prompt, eos_ids
from ...engine.loop import tree_plan
from ...engine.timing import ForwardTimer, verify_costs_for
from ...models.eagle3 import eagle3_export
from ...prompts import DEFAULT_PROMPTS, PromptItem, read_prompts
from ...serve.serve_config import Lookup, serve_target
from ..compare import Pair, first_mismatch, load_pair, pair_placement, runner_info, sizing_costs, warmup
from ..metrics import tree_steps, tree_summary, verify_by_nodes
from ..spec_metrics import speculative_decoding, steps_of
from ..tune_k import point, run_ar, run_sd, summarize, sweep
from .anchors import (
    assistant_k,
    has_static_anchor,
    hf_assistant,
    hf_generate,
    hf_kwargs,
    measure_hf,
    measure_hf_static,
)
from .outputs import write_outputs
from .report import build_report
from .timing import drafter_modules, measure_ours, put, ratio, target_modules
from .vllm import VllmOptions, require_python, run_vllm

log = logging.getLogger(__name__)

CALIBRATION_KS = (1, 2, 3, 4, 6, 8)
DEFAULT_OUT = "out/bench"  # git-ignored; reports cited by the docs are copied to bench/
PARTIAL_ROWS = "rows.partial.jsonl"  # each prompt's rows while a run goes; removed once bench.json is written


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run's settings (the CLI's flags, converted once)."""

    prompts: str = str(DEFAULT_PROMPTS)
    limit: int | None = None
    target: str = BUNDLED_ID
    draft: str | None = None
    drafter: str | None = None  # None: DEFAULT_DRAFTER with a draft or the target's trained draft, else "ngram"
    k: str | None = None  # N, a list like 1,2,4,8, or "auto"; None: the pair's starting k (resolve.starting_k)
    temperature: float = 0.0
    verification: str = "token"  # a rule or a list like token,block (each k runs under each rule)
    max_new_tokens: int = 128
    seed: int = 0
    anchors: bool = False  # transformers' generate, assisted generation and prompt lookup
    vllm: bool = False  # vLLM's plain, ngram (and eagle3) decoding, in its own venv and process, after ours
    vllm_options: VllmOptions = VllmOptions()
    out: str = DEFAULT_OUT
    device: str | None = None
    dtype: str | None = None
    chat_template: bool = True
    theory: bool = True
    quiet: bool = False
    runtime: Runtime = Runtime()
    batch_sizes: str | None = None  # "1,2,4,8,16": the batch-size sweep instead of per-prompt runs (run_batch_bench)
    max_batches: int | None = None  # the batch sweep: at most this many batches per batch size
    placement: Placement = Placement()  # the target's device map, memory limits and offload folder
    draft_device: str | None = None  # None: the target's device (a draft head: where the target's head computes)
    drafter_options: Mapping = field(default_factory=dict)  # kind name -> its options (registry.options_from)
    suffix_cold: bool = False  # empty what the drafter keeps across requests before each prompt (default: carried
    # across them in order)
    tree: str | None = None  # draft trees: "auto", "off" or the most nodes per step, or a comma list of them (each k
    # runs under each); None: the drafter's default

    @property
    def tree_setting(self) -> str:
        """--tree, or the drafter's measured default (config.tree_default)."""
        return self.tree or tree_default(self.drafter_kind)

    @property
    def drafter_kind(self) -> str:
        return self.drafter or (DEFAULT_DRAFTER if self.draft or default_draft(self.target) else "ngram")

    def starting_k(self) -> tuple[int, str]:
        """The k a run without --k takes, and where it comes from (the measured default for the pair, ...)."""
        return starting_k(self.drafter_kind, self.target, self.draft, self.runtime)


def machine_info(device: torch.device, dtype: torch.dtype, native=None) -> dict:
    """CPU model, cores, threads, library versions, device and dtype, and which kernel computed the linear products
    on a CPU (`native`: the loaded model's compiled kernel, kernels.native, if any)."""
    import transformers

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "device": str(device), "dtype": str(dtype).replace("torch.", ""),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    else:
        info["linears"] = (f"compiled for this CPU, {native.vector_width} floats a vector" if native is not None
                           else "torch's")
    if hasattr(os, "getloadavg"):
        info["load_average_start"] = list(os.getloadavg())
    return info


def bench_prompt(pair, item: PromptItem, prompt_ids: list[int], ks: list[int], config: GenerationConfig,
                 timers, anchors: bool, runs: dict, progress=None, rules: tuple[str, ...] = (),
                 suffix_cold: bool = False, trees: tuple[str, ...] = ()) -> list[dict]:
    """All runs for one prompt: AR once, SD per k (under each verification rule in `rules`, default the config's,
    and each draft-tree setting in `trees`, default the config's), and the anchors; one result row per k, rule and
    tree setting.

    runs[k] gets (ar_run, sd_run) of the first rule and tree setting appended, for the sweep module's per-k figures.
    What the drafter keeps across requests (a suffix drafter's earlier answers) gets this prompt's answer once, from
    the last run (every k, rule and setting drafts from the same earlier answers); suffix_cold empties it first
    (Drafter.forget).
    """
    if suffix_cold:
        pair.drafter.forget()
    ar = measure_ours(lambda: run_ar(pair, prompt_ids, config), timers)
    model, tok = pair.target.model, pair.target.tokenizer
    kwargs = hf_kwargs(config.sampling, config.max_new_tokens, sorted(eos_ids(model, tok)))
    hf = measure_hf(model, prompt_ids, kwargs, timers, config.seed) if anchors else None
    hf_static = (measure_hf_static(model, prompt_ids, kwargs, timers, config.seed)
                 if anchors and has_static_anchor(model) else None)
    rows = []
    rules, trees = rules or (config.sampling.verification,), trees or (config.tree,)
    runs_of = [(k, rule, tree) for k in ks for rule in rules for tree in trees]
    ar_passes = [e.verify_seconds for e in ar.run.events if e.kind == "ar"]
    for k, rule, tree in runs_of:
        k_config = replace(config, num_draft_tokens=k, tree=tree).with_verification(rule)
        first = (rule, tree) == (rules[0], trees[0])
        with pair.drafter.paused() if (k, rule, tree) != runs_of[-1] else contextlib.nullcontext():
            sd = measure_ours(lambda: run_sd(pair, prompt_ids, k_config), timers)
        if first:
            runs.setdefault(k, []).append((ar.run, sd.run))
        s, a = sd.run.stats, ar.run.stats
        spec = [e for e in sd.run.events if e.kind == "spec"]
        row = {
            "id": item.id, "category": item.category, "k": k, "verification": k_config.sampling.rule, "tree": tree,
            "prompt_tokens": len(prompt_ids),
            "ar_tokens_per_s": ratio(ar.tokens, ar.seconds), "sd_tokens_per_s": ratio(sd.tokens, sd.seconds),
            "speedup": ratio(ar.seconds, sd.seconds),
            "mean_accepted": s.mean_accepted, "acceptance_rate": s.acceptance_rate,
            "identical": ar.ids == sd.ids,
            "steps": s.steps, "drafted": s.drafted, "accepted": s.accepted,
            "spec_tokens": sum(len(e.tokens) for e in spec),
            "tree_steps": tree_steps(sd.run.events)[0],  # steps that verified a draft tree
            "verify_by_nodes": verify_by_nodes(sd.run.events),  # nodes verified -> [passes, seconds]
            "ar_passes": len(ar_passes), "ar_pass_seconds": sum(ar_passes),  # the 1-token passes, for the costs
            "accepted_histogram": s.accepted_histogram,
            "draft_seconds": s.draft_seconds, "verify_seconds": s.verify_seconds,
            "ar_engine_seconds": a.seconds, "sd_engine_seconds": s.seconds,
            "speculative_decoding": speculative_decoding(steps_of(sd.run.events), k),  # vLLM's names
        }
        runners = runner_info(pair)  # how our passes ran: CUDA graphs, static uncaptured, or eager (why)
        row["runner"] = runners["target"]
        if "draft" in runners:  # and a draft LM's or an EAGLE-3 head's
            row["draft_runner"] = runners["draft"]
        put(row, "ar", ar)
        put(row, "sd", sd)
        row["sd_outside_clock_s"] = max(0.0, sd.seconds - s.seconds)  # generator setup, outside the engine clock
        if sd.every_pass_timed:  # where the non-forward time of a speculative run goes
            row["sd_draft_logic_s"] = max(0.0, s.draft_seconds - sd.draft_forward_s)
            # acceptance, cache rollback, drafter.update, detokenization (the rest of the non-forward time)
            row["sd_verify_logic_s"] = max(0.0, sd.overhead_s - row["sd_draft_logic_s"] - row["sd_outside_clock_s"])
        if config.sampling.greedy and not row["identical"]:
            row["mismatch"] = first_mismatch(pair.target, prompt_ids, ar.ids, sd.ids)
        if hf is not None and first:
            put(row, "hf_generate", hf, ar.ids)
            if hf_static is not None:
                put(row, "hf_static", hf_static, ar.ids)
            run_anchors(row, pair, prompt_ids, kwargs, k, timers, config.seed, ar.ids)
        rows.append(row)
        if progress is not None:
            progress.update(1)
    return rows


def run_anchors(row: dict, pair: Pair, prompt_ids: list[int], kwargs: dict, k: int, timers, seed: int,
                reference: list[int]) -> None:
    """transformers' own speculative decoding at the same k: prompt lookup for our lookup, assisted generation with
    the same draft model for ours (none for a drafter generate() cannot use, such as the EAGLE head)."""
    model = pair.target.model
    if pair.drafter_kind == "ngram":
        put(row, "hf_prompt_lookup", measure_hf(model, prompt_ids, {**kwargs, "prompt_lookup_num_tokens": k}, timers,
                                                seed), reference)
    elif (assistant := hf_assistant(pair)) is not None:
        with assistant_k(assistant, k):
            m = measure_hf(model, prompt_ids, {**kwargs, "assistant_model": assistant}, timers, seed)
        put(row, "hf_assisted", m, reference)


def calibrate_k(pair: Pair, prompts: list[list[int]], config: GenerationConfig, k_max: int = MAX_K) -> tuple[int, dict]:
    """--k auto: a short sweep on a few prompts, then metrics.best_k with measured verify costs."""
    short = replace(config, max_new_tokens=min(config.max_new_tokens, 48))
    result = sweep(pair, prompts[:3], CALIBRATION_KS, short, k_max=k_max, do_warmup=False)
    return result.best_k, result.as_dict()


def warm(pair: Pair, prompt_ids: list[int], config: GenerationConfig, ks: list[int], anchors: bool) -> None:
    """Untimed runs of every code path before the clock starts."""
    for k in sorted(set(ks)):
        warmup(pair, [prompt_ids], replace(config, num_draft_tokens=k))
    if anchors:
        model, tok = pair.target.model, pair.target.tokenizer
        kwargs = hf_kwargs(config.sampling, 4, sorted(eos_ids(model, tok)))
        hf_generate(model, prompt_ids, kwargs)
        if pair.drafter_kind == "ngram":
            hf_generate(model, prompt_ids, {**kwargs, "prompt_lookup_num_tokens": ks[0]})
        elif (assistant := hf_assistant(pair)) is not None:
            with assistant_k(assistant, ks[0]):
                hf_generate(model, prompt_ids, {**kwargs, "assistant_model": assistant})


def check_vllm(bc: BenchConfig) -> None:
    """Before any model loads: vLLM's venv exists, the comparison is greedy, an EAGLE-3 folder is one."""
    require_python(bc.vllm_options.python)
    if bc.temperature > 0:
        raise ValueError("--anchors vllm compares greedy outputs token for token; use --temperature 0")
    if bc.vllm_options.eagle3 and not eagle3_export(bc.vllm_options.eagle3):
        raise ValueError(f"--vllm-eagle3 {bc.vllm_options.eagle3} is not an EAGLE-3 checkpoint folder (make one with "
                         f"`python -m specdemo export`)")


def vllm_anchor(bc: BenchConfig, pair: Pair, items: list[PromptItem], prompt_ids: list[list[int]], ks: list[int],
                config: GenerationConfig, rows: list[dict], runs: dict) -> dict:
    """vLLM on the same prompt ids, k, max_new_tokens and EOS ids; its fields go into the rows (see bench.vllm)."""
    if any(len(runs[k]) != len(items) for k in ks):
        raise ValueError("--anchors vllm needs each k once in --k")
    ours = {(it.id, k): runs[k][i] for k in ks for i, it in enumerate(items)}  # (AR run, SD run), in prompt order
    by_id = dict(zip((it.id for it in items), prompt_ids))
    reference = {it.id: runs[ks[0]][i][0].ids for i, it in enumerate(items)}
    eagle3 = bc.vllm_options.eagle3 or (bc.draft if eagle3_export(bc.draft) else None)
    draft_model = None  # a draft LLM (not an EAGLE head) for vLLM's draft_model method
    if hf_assistant(pair) is not None and pair.draft_name:
        draft_model = serve_target(pair.draft_name, bc.runtime)[0]  # the bundled draft: its converted folder
    suffix = None  # vLLM's suffix beside ours; cold: it keeps no earlier answers (ours starts each prompt empty)
    if get(bc.drafter_kind).vllm_method == "suffix":
        suffix = options_of(bc.drafter_kind, bc.drafter_options)
        suffix = replace(suffix, max_cached_requests=0) if bc.suffix_cold else suffix
    options = replace(bc.vllm_options, eagle3=eagle3, draft_model=draft_model, suffix=suffix)

    def mismatch(pid: str, ids: list[int]) -> dict | None:
        return first_mismatch(pair.target, by_id[pid], reference[pid], ids)

    return run_vllm(first_setting(rows, config), pair.target, list(by_id.items()),
                    sorted(eos_ids(pair.target.model, pair.target.tokenizer)), config.max_new_tokens, ks,
                    Lookup.of(pair.drafter), ours, options, Path(bc.out), os.environ, bc.runtime, bc.seed, mismatch,
                    checks.trees(bc.tree_setting))


def first_setting(rows: list[dict], config: GenerationConfig) -> list[dict]:
    """The rows of the first verification rule and tree setting (config's): the runs `runs[k]` keeps, so the ones
    vLLM's figures go beside (with --verification or --tree lists, the other settings' rows get none)."""
    return [r for r in rows if (r["verification"], r["tree"]) == (config.sampling.rule, config.tree)]


def tree_report(config: GenerationConfig, drafter, rows: list[dict], source: str) -> dict:
    """What one --tree setting drafted over the rows (metrics.tree_summary), and under auto the step costs it sized
    trees by at the end (the load-time pass costs corrected by the steps its runs timed, engine.timing.StepCosts)."""
    plan = tree_plan(config, drafter)
    mine = [r for r in rows if r["tree"] == config.tree]
    return {"setting": config.tree, "source": source,
            **tree_summary(plan, sum(r["tree_steps"] for r in mine), sum(r["steps"] for r in mine),
                           sizing_costs(plan, drafter, config), config.num_draft_tokens)}


def run_bench(bc: BenchConfig) -> dict:
    """Load once, warm up, run every prompt, return the report (also written to bc.out)."""
    from tqdm.auto import tqdm

    items = read_prompts(bc.prompts, bc.limit)
    if not items:
        raise ValueError(f"no prompts in {bc.prompts}")
    for item in items:  # each fits the target's context, by the tokenizer alone, before any weights load
        checks.prompt_tokens(bc.target, item.prompt, bc.max_new_tokens, bc.runtime, bc.chat_template,
                             where=f"{bc.prompts}:{item.line}")
    ks = checks.ks(bc.k) if bc.k else None  # checked before anything loads
    rules = checks.verifications(bc.verification, bc.temperature)
    trees = checks.trees(bc.tree_setting)
    kind = bc.drafter_kind
    checks.pair(bc.target, kind, bc.draft)
    config = GenerationConfig(max_new_tokens=bc.max_new_tokens, sampling=SamplingConfig(bc.temperature,
                              verification=rules[0]), seed=bc.seed, use_chat_template=bc.chat_template,
                              tree=trees[0])
    config.validate()
    if bc.vllm:
        check_vllm(bc)
    shared = SharedState()  # one per process: the prompts run in order, as a server's requests would
    pair = load_pair(bc.target, kind, bc.draft, bc.device, bc.dtype, bc.draft_device, runtime=bc.runtime,
                     placement=bc.placement, drafter_options=bc.drafter_options, shared=shared)
    tok = pair.target.tokenizer
    prompt_ids = [encode_prompt(tok, it.prompt, config.use_chat_template) for it in items]
    calibration, k_source = None, "--k"
    if ks is None:  # after loading: a hub head is in the local cache now, with its recorded k
        k, k_source = bc.starting_k()
        ks = [k]
    if ks == "auto":
        warm(pair, prompt_ids[0], config, list(CALIBRATION_KS), False)
        best, calibration = calibrate_k(pair, prompt_ids, config)
        ks = [best]
        log.info("calibrated k = %d", best)
    warm(pair, prompt_ids[0], config, ks, bc.anchors)
    for rule in rules[1:]:
        warm(pair, prompt_ids[0], config.with_verification(rule), ks, False)
    for tree in trees[1:]:
        warm(pair, prompt_ids[0], replace(config, tree=tree), ks, False)

    device = pair.target.device
    draft_mods = list({id(m): m for m in drafter_modules(pair.drafter)}.values())  # an assistant is one of these
    timers = (ForwardTimer(target_modules(pair.target.model), device),
              ForwardTimer(draft_mods, device) if draft_mods else None)
    machine = machine_info(device, pair.target.dtype, pair.target.native)
    rows: list[dict] = []
    runs: dict[int, list] = {}
    # each prompt's rows as they come, so that a run stopped early (a time limit) still leaves what it measured
    partial = Path(bc.out) / PARTIAL_ROWS
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_text("")
    try:
        with tqdm(total=len(items) * len(ks) * len(rules) * len(trees), desc="bench", file=sys.stderr,
                  disable=bc.quiet) as bar:
            for item, ids in zip(items, prompt_ids):
                done = bench_prompt(pair, item, ids, ks, config, timers, bc.anchors, runs, bar, tuple(rules),
                                    bc.suffix_cold, tuple(trees))
                with partial.open("a", encoding="utf-8") as f:
                    f.writelines(json.dumps(row, default=str) + "\n" for row in done)
                rows += done
    finally:
        for t in timers:
            if t:
                t.remove()
    if hasattr(os, "getloadavg"):
        machine["load_average_end"] = list(os.getloadavg())

    theory = None
    if bc.theory:
        # the sweep module's view of the same runs: per-k alpha, c, verify cost, and the expected-speedup curve
        k_max = max([MAX_K] + ks)
        points = [point(k, [a for a, _ in runs[k]], [s for _, s in runs[k]], trees[0]) for k in ks]
        theory = summarize(points, verify_costs_for(pair.target.model, prompt_ids[:1], k_max), k_max).as_dict()
    vllm_meta = None
    if bc.vllm:  # after all our timing: vLLM's processes never share the CPU with our decoders
        vllm_meta = vllm_anchor(bc, pair, items, prompt_ids, ks, config, rows, runs)
    cfg = {
        "prompts": str(bc.prompts), "limit": bc.limit, "num_prompts": len(items), "target": pair.target.name,
        "drafter": kind, "draft": pair.draft_name, "k": ks, "k_arg": bc.k, "k_source": k_source,
        "temperature": bc.temperature,
        "verification": rules,
        "max_new_tokens": bc.max_new_tokens, "seed": bc.seed, "anchors": bc.anchors,
        "chat_template": config.use_chat_template, "placement": pair_placement(pair),
        "speedup": "total autoregressive seconds / total speculative seconds, wall clock around each run",
        "mean_accepted": "tokens per verify pass, bonus/correction included",
        "overhead": "wall seconds outside every target/draft forward call, per target forward call",
    }
    cache = "emptied before each prompt" if bc.suffix_cold else "one per process, carried across the prompts in order"
    for section, values in pair.drafter.settings().items():  # the options it drafted under, as generate records them
        cfg[section] = {**values, **({"cache": cache} if shared.names() else {})}  # and what it kept across prompts
    source = "--tree" if bc.tree else "the drafter's measured default"
    plans = {t: tree_report(replace(config, tree=t, num_draft_tokens=ks[0]), pair.drafter, rows, source)
             for t in trees}
    cfg["tree"] = plans[trees[0]]
    if len(trees) > 1:  # `bench --tree off,auto,16`: what each setting drafted (the report's by_tree has its figures)
        cfg["trees"] = plans
    if calibration:
        cfg["calibration"] = calibration
    if vllm_meta:
        cfg["vllm"] = vllm_meta
    if pair.calibration is not None:  # what the hybrid model's cap was chosen from (hybrid.calibrate)
        cfg.update(pair.calibration.as_dict())
    report = build_report(cfg, machine, rows, theory)
    write_outputs(report, Path(bc.out))
    partial.unlink(missing_ok=True)  # bench.json holds every row
    return report
