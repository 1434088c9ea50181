"""Runs inside vLLM's own venv (never the app's): each method's engine in a fresh process, prompts one at a time.

Imports only vllm and the standard library, and is run as a script, so the specdemo package is never imported here.
It sits alone in its folder because a script's folder heads sys.path in it and in vLLM's spawned processes: beside
specdemo/measure/bench/vllm.py, `import vllm` would find that file instead of vLLM.
Protocol (PROTOCOL): `python vllm_driver.py REQUEST.json RESULT.json`. The request names the converted model folder,
the prompts as token ids, the EOS ids, max_tokens and a list of methods ({"name", "speculative_config"}); the result
holds per method each prompt's new token ids, its wall seconds around llm.generate and the deltas of vLLM's
spec-decode counters over it (the prometheus counters llm.get_metrics() reads), and under `trees` whether this vLLM
can verify draft trees at all (tree_support).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

PROTOCOL = 1
SPEC_COUNTERS = {  # prometheus counter -> result key; the V1 scheduler's SpecDecodingStats, summed over engines
    "vllm:spec_decode_num_drafts": "num_drafts",  # verify steps that carried at least one draft token
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
WARMUP_TOKENS = 8
KV_CACHE_BYTES = 1 << 30  # explicit, so vLLM's CPU backend does not reserve 92% of the machine's memory at start


def read_counters(metrics) -> dict:
    """The spec-decode counters from llm.get_metrics(): totals, and accepted tokens per draft position."""
    out = {key: 0 for key in SPEC_COUNTERS.values()}
    per_pos: list[int] = []
    for m in metrics:
        if m.name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[m.name]] += int(m.value)
        elif m.name == PER_POS:
            values = list(m.values)
            per_pos = [a + b for a, b in zip(per_pos + [0] * len(values), values + [0] * len(per_pos))]
    out["accepted_per_pos"] = per_pos
    return out


def counter_delta(before: dict, after: dict) -> dict:
    """after - before, field by field (the per-position list element-wise)."""
    out = {k: after[k] - before.get(k, 0) for k in SPEC_COUNTERS.values()}
    b = before.get("accepted_per_pos") or []
    out["accepted_per_pos"] = [a - (b[i] if i < len(b) else 0) for i, a in enumerate(after["accepted_per_pos"])]
    return out


def _install_forward_timer(model) -> None:
    """In the worker: time the model's forward and compute_logits (the lm_head), the rest of a step is overhead."""
    import torch

    model._specdemo_timer = [0.0, 0]  # seconds, forward calls
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def pre(module, args, kwargs=None):
        sync()
        module._specdemo_t0 = time.perf_counter()

    def post(module, args, out):
        sync()
        module._specdemo_timer[0] += time.perf_counter() - module._specdemo_t0
        module._specdemo_timer[1] += 1

    model.register_forward_pre_hook(pre)
    model.register_forward_hook(post)
    logits = model.compute_logits

    def compute_logits(*args, **kwargs):
        sync()
        t0 = time.perf_counter()
        out = logits(*args, **kwargs)
        sync()
        model._specdemo_timer[0] += time.perf_counter() - t0
        return out

    model.compute_logits = compute_logits


def _read_forward_timer(model) -> list:
    return list(model._specdemo_timer)


def _this_module():
    """This file imported under its own name, so the callables sent to vLLM's workers pickle by reference (they
    import it: spawned processes inherit sys.path, whose first entry is this file's folder)."""
    import importlib

    return importlib.import_module(Path(__file__).stem)


def _forward_timer(llm) -> list | None:
    """(seconds, calls) inside the target model so far, from the first worker; None if it cannot be read."""
    try:
        return llm.apply_model(_this_module()._read_forward_timer)[0]
    except Exception:  # an engine without apply_model support: the figure is left out, the run goes on
        return None


def _request_metrics(spec) -> dict:
    """LLM's argument for per-request spec-decode metrics with the per-step arrays, where this vLLM has it."""
    from vllm.config import ObservabilityConfig

    if not spec or "per_request_spec_decode_metrics" not in getattr(ObservabilityConfig, "__dataclass_fields__", {}):
        return {}
    return {"per_request_spec_decode_metrics": "detailed"}


