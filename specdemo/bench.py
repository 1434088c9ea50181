"""`python -m specdemo bench`: our autoregressive and speculative decoders on a prompt set, against transformers.

For each prompt: autoregressive, then speculative at each k (greedy unless told otherwise), one after the other;
with --anchors also transformers' generate (plain, assisted, prompt lookup) at the same k on the same input ids.
Writes bench.json, bench.md and bench.html. Forward passes are timed by hooks, so the per-step cost outside the
model (drafting logic, acceptance, rollback, detokenization) is reported too.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .config import BUNDLED_ID, MAX_K, MAX_K_ENGINE, GenerationConfig, SamplingConfig
from .prompts import DEFAULT_PROMPTS, PromptItem, read_prompts

log = logging.getLogger(__name__)

CALIBRATION_KS = (1, 2, 3, 4, 6, 8)
ASSISTANT_FIELDS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
HONEST_BASELINE = 0.95  # our AR loop's speed over generate's below which a report's speedups are not figures


# --- timing of forward passes -------------------------------------------------------------------------------------


class ForwardTimer:
    """Seconds spent inside a model's outermost forward calls, and how many calls; hooks on the given modules.

    Nested calls (CausalLM -> base model -> lm_head) count once, so hooking every entry point is safe.
    """

    def __init__(self, modules: Sequence[torch.nn.Module], device: torch.device | str | None = None):
        self.cuda = device is not None and torch.device(device).type == "cuda"
        self.seconds = 0.0
        self.calls = 0
        self._depth = 0
        self._t0 = 0.0
        self._handles = []
        for m in modules:
            self._handles.append(m.register_forward_pre_hook(self._enter))
            self._handles.append(m.register_forward_hook(self._exit))

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _enter(self, module, args) -> None:
        if self._depth == 0:
            self._t0 = self._now()
        self._depth += 1

    def _exit(self, module, args, output) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.seconds += self._now() - self._t0
            self.calls += 1

    def read(self) -> tuple[float, int]:
        return self.seconds, self.calls

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def target_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Entry points the engine and generate() call: the CausalLM, its base model and its head."""
    mods = [model]
    for name in ("model", "lm_head"):
        sub = getattr(model, name, None)
        if isinstance(sub, torch.nn.Module):
            mods.append(sub)
    return mods


def drafter_modules(drafter) -> list[torch.nn.Module]:
    """The nn.Modules a drafter holds (a draft model, an EAGLE head); none for prompt lookup."""
    return [v for v in vars(drafter).values() if isinstance(v, torch.nn.Module)]


@dataclass
class Measured:
    """One timed call: new tokens, wall seconds, and target / draft forward seconds and calls inside it."""

    ids: list[int]
    seconds: float
    target_forward_s: float = 0.0
    target_calls: int = 0
    draft_forward_s: float = 0.0
    draft_calls: int = 0
    run: object | None = None  # our decoders: the sweep.Run (events and wall seconds)

    @property
    def tokens(self) -> int:
        return len(self.ids)

    @property
    def overhead_s(self) -> float:
        """Wall time outside every model forward."""
        return max(0.0, self.seconds - self.target_forward_s - self.draft_forward_s)


@contextmanager
def measuring(timers: tuple[ForwardTimer, ForwardTimer | None], out: dict) -> Iterator[None]:
    """Fill out[...] with the forward seconds and calls that happen inside the block."""
    t, d = timers
    t0, d0 = t.read(), d.read() if d else (0.0, 0)
    yield
    t1, d1 = t.read(), d.read() if d else (0.0, 0)
    out.update(target_forward_s=t1[0] - t0[0], target_calls=t1[1] - t0[1],
               draft_forward_s=d1[0] - d0[0], draft_calls=d1[1] - d0[1])


# --- transformers anchors -----------------------------------------------------------------------------------------


@contextmanager
def assistant_k(assistant: torch.nn.Module, k: int) -> Iterator[object]:
    """Make transformers' assisted generation draft exactly k tokens per step, then restore the config.

    In transformers 5.x, AssistedCandidateGenerator reads num_assistant_tokens, its schedule and the confidence
    threshold from assistant_model.generation_config (generate()'s kwargs for them are not used); the defaults are
    20 tokens with an early stop below confidence 0.4, which is not the k we compare with.
    """
    gc = assistant.generation_config
    old = {name: getattr(gc, name, None) for name in ASSISTANT_FIELDS}
    gc.num_assistant_tokens = k
    gc.num_assistant_tokens_schedule = "constant"
    gc.assistant_confidence_threshold = 0.0  # falsy: no ConfidenceCriteria, no ROC threshold tuning
    try:
        yield gc
    finally:
        for name, value in old.items():
            setattr(gc, name, value)


