"""vLLM as an anchor: the bench's prompts, as our token ids, through vLLM's own engine in its own venv and process
(vllm_driver.py, one engine per method and k), and its tokens, wall seconds and spec-decode counters back into the
result rows as vllm_<method>_... fields. Nothing here imports vLLM; report.vllm_summary pools the fields.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ...config import BUNDLED_HUB_ID, BUNDLED_ID, Runtime, SuffixConfig
from ...models.loading import BUNDLED_ALIASES, LoadedModel, cache_root
from ...serve.serve_config import Lookup, vllm_speculative_config
from .timing import ratio

log = logging.getLogger(__name__)

VLLM_PYTHON_ENV = "SPECDEMO_VLLM_PYTHON"
DRIVER = Path(__file__).with_name("in_vllm") / "vllm_driver.py"  # alone in its folder: see its docstring
REPO_VENV_PYTHON = Path(__file__).resolve().parents[3] / ".venv-vllm" / "bin" / "python"
PROTOCOL = 1  # vllm_driver.PROTOCOL (the driver is not importable here: it runs under the other venv)
ROW_FIELDS = ("seconds", "tokens", "tokens_per_s", "identical", "drafts", "draft_tokens", "accepted")
# the app venv's own paths must not leak into vLLM's interpreter
_ISOLATE = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")


class VllmUnavailable(RuntimeError):
    """vLLM is not installed where we look, or its run failed; the message says what to do."""


@dataclass(frozen=True)
class VllmOptions:
    """How the bench runs vLLM (the CLI's --vllm-* flags and SPECDEMO_VLLM_PYTHON)."""

    python: str | None = None  # SPECDEMO_VLLM_PYTHON; None: .venv-vllm/bin/python in the repository
    eagle3: str | None = None  # an exported EAGLE-3 folder for vLLM's eagle3 method (python -m specdemo export)
    draft_model: str | None = None  # a draft LLM (hub id or folder) for vLLM's draft_model method
    suffix: SuffixConfig | None = None  # suffix decoding's options for vLLM's suffix method (None: not run)
    threads_bind: str | None = None  # VLLM_CPU_OMP_THREADS_BIND for its CPU worker; None: vLLM's own "auto"
    enforce_eager: bool = True  # no torch.compile: the CPU build's compile path needs a C++ toolchain and minutes
    max_model_len: int = 2048
    profile_forward: bool = True  # time the target's forward inside vLLM's worker (forward hooks, as ours)
    timeout_s: float = 7200.0


def find_python(configured: str | None = None) -> Path | None:
    """The vLLM venv's python: the configured one (only it, when given), else .venv-vllm/bin/python; None if that
    is not an executable file."""
    candidate = Path(configured) if configured else REPO_VENV_PYTHON
    return candidate if candidate.is_file() and os.access(candidate, os.X_OK) else None


def require_python(configured: str | None = None) -> Path:
    python = find_python(configured)
    if python is None:
        where = (f"{VLLM_PYTHON_ENV}={configured} is not an executable python" if configured
                 else f"there is no {REPO_VENV_PYTHON}")
        raise VllmUnavailable(f"vLLM is not installed ({where}); build its venv with `bash run.sh vllm`, or set "
                              f"{VLLM_PYTHON_ENV} to a python that has vllm")
    return python


def model_source(model: LoadedModel, runtime: Runtime = Runtime()) -> str:
    """What vLLM loads for one of our models: the bundled model's converted safetensors folder, a folder, a hub id."""
    if model.source == "bundled":
        return str(cache_root(runtime) / BUNDLED_ID)
    if model.source == "hub" and model.name.lower() in BUNDLED_ALIASES:
        return BUNDLED_HUB_ID
    return model.name


def vllm_methods(ks: list[int], lookup: Lookup, eagle3: str | None = None, draft_model: str | None = None,
                 suffix: SuffixConfig | None = None) -> list[dict]:
    """Plain decoding once, then at each k ngram, suffix with its options, eagle3 with an exported head and
    draft_model with a draft LLM: one vLLM engine each (its prompts in order, so suffix's cache carries across them)."""
    methods = [{"name": "plain", "k": None, "speculative_config": None}]
    for k in ks:
        for name, path in (("ngram", None), ("suffix", None), ("eagle3", eagle3), ("draft_model", draft_model)):
            if name == "ngram" or path or (name == "suffix" and suffix is not None):
                methods.append({"name": name, "k": k,
                                "speculative_config": vllm_speculative_config(name, k, path, lookup, suffix=suffix)})
    return methods


def build_request(model: str, prompts: list[tuple[str, list[int]]], eos: list[int], max_tokens: int,
                  methods: list[dict], options: VllmOptions = VllmOptions(), seed: int = 0,
                  dtype: str = "float32") -> dict:
    """The driver's request: greedy, batch 1, the same prompt ids, max_tokens and EOS ids as our decoders."""
    ids = [i for i, _ in prompts]
    if len(set(ids)) != len(ids):
        raise ValueError("the vLLM anchor matches prompts by id, and this prompt file repeats ids")
    return {"protocol": PROTOCOL, "model": model, "dtype": dtype, "max_model_len": options.max_model_len,
            "enforce_eager": options.enforce_eager, "seed": seed, "max_tokens": max_tokens,
            "eos_token_ids": sorted(eos), "profile_forward": options.profile_forward, "warmup": 1,
            "prompts": [{"id": i, "prompt_token_ids": list(p)} for i, p in prompts], "methods": methods}


def driver_env(options: VllmOptions, env: Mapping[str, str]) -> dict[str, str]:
    """The driver's environment: ours without the app venv's paths, plus vLLM's CPU thread binding if asked."""
    out = {k: v for k, v in env.items() if k not in _ISOLATE}
    if options.threads_bind:
        out["VLLM_CPU_OMP_THREADS_BIND"] = options.threads_bind
    if options.profile_forward:
        out["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model's forward timer is a callable (local only)
    return out


def run_driver(python: Path, request: dict, workdir: Path, env: Mapping[str, str], timeout_s: float) -> dict:
    """Run the driver to completion (its engines exit before this returns); its log goes to workdir/vllm.log."""
    workdir.mkdir(parents=True, exist_ok=True)
    req, res, log_path = workdir / "request.json", workdir / "result.json", workdir / "vllm.log"
    req.write_text(json.dumps(request))
    res.unlink(missing_ok=True)
    with open(log_path, "w") as fh:
        try:
            proc = subprocess.run([str(python), str(DRIVER), str(req), str(res)], stdout=fh, stderr=subprocess.STDOUT,
                                  env=dict(env), timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired as exc:
            raise VllmUnavailable(f"vLLM did not finish within {timeout_s:.0f} s; see {log_path}") from exc
    if proc.returncode != 0 or not res.exists():
        tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise VllmUnavailable(f"the vLLM driver exited with status {proc.returncode}; see {log_path}:\n{tail}")
    result = json.loads(res.read_text())
    if result.get("protocol") != PROTOCOL:
        raise VllmUnavailable(f"the vLLM driver answered protocol {result.get('protocol')}, expected {PROTOCOL}")
    return result


def tree_note(trees: list[str], support: Mapping | None) -> str | None:
    """One line for the report when our rows draft trees (a --tree setting other than off): what vLLM's rows are
    beside them. The driver's tree_support says whether the installed vLLM has speculative_token_tree and a tree
    attention backend; either way the anchor runs vLLM's chains at the same k, set beside the rows of our first
    setting (trees[0]). None when every setting is off (chains against chains)."""
    if all(t == "off" for t in trees):
        return None
    beside = f"its rows are chains at the same k, set beside our --tree {trees[0]} rows"
    support = support or {}
    version = f"vLLM {support['vllm']}" if support.get("vllm") else "this vLLM"
    if support.get("speculative_token_tree") and support.get("tree_attention_backend"):
        return f"{version} has speculative_token_tree, but this bench runs only its chains: {beside}"
    if "speculative_token_tree" in support:
        missing = [n for n, key in (("no speculative_token_tree in its SpeculativeConfig", "speculative_token_tree"),
                                    ("no tree attention backend", "tree_attention_backend")) if not support.get(key)]
        return f"{version} verifies no draft trees ({' and '.join(missing)}; docs/vllm.md#draft-trees): {beside}"
    why = support.get("error") or "the driver did not say"
    return f"{version}: whether it verifies draft trees is unknown ({why}); {beside}"


def drafting_steps(sd_run) -> int:
    """Our verify passes that carried at least one drafted token (vLLM's num_drafts counts the same thing)."""
    return sum(1 for e in sd_run.events if e.kind == "spec" and e.drafted)


def attach(rows: list[dict], result: dict, ours: Mapping[tuple[str, int], tuple],
           mismatch: Callable[[str, list[int]], dict | None] | None = None) -> list[dict]:
    """Write vLLM's per-prompt figures into the rows: plain into every row of a prompt, a method at k into the row of
    that k. ours[(prompt id, k)] = (our AR run, our SD run): identical means equal to our AR's token ids (the target's
    greedy output). mismatch(prompt id, vllm ids) describes a first difference. Returns the methods that failed."""
    failed = [{"name": m["name"], "k": m.get("k"), "error": m["error"]} for m in result["methods"] if m.get("error")]
    for f in failed:
        log.warning("vLLM %s (k=%s) failed: %s", f["name"], f["k"], f["error"])
    for row in rows:
        ar_run, sd_run = ours[(row["id"], row["k"])]
        row["ours_drafting_steps"] = drafting_steps(sd_run)
        for method in result["methods"]:
            if method.get("error") or method.get("k") not in (None, row["k"]):
                continue
            entry = next((p for p in method["prompts"] if p["id"] == row["id"]), None)
            if entry is not None:
                put_vllm(row, method["name"], entry, ar_run.ids, mismatch)
    return failed


def put_vllm(row: dict, name: str, entry: dict, reference: list[int],
             mismatch: Callable[[str, list[int]], dict | None] | None = None) -> None:
    """One vLLM measurement into a row, as vllm_<name>_... keys."""
    key, ids, c = f"vllm_{name}", entry["token_ids"], entry["counters"]
    row[f"{key}_seconds"] = entry["seconds"]
    row[f"{key}_tokens"] = len(ids)
    row[f"{key}_tokens_per_s"] = ratio(len(ids), entry["seconds"])
    row[f"{key}_identical"] = ids == reference
    row[f"{key}_drafts"] = c["num_drafts"]
    row[f"{key}_draft_tokens"] = c["num_draft_tokens"]
    row[f"{key}_accepted"] = c["num_accepted_tokens"]
    row[f"{key}_accepted_per_pos"] = c.get("accepted_per_pos", [])
    if "request_metrics" in entry:  # vLLM's own metrics.speculative_decoding, where the installed vLLM has it
        row[f"{key}_speculative_decoding"] = {**entry["request_metrics"],
                                              "num_accepted_tokens_per_pos": c.get("accepted_per_pos", [])}
    if "forward_seconds" in entry:
        row[f"{key}_forward_s"] = entry["forward_seconds"]
        row[f"{key}_forward_calls"] = entry["forward_calls"]
    if not row[f"{key}_identical"] and mismatch is not None:
        row[f"{key}_mismatch"] = mismatch(row["id"], ids)


def run_vllm(rows: list[dict], target: LoadedModel, prompts: list[tuple[str, list[int]]], eos: list[int],
             max_tokens: int, ks: list[int], lookup: Lookup, ours: Mapping[tuple[str, int], tuple],
             options: VllmOptions, workdir: Path, env: Mapping[str, str], runtime: Runtime = Runtime(), seed: int = 0,
             mismatch: Callable[[str, list[int]], dict | None] | None = None, trees: list[str] = ("off",)) -> dict:
    """All vLLM runs, after ours (our process idles while they run), attached to the rows; the report's metadata,
    with tree_note's line when our rows drafted trees (`trees`: bench's --tree settings)."""
    python = require_python(options.python)
    dtype = str(target.dtype).replace("torch.", "")
    methods = vllm_methods(ks, lookup, options.eagle3, options.draft_model, options.suffix)
    request = build_request(model_source(target, runtime), prompts, eos, max_tokens, methods, options, seed, dtype)
    log.info("vLLM: %d engines (%s) on %d prompts; each loads for about a minute", len(methods),
             ", ".join(m["name"] + (f"@k={m['k']}" if m["k"] else "") for m in methods), len(prompts))
    load_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    result = run_driver(python, request, workdir / "vllm", driver_env(options, env), options.timeout_s)
    load_end = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    failed, support = attach(rows, result, ours, mismatch), result.get("trees")
    return {"python": str(python), "model": request["model"], "machine": result.get("machine", {}),
            "load_average_start": load_start, "load_average_end": load_end,
            "threads_bind": options.threads_bind or "auto (vLLM's default)", "enforce_eager": options.enforce_eager,
            "lookup": {"prompt_lookup_min": lookup.min_ngram, "prompt_lookup_max": lookup.max_ngram},
            "methods": [{k: m.get(k) for k in ("name", "k", "speculative_config", "load_seconds", "vllm",
                                                "forward_profiled", "error")} for m in result["methods"]],
            "failed": failed, "tree_support": support, "tree_note": tree_note(list(trees), support)}