def run_method(request: dict, method: dict) -> dict:
    """Load one engine with the method's speculative_config, warm it up, then time each prompt at batch 1."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = method.get("speculative_config")
    t0 = time.perf_counter()
    llm = LLM(model=request["model"], tokenizer=request.get("tokenizer") or request["model"],
              dtype=request.get("dtype", "float32"), enforce_eager=request.get("enforce_eager", True),
              max_model_len=request.get("max_model_len", 2048), seed=request.get("seed", 0),
              speculative_config=spec, disable_log_stats=False,
              kv_cache_memory_bytes=request.get("kv_cache_bytes", KV_CACHE_BYTES),
              **_request_metrics(spec), **request.get("engine_kwargs", {}))
    load_seconds = time.perf_counter() - t0
    profile = bool(request.get("profile_forward")) and _install(llm)

    def params(max_tokens: int):
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=False,
                              stop_token_ids=list(request["eos_token_ids"]), seed=request.get("seed", 0))

    prompts = request["prompts"]
    for p in prompts[: request.get("warmup", 1)]:  # untimed: first-call allocations, numba's ngram JIT
        llm.generate(TokensPrompt(prompt_token_ids=p["prompt_token_ids"]), params(WARMUP_TOKENS), use_tqdm=False)
    rows = []
    for p in prompts:
        before, fwd0 = read_counters(llm.get_metrics()), _forward_timer(llm) if profile else None
        start = time.perf_counter()
        out = llm.generate(TokensPrompt(prompt_token_ids=p["prompt_token_ids"]), params(request["max_tokens"]),
                           use_tqdm=False)[0]
        seconds = time.perf_counter() - start
        completion = out.outputs[0]
        row = {"id": p["id"], "token_ids": list(completion.token_ids), "seconds": seconds,
               "finish_reason": completion.finish_reason,
               "counters": counter_delta(before, read_counters(llm.get_metrics()))}
        metrics = getattr(completion, "spec_decode_metrics", None)
        if metrics is not None:
            row["request_metrics"] = metrics.to_dict()
        if profile:
            fwd1 = _forward_timer(llm)
            if fwd0 is not None and fwd1 is not None:
                row["forward_seconds"], row["forward_calls"] = fwd1[0] - fwd0[0], fwd1[1] - fwd0[1]
        rows.append(row)
    return {"name": method["name"], "k": method.get("k"), "speculative_config": spec, "load_seconds": load_seconds,
            "vllm": vllm.__version__, "forward_profiled": profile, "prompts": rows}


def _install(llm) -> bool:
    try:
        llm.apply_model(_this_module()._install_forward_timer)
        return True
    except Exception:  # e.g. callables refused over the engine's RPC: time without the forward split
        traceback.print_exc()
        return False


def environment() -> dict:
    """What the timing depends on: vLLM's CPU thread binding, the python and the machine."""
    keys = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_KVCACHE_SPACE", "OMP_NUM_THREADS",
            "VLLM_ENABLE_V1_MULTIPROCESSING", "CUDA_VISIBLE_DEVICES")
    return {"python": platform.python_version(), "executable": sys.executable, "cores": os.cpu_count(),
            "env": {k: os.environ[k] for k in keys if k in os.environ}}


def tree_support() -> dict:
    """Whether this vLLM can verify draft trees: upstream's form is SpeculativeConfig.speculative_token_tree with its
    tree attention backend (TREE_ATTN). vLLM 0.32.0's CPU build has neither: the config forbids unknown keys, and
    the CPU platform selects CPU_ATTN, which takes causal masks only (docs/vllm.md#draft-trees)."""
    try:
        import vllm
        from vllm.config import SpeculativeConfig
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
    except Exception as exc:  # another vLLM layout: said as unknown, the runs go on
        return {"error": f"{type(exc).__name__}: {exc}"}
    fields = getattr(SpeculativeConfig, "__dataclass_fields__", {})
    return {"vllm": vllm.__version__, "speculative_token_tree": "speculative_token_tree" in fields,
            "tree_attention_backend": "TREE_ATTN" in AttentionBackendEnum.__members__}


def run_one(request_path: str, index: int, result_path: str) -> int:
    """Child process: one method, one engine; its result (or its error) as JSON."""
    request = json.loads(Path(request_path).read_text())
    method = request["methods"][index]
    try:
        result = run_method(request, method)
    except Exception as exc:  # reported per method, so one failing method (say eagle3) leaves the others' figures
        traceback.print_exc()
        result = {"name": method["name"], "k": method.get("k"),
                  "speculative_config": method.get("speculative_config"), "error": f"{type(exc).__name__}: {exc}"}
    Path(result_path).write_text(json.dumps(result))
    return 0


def run_all(request_path: str, result_path: str) -> int:
    """Each method in a fresh child process, one after the other; the results gathered into one JSON file."""
    request = json.loads(Path(request_path).read_text())
    if request.get("protocol") != PROTOCOL:
        raise SystemExit(f"vllm_driver speaks protocol {PROTOCOL}, the request says {request.get('protocol')}")
    methods = []
    for i, method in enumerate(request["methods"]):
        part = f"{result_path}.{i}"
        proc = subprocess.run([sys.executable, __file__, "--one", request_path, str(i), part])
        try:
            methods.append(json.loads(Path(part).read_text()))
            Path(part).unlink()
        except (OSError, ValueError):
            methods.append({"name": method["name"], "k": method.get("k"),
                            "speculative_config": method.get("speculative_config"),
                            "error": f"the vLLM process exited with status {proc.returncode} and wrote no result"})
    Path(result_path).write_text(json.dumps({"protocol": PROTOCOL, "machine": environment(), "methods": methods,
                                             "trees": tree_support()}))
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[0] == "--one":
        return run_one(argv[1], int(argv[2]), argv[3])
    if len(argv) != 2:
        print("usage: python vllm_driver.py REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model's forward timer is a callable
    return run_all(argv[0], argv[1])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