def hf_kwargs(sampling: SamplingConfig, max_new_tokens: int, eos: Sequence[int]) -> dict:
    """generate() settings matching our decoders: same length bound, EOS ids and sampling."""
    out = dict(max_new_tokens=max_new_tokens, eos_token_id=list(eos), pad_token_id=next(iter(eos), None))
    if sampling.greedy:
        out.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    else:
        out.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or None,
                   top_p=sampling.top_p)
    return out


def hf_generate(model, prompt_ids: list[int], kwargs: dict, seed: int = 0) -> tuple[list[int], float]:
    """transformers' generate on the same ids; (new token ids, wall seconds with the engine's clock)."""
    from .sweep import sync

    device = next(model.parameters()).device
    x = torch.tensor([prompt_ids], device=device)
    torch.manual_seed(seed)
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), **kwargs)
    sync(device)
    return out[0, len(prompt_ids):].tolist(), time.perf_counter() - t0


# --- the benchmark --------------------------------------------------------------------------------------------------


def parse_ks(text: str) -> list[int] | str:
    """'4' -> [4]; '1,2,4,8' -> [1, 2, 4, 8]; 'auto' -> 'auto'."""
    if text.strip().lower() == "auto":
        return "auto"
    ks = [int(x) for x in text.replace(" ", "").split(",") if x]
    if not ks or any(not 1 <= k <= MAX_K_ENGINE for k in ks):
        raise ValueError(f"--k must be 'auto' or integers in 1..{MAX_K_ENGINE}, got '{text}'")
    return ks


def machine_info(device: torch.device, dtype: torch.dtype) -> dict:
    """CPU model, cores, threads, library versions, device and dtype."""
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
    if hasattr(os, "getloadavg"):
        info["load_average_start"] = list(os.getloadavg())
    return info


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 0.0


def aggregate(rows: list[dict]) -> dict:
    """Pooled figures over result rows: speedup = total AR seconds / total SD seconds; acceptance over all drafts."""
    ar_s = sum(r["ar_seconds"] for r in rows)
    sd_s = sum(r["sd_seconds"] for r in rows)
    steps = sum(r["steps"] for r in rows)
    drafted = sum(r["drafted"] for r in rows)
    out = {
        "speedup": _ratio(ar_s, sd_s),
        "mean_accepted": _ratio(sum(r["spec_tokens"] for r in rows), steps),
        "acceptance_rate": _ratio(sum(r["accepted"] for r in rows), drafted),
        "identical_fraction": _ratio(sum(bool(r["identical"]) for r in rows), len(rows)),
        "ar_seconds": ar_s, "sd_seconds": sd_s,
        "ar_tokens_per_s": _ratio(sum(r["ar_tokens"] for r in rows), ar_s),
        "sd_tokens_per_s": _ratio(sum(r["sd_tokens"] for r in rows), sd_s),
        "prompts": len(rows),
    }
    for name in ("hf_generate", "hf_assisted", "hf_prompt_lookup"):
        have = [r for r in rows if f"{name}_seconds" in r]
        if have and name != "hf_generate":
            base = sum(r["hf_generate_seconds"] for r in have)
            out[f"{name}_speedup"] = _ratio(base, sum(r[f"{name}_seconds"] for r in have))
            out[f"{name}_tokens_per_s"] = _ratio(sum(r[f"{name}_tokens"] for r in have),
                                                 sum(r[f"{name}_seconds"] for r in have))
    return out


