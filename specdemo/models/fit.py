"""Before loading: about how many bytes a target and its draft need (parameter counts from a folder's safetensors
headers, the local hub cache or the hub's safetensors metadata), and whether the memory a deployment allows holds them.
Reads no weights and loads nothing.
"""

from __future__ import annotations

import functools
import json
import logging
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import Placement, Runtime
from .kernels import available_memory

log = logging.getLogger(__name__)

GIB = 1024**3
OVERHEAD = 1.1  # activations, the KV cache and allocator slack on top of the weights
UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def size_bytes(text: str) -> int:
    """'20GiB' -> 21474836480; a plain number is bytes (config.parse_max_memory has checked the spelling)."""
    number = text.rstrip("BKMGTIbkmgti")
    return int(float(number) * UNITS.get(text[len(number):].upper() or "B", 1))


def _header_params(path: Path) -> int:
    """Parameters in one safetensors file, from its JSON header alone (the first 8 bytes give its length)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    total = 0
    for name, info in header.items():
        if name != "__metadata__":
            count = 1
            for d in info["shape"]:
                count *= d
            total += count
    return total


def folder_params(folder: str | Path) -> int | None:
    """Parameters of the model in a folder (its *.safetensors), or None when it has none."""
    files = sorted(Path(folder).glob("*.safetensors"))
    return sum(_header_params(f) for f in files) if files else None


def _cached_params(repo_id: str) -> int | None:
    """Parameters of a hub model in the local hub cache, from its cached safetensors files' headers."""
    from huggingface_hub import try_to_load_from_cache

    single = try_to_load_from_cache(repo_id, "model.safetensors")
    if isinstance(single, str):
        return _header_params(Path(single))
    index = try_to_load_from_cache(repo_id, "model.safetensors.index.json")
    if isinstance(index, str):
        shards = sorted(set(json.loads(Path(index).read_text())["weight_map"].values()))
        paths = [try_to_load_from_cache(repo_id, s) for s in shards]
        if all(isinstance(p, str) for p in paths):
            return sum(_header_params(Path(p)) for p in paths)
    return None


@functools.lru_cache(maxsize=64)
def _hub_params(repo_id: str, endpoint: str) -> int | None:
    """Parameters of a hub model from the hub's safetensors metadata (headers only, no weights)."""
    from huggingface_hub import get_safetensors_metadata

    try:
        meta = get_safetensors_metadata(repo_id)
    except Exception as exc:  # gated, missing, no safetensors, or the network: no estimate, loading will say why
        log.info("no size estimate for %s: %s", repo_id, exc)
        return None
    return sum(meta.parameter_count.values())


def parameter_count(path_or_id: str, source: str, runtime: Runtime = Runtime()) -> int | None:
    """Parameters of a located model (loading._locate's path and source), or None when no estimate can be made."""
    if source in ("bundled", "folder"):
        return folder_params(path_or_id)
    cached = _cached_params(path_or_id)
    if cached is not None or runtime.hub_offline:
        return cached
    return _hub_params(path_or_id, runtime.hub_endpoint)


@dataclass(frozen=True)
class Fit:
    """What a pair needs and what the deployment gives it; `fits` False means it cannot load here."""

    need: int  # bytes: target and draft weights in the load dtype, with OVERHEAD
    allowed: int  # bytes of device and CPU memory the placement (or the one device) allows
    where: str  # the allowance in words
    disk: bool  # whether an offload folder takes what memory cannot
    fits: bool

    def message(self, names: str) -> str:
        need, allowed = self.need / GIB, self.allowed / GIB
        if self.fits and self.need <= self.allowed:
            return f"{names} need about {need:.1f} GiB; {self.where} allows {allowed:.1f} GiB."
        if self.fits:
            return (f"{names} need about {need:.1f} GiB, more than the {allowed:.1f} GiB of {self.where}; the rest "
                    "goes to the offload folder on disk, read back at every pass (slow).")
        return (f"{names} need about {need:.1f} GiB, but {self.where} allows {allowed:.1f} GiB and no offload folder "
                "is set. Choose a smaller pair; the server's operator can raise the limits with SPECDEMO_MAX_MEMORY "
                "or allow disk offload with SPECDEMO_OFFLOAD_FOLDER (and SPECDEMO_DEVICE_MAP).")


def device_memory(device: torch.device) -> int:
    """Bytes free on a device now: CUDA's free memory, else the machine's available memory."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.mem_get_info(device)[0]
    return available_memory() or 0


def allowance(placement: Placement, device: torch.device) -> tuple[int, str, bool]:
    """(bytes of memory allowed, in words, whether disk takes the rest) for a target loaded with `placement`."""
    if not placement.active:
        return device_memory(device), f"this server's {device}", False
    disk = placement.offload_folder is not None
    limits = placement.max_memory_dict()
    if limits:
        memory = {k: size_bytes(v) for k, v in limits.items() if k != "disk"}
        words = ", ".join(f"{'GPU ' + str(k) if isinstance(k, int) else k} {v}" for k, v in limits.items())
        return sum(memory.values()), f"the device map's limits ({words})", disk
    gpus = range(torch.cuda.device_count()) if torch.cuda.is_available() else range(0)
    total = sum(torch.cuda.mem_get_info(i)[0] for i in gpus) + (available_memory() or 0)
    return total, f"the free memory of {len(gpus)} GPU(s) and the CPU", disk


def estimate_fit(params: list[int], bytes_per_param: int, placement: Placement, device: torch.device) -> Fit:
    """Whether weights of these parameter counts (target, then drafts) fit what the placement allows."""
    need = int(sum(params) * bytes_per_param * OVERHEAD)
    allowed, where, disk = allowance(placement, device)
    return Fit(need, allowed, where, disk, need <= allowed or disk)
