"""`python -m specdemo export`: an EAGLE-3 head as a checkpoint folder vLLM and SGLang load unchanged, with the flags
that serve it at a k: speculative_config.json for `vllm serve --speculative-config`, sglang.txt for SGLang.

Only EAGLE-3 heads export; anything else is refused, saying what it is instead.
"""

from __future__ import annotations

import json
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..config import BUNDLED_ID, Runtime
from ..drafters.resolve import RECORDED, DraftError, resolve_draft, starting_k
from ..models import speculators
from ..models.eagle3 import (
    CONFIG_FILE,
    META_FILE,
    SPEC_FILE,
    WEIGHTS_FILE,
    Eagle3Config,
    Eagle3FormatError,
    not_a_draft,
    read_config,
    read_weights,
)
from .serve_config import (
    serve_target,
    sglang_command,
    sglang_flags,
    vllm_serve_command,
    vllm_speculative_config,
)

SGLANG_FILE = "sglang.txt"
K_SOURCE_KEY = "num_speculative_tokens_source"  # specdemo.json: where the recorded k came from (a report, --k, ...)


@dataclass(frozen=True)
class Export:
    """What `export` wrote, and the command lines that serve it."""

    folder: Path
    k: int
    k_source: str  # where k came from: --k, a sweep, the measured default's report, the head's own record
    speculative_config: dict
    vllm_command: str
    sglang_command: str


def head_folder(draft: str, runtime: Runtime = Runtime()) -> Path:
    """The EAGLE-3 checkpoint folder `draft` names (a folder, a hub id, or the shipped draft:
    drafters.resolve.resolve_draft); refuses anything else, saying what it is instead."""
    try:
        resolved = resolve_draft(draft, None, runtime)
    except DraftError as exc:
        raise Eagle3FormatError(str(exc)) from exc
    if not resolved.is_head:
        raise Eagle3FormatError(
            f"'{draft}' is not an EAGLE-3 head (its config.json names none of the EAGLE-3 architectures). A draft LLM "
            f"serves as it is: `python -m specdemo serve-config --drafter model --draft {draft}`")
    if read_config(resolved.path) is None:  # only `export`'s speculative_config.json: nothing to export from
        raise Eagle3FormatError(not_a_draft(draft, "the folder has no config.json"))
    return resolved.path


def export_eagle3(draft: str, out: str | Path, k: int | None = None, target: str | None = None,
                  runtime: Runtime = Runtime(), fmt: str = "eagle3", min_confidence: float | None = None,
                  k_source: str | None = None) -> Export:
    """Write DIR/config.json + model.safetensors (the head's own weights, normalised to the engines' layout),
    speculative_config.json and sglang.txt. k: given (from k_source), else the head's starting k (resolve.starting_k:
    the shipped draft's best measured, a head's recorded, the usual default); specdemo.json records k and its source.
    fmt "speculators": config.json and weight names in the speculators format instead, with the target as its
    verifier, so `vllm serve DIR` alone serves target and head (specdemo.models.speculators). min_confidence: the
    confidence gate our drafter reads from specdemo.json (given, else the head's own; vLLM and SGLang have none, so
    0 makes ours draft exactly what they draft)."""
    from safetensors.torch import save_file

    if min_confidence is not None and not 0.0 <= min_confidence < 1.0:  # before anything is written
        raise ValueError(f"min_confidence must be in [0, 1), got {min_confidence}")
    source = head_folder(draft, runtime)
    config = Eagle3Config.from_json(read_config(source))  # refuses variants we would not run the same way
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        meta = json.loads((source / META_FILE).read_text())
    except (OSError, ValueError):
        meta = {}
    if not k:
        k, k_source = starting_k("model", target or meta.get("target") or BUNDLED_ID, draft, runtime)
        if k_source == RECORDED:  # a re-export keeps the first export's account of its k
            k_source = meta.get(K_SOURCE_KEY, k_source)
    k_source = k_source or "given"
    if fmt == "speculators" and out.resolve() == source.resolve():
        raise ValueError("--format speculators rewrites config.json: give --out a new folder")
    if out.resolve() != source.resolve():
        tensors = {name: t.contiguous() for name, t in read_weights(source).items()}
        dtype = next((t.dtype for name, t in tensors.items() if name.endswith("weight")), None)
        for stale in out.glob("*.safetensors"):  # a previous export's shards would load beside the new file
            stale.unlink()
        save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
        (out / CONFIG_FILE).write_text(json.dumps(config.to_json(dtype), indent=2) + "\n")
        if (source / "README.md").exists():
            shutil.copyfile(source / "README.md", out / "README.md")
    if min_confidence is not None:
        meta["min_confidence"] = min_confidence
    (out / META_FILE).write_text(json.dumps({**meta, "num_speculative_tokens": k, K_SOURCE_KEY: k_source}, indent=2)
                                 + "\n")
    model = str(out.resolve())
    spec = vllm_speculative_config("eagle3", k, model)
    (out / SPEC_FILE).write_text(json.dumps(spec, indent=2) + "\n")
    served, _ = serve_target(target or meta.get("target") or BUNDLED_ID, runtime)
    if fmt == "speculators":
        return _as_speculators(out, config, k, k_source, served, spec)
    sglang = sglang_command(served, "eagle3", k, model)
    (out / SGLANG_FILE).write_text(f"# {sglang}\n{sglang_flags('eagle3', k, model)}\n")
    return Export(out, k, k_source, spec, vllm_serve_command(served, spec), sglang)


def _as_speculators(out: Path, config: Eagle3Config, k: int, k_source: str, verifier: str, spec: dict) -> Export:
    """Rewrite an export's config.json and weight names in the speculators format; vLLM serves the folder alone."""
    from safetensors.torch import save_file

    tensors = speculators.to_speculators_tensors(read_weights(out))
    dtype = next((t.dtype for name, t in tensors.items() if name.endswith("weight")), None)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    raw = config.to_json(dtype) if dtype is not None else config.to_json()
    (out / CONFIG_FILE).write_text(json.dumps(speculators.from_raw(
        raw, k, verifier, speculators.verifier_architectures(verifier)), indent=2) + "\n")
    (out / SGLANG_FILE).unlink(missing_ok=True)
    return Export(out, k, k_source, spec, f"vllm serve {shlex.quote(str(out.resolve()))}",
                  "not written for this format: SGLang takes `--format eagle3`")


def serve_hint(target: str, draft: str | None, k: int, runtime: Runtime = Runtime()) -> str | None:
    """Markdown for the app after Tune k with an EAGLE-3 draft: the commands that serve it at k in vLLM and SGLang
    (a hub head as it is, ours exported first); None for other drafts."""
    try:
        resolved = resolve_draft(draft, target, runtime)
    except (DraftError, OSError, RuntimeError):
        return None
    if not resolved.is_head:
        return None
    draft, local = resolved.name, resolved.local
    served, _ = serve_target(target, runtime)
    model = f"{Path(draft).name}-eagle3" if local else draft  # vLLM and SGLang load a published head by its hub id
    export = f"python -m specdemo export --draft {draft} --out {model} --k {k} --target {target}\n" if local else ""
    spec = vllm_speculative_config("eagle3", k, model)
    return (f"**Serve this draft with k = {k} in vLLM**{' (export it first)' if local else ''}:\n\n```\n{export}"
            f"{vllm_serve_command(served, spec)}\n# SGLang:\n{sglang_command(served, 'eagle3', k, model)}\n```")