def anchors_summary(rows: list[dict]) -> dict:
    """The transformers comparisons, pooled over rows that have them."""
    have = [r for r in rows if "hf_generate_seconds" in r]
    if not have:
        return {}
    hf_s = sum(r["hf_generate_seconds"] for r in have)
    hf_tok = sum(r["hf_generate_tokens"] for r in have)
    ar_tps = _ratio(sum(r["ar_tokens"] for r in have), sum(r["ar_seconds"] for r in have))
    out = {
        "hf_generate_tokens_per_s": _ratio(hf_tok, hf_s),
        "ar_tokens_per_s": ar_tps,
        "ar_vs_hf_generate": _ratio(ar_tps, _ratio(hf_tok, hf_s)),
        "hf_generate_identical_fraction": _ratio(sum(bool(r["hf_generate_identical"]) for r in have), len(have)),
        "hf_assisted_speedup": None,
        "hf_prompt_lookup_speedup": None,
    }
    for name in ("hf_assisted", "hf_prompt_lookup"):
        sub = [r for r in have if f"{name}_seconds" in r]
        if sub:
            base = sum(r["hf_generate_seconds"] for r in sub)
            out[f"{name}_speedup"] = _ratio(base, sum(r[f"{name}_seconds"] for r in sub))
            out[f"{name}_tokens_per_s"] = _ratio(sum(r[f"{name}_tokens"] for r in sub),
                                                 sum(r[f"{name}_seconds"] for r in sub))
            out[f"{name}_identical_fraction"] = _ratio(sum(bool(r[f"{name}_identical"]) for r in sub), len(sub))
            ours = aggregate(sub)
            out[f"ours_vs_{name}_tokens_per_s"] = _ratio(ours["sd_tokens_per_s"], out[f"{name}_tokens_per_s"])
    return out


def overhead_summary(rows: list[dict]) -> dict:
    """Milliseconds per target pass spent outside every model forward, for each decoder measured."""
    out = {}
    for name in ("ar", "sd", "hf_generate", "hf_assisted", "hf_prompt_lookup"):
        have = [r for r in rows if f"{name}_overhead_s" in r]
        calls = sum(r[f"{name}_target_calls"] for r in have)
        if have and calls:
            out[f"{name}_ms_per_step"] = 1000 * sum(r[f"{name}_overhead_s"] for r in have) / calls
            out[f"{name}_forward_fraction"] = _ratio(
                sum(r[f"{name}_target_forward_s"] + r.get(f"{name}_draft_forward_s", 0.0) for r in have),
                sum(r[f"{name}_seconds"] for r in have))
    sd = [r for r in rows if "sd_draft_logic_s" in r]
    steps = sum(r["sd_target_calls"] for r in sd)
    if steps:
        out["sd_draft_logic_ms_per_step"] = 1000 * sum(r["sd_draft_logic_s"] for r in sd) / steps
        out["sd_verify_logic_ms_per_step"] = 1000 * sum(r["sd_verify_logic_s"] for r in sd) / steps
        out["sd_outside_engine_clock_ms_per_step"] = 1000 * sum(r["sd_outside_clock_s"] for r in sd) / steps
    return out


def build_report(config: dict, machine: dict, rows: list[dict], theory: dict | None = None) -> dict:
    """The bench.json object from result rows."""
    categories = sorted({r["category"] for r in rows}, key=[r["category"] for r in rows].index)
    ks = sorted({r["k"] for r in rows})
    report = {
        "config": config,
        "machine": machine,
        "results": rows,
        "by_category": {c: aggregate([r for r in rows if r["category"] == c]) for c in categories},
        "by_k": {str(k): aggregate([r for r in rows if r["k"] == k]) for k in ks},
        "overall": aggregate(rows),
        "anchors": anchors_summary(rows),
        "overhead": overhead_summary(rows),
    }
    if report["anchors"]:
        report["anchors"]["by_category"] = {c: anchors_summary([r for r in rows if r["category"] == c])
                                            for c in categories}
        report["anchors"]["by_k"] = {str(k): anchors_summary([r for r in rows if r["k"] == k]) for k in ks}
    if theory:
        report["theory"] = theory
    mism = [r["mismatch"] for r in rows if r.get("mismatch")]
    if mism:
        report["mismatch_top2_logit_gaps"] = [m["top2_logit_gap"] for m in mism]
    return report


def _measure_ours(run_fn, timers) -> Measured:
    stats: dict = {}
    with measuring(timers, stats):
        run = run_fn()
    return Measured(run.ids, run.wall_seconds, run=run, **stats)


def _measure_hf(model, prompt_ids, kwargs, timers, seed) -> Measured:
    stats: dict = {}
    with measuring(timers, stats):
        ids, seconds = hf_generate(model, prompt_ids, kwargs, seed)
    return Measured(ids, seconds, **stats)


def _put(row: dict, name: str, m: Measured, reference: list[int] | None = None) -> None:
    row[f"{name}_seconds"] = m.seconds
    row[f"{name}_tokens"] = m.tokens
    row[f"{name}_tokens_per_s"] = _ratio(m.tokens, m.seconds)
    row[f"{name}_target_forward_s"] = m.target_forward_s
    row[f"{name}_target_calls"] = m.target_calls
    row[f"{name}_draft_forward_s"] = m.draft_forward_s
    row[f"{name}_overhead_s"] = m.overhead_s
    if reference is not None:
        row[f"{name}_identical"] = m.ids == reference


def bench_prompt(pair, item: PromptItem, prompt_ids: list[int], ks: list[int], config: GenerationConfig,
                 timers, anchors: bool, runs: dict, progress=None) -> list[dict]:
    """All runs for one prompt: AR once, SD per k, and the anchors; one result row per k.

    runs[k] gets (ar_run, sd_run) appended, for the sweep module's per-k figures.
    """
    from .compare import first_mismatch
    from .engine import eos_ids
    from .sweep import run_ar, run_sd

    ar = _measure_ours(lambda: run_ar(pair, prompt_ids, config), timers)
    model, tok = pair.target.model, pair.target.tokenizer
    kwargs = hf_kwargs(config.sampling, config.max_new_tokens, sorted(eos_ids(model, tok)))
    hf = _measure_hf(model, prompt_ids, kwargs, timers, config.seed) if anchors else None
    rows = []
    for k in ks:
        k_config = replace(config, num_draft_tokens=k)
        sd = _measure_ours(lambda: run_sd(pair, prompt_ids, k_config), timers)
        runs.setdefault(k, []).append((ar.run, sd.run))
        s, a = sd.run.stats, ar.run.stats
        spec = [e for e in sd.run.events if e.kind == "spec"]
        row = {
            "id": item.id, "category": item.category, "k": k,
            "prompt_tokens": len(prompt_ids),
            "ar_tokens_per_s": _ratio(ar.tokens, ar.seconds), "sd_tokens_per_s": _ratio(sd.tokens, sd.seconds),
            "speedup": _ratio(ar.seconds, sd.seconds),
            "mean_accepted": s.mean_accepted, "acceptance_rate": s.acceptance_rate,
            "identical": ar.ids == sd.ids,
            "steps": s.steps, "drafted": s.drafted, "accepted": s.accepted,
            "spec_tokens": sum(len(e.tokens) for e in spec),
            "accepted_histogram": s.accepted_histogram,
            "draft_seconds": s.draft_seconds, "verify_seconds": s.verify_seconds,
            "ar_engine_seconds": a.seconds, "sd_engine_seconds": s.seconds,
        }
        _put(row, "ar", ar)
        _put(row, "sd", sd)
        # where the non-forward time of a speculative run goes
        row["sd_draft_logic_s"] = max(0.0, s.draft_seconds - sd.draft_forward_s)
        row["sd_outside_clock_s"] = max(0.0, sd.seconds - s.seconds)  # generator setup, outside the engine clock
        # acceptance, cache rollback, drafter.update, detokenization (the rest of the non-forward time)
        row["sd_verify_logic_s"] = max(0.0, sd.overhead_s - row["sd_draft_logic_s"] - row["sd_outside_clock_s"])
        if config.sampling.greedy and not row["identical"]:
            row["mismatch"] = first_mismatch(pair.target, prompt_ids, ar.ids, sd.ids)
        if hf is not None:
            _put(row, "hf_generate", hf, ar.ids)
            if pair.drafter_kind == "ngram":
                m = _measure_hf(model, prompt_ids, {**kwargs, "prompt_lookup_num_tokens": k}, timers, config.seed)
                _put(row, "hf_prompt_lookup", m, ar.ids)
            elif hf_assistant(pair) is not None:
                assistant = hf_assistant(pair)
                with assistant_k(assistant, k):
                    m = _measure_hf(model, prompt_ids, {**kwargs, "assistant_model": assistant}, timers, config.seed)
                _put(row, "hf_assisted", m, ar.ids)
        rows.append(row)
        if progress is not None:
            progress.update(1)
    return rows


def hf_assistant(pair) -> torch.nn.Module | None:
    """The draft as a transformers model generate() can use as assistant_model (None for prompt lookup, EAGLE)."""
    from .drafters import ModelDrafter

    if isinstance(pair.drafter, ModelDrafter) and hasattr(pair.drafter.model, "generate"):
        return pair.drafter.model
    return None


def calibrate_k(pair, prompts: list[list[int]], config: GenerationConfig, k_max: int = MAX_K) -> tuple[int, dict]:
    """--k auto: a short sweep on a few prompts, then metrics.best_k with measured verify costs."""
    from .sweep import sweep

    short = replace(config, max_new_tokens=min(config.max_new_tokens, 48))
    result = sweep(pair, prompts[:3], CALIBRATION_KS, short, k_max=k_max, do_warmup=False)
    return result.best_k, result.as_dict()


def warm(pair, prompt_ids: list[int], config: GenerationConfig, ks: list[int], anchors: bool) -> None:
    """Untimed runs of every code path before the clock starts."""
    from .compare import warmup
    from .engine import eos_ids

    for k in sorted(set(ks)):
        warmup(pair, prompt_ids, replace(config, num_draft_tokens=k))
    if anchors:
        model, tok = pair.target.model, pair.target.tokenizer
        kwargs = hf_kwargs(config.sampling, 4, sorted(eos_ids(model, tok)))
        hf_generate(model, prompt_ids, kwargs)
        if pair.drafter_kind == "ngram":
            hf_generate(model, prompt_ids, {**kwargs, "prompt_lookup_num_tokens": ks[0]})
        elif hf_assistant(pair) is not None:
            with assistant_k(hf_assistant(pair), ks[0]):
                hf_generate(model, prompt_ids, {**kwargs, "assistant_model": hf_assistant(pair)})


def run_bench(args) -> dict:
    """Load once, warm up, run every prompt, return the report (also written to args.out)."""
    from tqdm.auto import tqdm

    from .compare import load_pair
    from .drafters import HybridDrafter
    from .engine import encode_prompt
    from .sweep import point, summarize, verify_costs_for

    path = args.prompts or DEFAULT_PROMPTS
    items = read_prompts(path, args.limit)
    if not items:
        raise ValueError(f"no prompts in {path}")
    ks = parse_ks(args.k)
    kind = args.drafter or ("model" if args.draft else "ngram")
    if kind == "ngram" and args.draft:
        raise ValueError("--draft names a draft model, but --drafter ngram (prompt lookup) uses none")
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=SamplingConfig(args.temperature),
                              seed=args.seed, use_chat_template=not args.no_chat_template)
    config.validate()
    pair = load_pair(args.target, kind, args.draft, args.device, args.dtype)
    tok = pair.target.tokenizer
    prompt_ids = [encode_prompt(tok, it.prompt, config.use_chat_template) for it in items]
    calibration = None
    if ks == "auto":
        warm(pair, prompt_ids[0], config, list(CALIBRATION_KS), False)
        best, calibration = calibrate_k(pair, prompt_ids, config)
        ks = [best]
        log.info("calibrated k = %d", best)
    warm(pair, prompt_ids[0], config, ks, args.anchors)

    device = pair.target.device
    draft_mods = list({id(m): m for m in drafter_modules(pair.drafter)}.values())  # an assistant is one of these
    timers = (ForwardTimer(target_modules(pair.target.model), device),
              ForwardTimer(draft_mods, device) if draft_mods else None)
    machine = machine_info(device, pair.target.dtype)
    rows: list[dict] = []
    runs: dict[int, list] = {}
    try:
        with tqdm(total=len(items) * len(ks), desc="bench", file=sys.stderr, disable=args.quiet) as bar:
            for item, ids in zip(items, prompt_ids):
                rows += bench_prompt(pair, item, ids, ks, config, timers, args.anchors, runs, bar)
    finally:
        for t in timers:
            if t:
                t.remove()
    if hasattr(os, "getloadavg"):
        machine["load_average_end"] = list(os.getloadavg())

    theory = None
    if not args.no_theory:
        # the sweep module's view of the same runs: per-k alpha, c, verify cost, and the expected-speedup curve
        k_max = max([MAX_K] + ks)
        points = [point(k, [a for a, _ in runs[k]], [s for _, s in runs[k]]) for k in ks]
        theory = summarize(points, verify_costs_for(pair.target.model, prompt_ids[0], k_max), k_max).as_dict()
    cfg = {
        "prompts": str(path), "limit": args.limit, "num_prompts": len(items), "target": pair.target.name,
        "drafter": kind, "draft": pair.draft_name, "k": ks, "k_arg": args.k, "temperature": args.temperature,
        "max_new_tokens": args.max_new_tokens, "seed": args.seed, "anchors": args.anchors,
        "chat_template": config.use_chat_template,
        "speedup": "total autoregressive seconds / total speculative seconds, wall clock around each run",
        "mean_accepted": "tokens per verify pass, bonus/correction included",
        "overhead": "wall seconds outside every target/draft forward call, per target forward call",
    }
    if calibration:
        cfg["calibration"] = calibration
    if isinstance(pair.drafter, HybridDrafter):  # what the model's cap was chosen from (compare.hybrid_model_k)
        cfg["hybrid_model_k"] = pair.drafter.model_k
        cfg["hybrid_verify_costs"] = pair.drafter.verify_costs
        cfg["hybrid_draft_cost"] = pair.drafter.draft_cost
    report = build_report(cfg, machine, rows, theory)
    write_outputs(report, Path(args.out))
    return report


# --- outputs --------------------------------------------------------------------------------------------------------


def write_outputs(report: dict, out: Path) -> None:
    """bench.json, bench.md and bench.html in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / "bench.md").write_text(markdown(report), encoding="utf-8")
    try:
        (out / "bench.html").write_text(html(report), encoding="utf-8")
    except ImportError:
        log.warning("plotly is not installed; skipped bench.html")


def _f(x, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_f(x) for x in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _hybrid_line(c: dict) -> str:
    from .compare import describe_hybrid_cap

    if "hybrid_model_k" not in c:
        return ""
    cap = describe_hybrid_cap(c["hybrid_model_k"], c.get("hybrid_verify_costs") or {}, c.get("hybrid_draft_cost"))
    return f"; hybrid: {cap}"


def baseline_warning(anchors: dict) -> str:
    """A loud line when our autoregressive loop ran slower than transformers' generate on the same inputs."""
    ratio = (anchors or {}).get("ar_vs_hf_generate")
    if ratio is None or ratio >= HONEST_BASELINE:
        return ""
    return (f"**Baseline check failed:** our autoregressive loop ran at {ratio:.2f}× the speed of transformers' "
            f"`generate` on the same inputs (at least {HONEST_BASELINE} is required), so this report's speedups are "
            f"measured against a slow baseline and are not figures to report.\n")


def markdown(report: dict) -> str:
    """Markdown tables: overall, by category, by k, overhead, the transformers anchors, per prompt."""
    cfg, mach, o = report["config"], report["machine"], report["overall"]
    anchors = report.get("anchors") or {}
    warning = baseline_warning(anchors)
    c = {"target": "?", "drafter": "?", "draft": None, "k": "?", "temperature": "?", "max_new_tokens": "?",
         "num_prompts": len(report["results"]), "prompts": "?", **cfg}
    m = {"cpu": "?", "cores": "?", "torch_threads": "?", "device": "?", "dtype": "?", "torch": "?",
         "transformers": "?", **mach}
    parts = [
        f"# Speculative decoding benchmark\n\n"
        f"target `{c['target']}`, drafter `{c['drafter']}`{' (' + str(c['draft']) + ')' if c['draft'] else ''}, "
        f"k = {c['k']}, temperature {c['temperature']}, {c['max_new_tokens']} new tokens, "
        f"{c['num_prompts']} prompts from `{Path(str(c['prompts'])).name}`"
        f"{_hybrid_line(c)}\n\n"
        f"machine: {m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch threads), "
        f"{m['device']} {m['dtype']}, torch {m['torch']}, transformers {m['transformers']}; "
        f"load average {_f((m.get('load_average_start') or [None])[0])} at start, "
        f"{_f((m.get('load_average_end') or [None])[0])} at end\n\n"
        f"Speedup = total autoregressive seconds / total speculative seconds (wall clock, perf_counter); "
        f"mean accepted = tokens per verify pass, bonus included.\n",
        *([warning] if warning else []),
        "## Overall\n\n" + _table(
            ["speedup", "AR tok/s", "SD tok/s", "mean accepted", "acceptance", "identical"],
            [[o["speedup"], o["ar_tokens_per_s"], o["sd_tokens_per_s"], o["mean_accepted"], o["acceptance_rate"],
              o["identical_fraction"]]]),
    ]
    anchor_cols = [n for n in ("hf_prompt_lookup", "hf_assisted") if anchors.get(f"{n}_speedup") is not None]
    cat_rows = []
    for c, a in report["by_category"].items():
        cat_rows.append([c, a["prompts"], a["speedup"], *[a.get(f"{n}_speedup") for n in anchor_cols],
                         a["mean_accepted"], a["acceptance_rate"], a["identical_fraction"]])
    parts.append("## By category\n\n" + _table(
        ["category", "rows", "speedup (ours)", *[f"speedup ({n})" for n in anchor_cols], "mean accepted",
         "acceptance", "identical"], cat_rows))
    theory = report.get("theory")
    by_point = {p["k"]: p for p in theory["points"]} if theory else {}
    k_rows = []
    for k, a in report["by_k"].items():
        p = by_point.get(int(k), {})
        k_rows.append([k, a["speedup"], *[a.get(f"{n}_speedup") for n in anchor_cols], a["mean_accepted"],
                       a["acceptance_rate"], p.get("alpha"), p.get("c"), p.get("verify_cost"),
                       p.get("expected_speedup")])
    parts.append("## By k\n\n" + _table(
        ["k", "speedup (ours)", *[f"speedup ({n})" for n in anchor_cols], "mean accepted", "acceptance", "alpha",
         "c", "verify cost", "theory speedup"], k_rows))
    if theory:
        parts.append(
            f"Theory (Leviathan et al.): pooled alpha {theory['alpha']:.3f}, c {theory['c']:.3f}; best k "
            f"{theory['best_k']} (measured best {theory['best_measured_k']}). Verify cost = seconds per verify step "
            f"over seconds per autoregressive step, as measured in the runs; the curve uses a forward-pass "
            f"micro-benchmark: " + ", ".join(f"k={k}: {v:.2f}" for k, v in list(theory["verify_costs"].items())[:8])
            + ".\n")
    if anchors:
        rows = [["our AR tok/s / HF generate tok/s", anchors["ar_vs_hf_generate"]],
                ["HF generate tok/s", anchors["hf_generate_tokens_per_s"]],
                ["our AR tok/s", anchors["ar_tokens_per_s"]],
                ["HF generate tokens identical to ours", anchors["hf_generate_identical_fraction"]]]
        for n in anchor_cols:
            rows += [[f"{n} speedup (over HF generate)", anchors[f"{n}_speedup"]],
                     [f"{n} tok/s", anchors[f"{n}_tokens_per_s"]],
                     [f"our SD tok/s / {n} tok/s", anchors[f"ours_vs_{n}_tokens_per_s"]],
                     [f"{n} tokens identical to our AR", anchors[f"{n}_identical_fraction"]]]
        parts.append("## transformers anchors (same ids, k, max_new_tokens, clock)\n\n" + _table(["", "value"], rows))
    ov = report.get("overhead") or {}
    if ov:
        parts.append("## Per-step time outside model forwards\n\n" + _table(
            ["measure", "ms per target pass"], [[k.replace("_ms_per_step", ""), v] for k, v in ov.items()
                                                if k.endswith("_ms_per_step")])
            + "\nForward fraction (time inside forwards / wall): " + ", ".join(
                f"{k.replace('_forward_fraction', '')} {v:.3f}" for k, v in ov.items() if k.endswith("_forward_fraction"))
            + "\n")
    prompt_rows = [[r["id"], r["category"], r["k"], r["ar_tokens_per_s"], r["sd_tokens_per_s"], r["speedup"],
                    r.get("hf_prompt_lookup_tokens_per_s", r.get("hf_assisted_tokens_per_s")),
                    r["mean_accepted"], r["acceptance_rate"], r["identical"]] for r in report["results"]]
    parts.append("## Per prompt\n\n" + _table(
        ["id", "category", "k", "AR tok/s", "SD tok/s", "speedup", "HF assisted/PLD tok/s", "mean accepted",
         "acceptance", "identical"], prompt_rows))
    gaps = report.get("mismatch_top2_logit_gaps")
    if gaps:
        parts.append(f"Greedy mismatches: {len(gaps)}; target top-2 logit gaps at the first difference: "
                     + ", ".join(f"{g:.4f}" for g in gaps) + "\n")
    return "\n".join(parts)


def html(report: dict) -> str:
    """Plotly figures: speedup by category; speedup and acceptance against k beside the theoretical curve."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    anchors = report.get("anchors") or {}
    cats = list(report["by_category"])
    fig1 = go.Figure(go.Bar(name="ours", x=cats, y=[report["by_category"][c]["speedup"] for c in cats]))
    for n in ("hf_prompt_lookup", "hf_assisted"):
        if anchors.get(f"{n}_speedup") is not None:
            fig1.add_bar(name=n, x=cats, y=[report["by_category"][c].get(f"{n}_speedup") for c in cats])
    fig1.add_hline(y=1.0, line_dash="dot")
    fig1.update_layout(title="Speedup by category (total AR time / total SD time)", barmode="group",
                       yaxis_title="speedup")

    fig2 = make_subplots(rows=1, cols=2, subplot_titles=("speedup vs k", "acceptance vs k"))
    ks = [int(k) for k in report["by_k"]]
    by_k = list(report["by_k"].values())
    fig2.add_scatter(x=ks, y=[a["speedup"] for a in by_k], mode="markers+lines", name="measured", row=1, col=1)
    theory = report.get("theory")
    if theory:
        tk = [int(k) for k in theory["theory"]]
        fig2.add_scatter(x=tk, y=list(theory["theory"].values()), mode="lines", line_dash="dash",
                         name=f"theory (alpha {theory['alpha']:.2f}, c {theory['c']:.2f})", row=1, col=1)
    fig2.add_scatter(x=ks, y=[a["acceptance_rate"] for a in by_k], mode="markers+lines", name="acceptance rate",
                     row=1, col=2)
    fig2.add_scatter(x=ks, y=[a["mean_accepted"] for a in by_k], mode="markers+lines",
                     name="mean accepted (tokens/pass)", row=1, col=2)
    fig2.update_xaxes(title_text="k (draft tokens per step)")
    body = fig1.to_html(full_html=False, include_plotlyjs=True) + fig2.to_html(full_html=False, include_plotlyjs=False)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>specdemo bench</title></head><body>"
            f"<h1>Speculative decoding benchmark</h1><pre>{json.dumps(report['overall'], indent=1)}</pre>{body}"
            f"</body></html>\n")


# --- command line ---------------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m specdemo bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", default=None, help=f"JSONL prompt file (default {DEFAULT_PROMPTS})")
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    p.add_argument("--target", default=BUNDLED_ID)
    p.add_argument("--draft", help="draft model id or folder (implies --drafter model unless hybrid is asked for)")
    p.add_argument("--drafter", choices=["ngram", "model", "hybrid"], default=None,
                   help="'ngram' is prompt lookup (the default without --draft); 'model' uses --draft or the shipped "
                        "trained draft; 'hybrid' is that draft with prompt lookup where the context repeats")
    p.add_argument("--k", default="4", help="draft tokens per step: N, a list like 1,2,4,8, or 'auto'")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--anchors", action="store_true", help="also time transformers' generate on the same inputs")
    p.add_argument("--out", default="bench/latest", help="output folder for bench.json, bench.md, bench.html")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-chat-template", action="store_true")
    p.add_argument("--no-theory", action="store_true", help="skip the verify-cost micro-benchmark and theory curve")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.prompts is None and not DEFAULT_PROMPTS.exists():
        print(f"error: no --prompts given and {DEFAULT_PROMPTS} does not exist", file=sys.stderr)
        return 2
    from .engine import GenerationError
    from .loading import ModelLoadError, TokenizerMismatchError

    try:
        report = run_bench(args)
    except (ModelLoadError, TokenizerMismatchError, GenerationError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    o, a, ov = report["overall"], report.get("anchors") or {}, report.get("overhead") or {}
    line = (f"speedup {o['speedup']:.2f}x  mean accepted {o['mean_accepted']:.2f}  acceptance {o['acceptance_rate']:.2f}"
            f"  identical {o['identical_fraction']:.2f}")
    if a:
        line += f"  | AR/HF generate {a['ar_vs_hf_generate']:.3f}"
        for n in ("hf_prompt_lookup", "hf_assisted"):
            if a.get(f"{n}_speedup") is not None:
                line += f"  {n} speedup {a[f'{n}_speedup']:.2f}x"
    if "sd_ms_per_step" in ov:
        line += f"  | overhead AR {ov['ar_ms_per_step']:.2f} ms/step, SD {ov['sd_ms_per_step']:.2f} ms/step"
    print(line)
    warning = baseline_warning(a)
    if warning:
        print(warning.replace("**", ""), file=sys.stderr, end="")
    print(f"wrote {Path(args.out) / 'bench.json'}, bench.md, bench.html")
    return 0
