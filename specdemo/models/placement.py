"""Where a model's parts live under accelerate's device map (set by transformers' from_pretrained), the device its
inputs go to, weights read back from an offload, and the placement summary of the result JSON. No loading, no decoding.
"""

from __future__ import annotations

import re

import torch
from torch import nn

OFFLOADED = ("cpu", "disk")  # device-map entries whose weights accelerate streams to the main device for each pass
_INDEXED = re.compile(r"^(.*)\.(\d+)$")


def device_name(device: int | str | torch.device) -> str:
    """accelerate's device-map values (0, "cpu", "disk") and torch devices as one spelling: "cuda:0", "cpu", "disk"."""
    if isinstance(device, int):
        return f"cuda:{device}"
    text = str(device)
    return f"cuda:{text}" if text.isdigit() else text


def main_device(device_map: dict) -> torch.device:
    """Where accelerate runs offloaded parts: the first accelerator in the map, else the CPU (as dispatch_model)."""
    accelerators = [device_name(d) for d in device_map.values() if device_name(d) not in OFFLOADED]
    return torch.device(accelerators[0] if accelerators else "cpu")


def _entry_for(device_map: dict, name: str) -> str | None:
    """The device-map key that holds module `name` (itself or its closest ancestor; "" holds everything)."""
    best = None
    for key in device_map:
        holds = key == "" or name == key or name.startswith(key + ".")
        if holds and (best is None or len(key) > len(best)):
            best = key
    return best


def execution_device(model: nn.Module) -> torch.device:
    """The device a model's input ids go to: its embeddings' (their execution device under a device map, where parts
    kept in CPU memory or on disk run on the main device); the first parameter's for a model on one device."""
    device_map = getattr(model, "hf_device_map", None)
    if device_map:
        embed = model.get_input_embeddings()
        name = next((n for n, m in model.named_modules() if m is embed), "")
        entry = _entry_for(device_map, name)
        where = device_name(device_map[entry]) if entry is not None else "cpu"
        return main_device(device_map) if where in OFFLOADED else torch.device(where)
    return next(model.parameters()).device


def module_device(module: nn.Module) -> torch.device:
    """Where a module computes: its accelerate hook's execution device, else its first parameter's."""
    hook = getattr(module, "_hf_hook", None)
    dev = getattr(hook, "execution_device", None)
    if dev is not None:
        return torch.device(device_name(dev))
    return next(module.parameters()).device


def is_offloaded(module: nn.Module) -> bool:
    """Whether accelerate reloads this module's weights for every forward (they sit on the meta device between)."""
    return bool(getattr(getattr(module, "_hf_hook", None), "offload", False))


def weight_of(module: nn.Module, name: str = "weight") -> torch.Tensor:
    """A module's parameter, read back from accelerate's offload (CPU memory or disk) onto its execution device when
    it is offloaded; the parameter itself otherwise."""
    tensor = getattr(module, name)
    if tensor.device.type != "meta":
        return tensor
    hook = getattr(module, "_hf_hook", None)
    weights = getattr(hook, "weights_map", None)
    if weights is None:
        raise ValueError(f"{type(module).__name__}.{name} is on the meta device and has no offloaded copy")
    return weights[name].to(device=module_device(module), dtype=tensor.dtype)


def module_ranges(names: list[str]) -> list[str]:
    """Consecutive numbered siblings as one range: model.layers.0, model.layers.1, model.layers.2 ->
    model.layers.0-2."""
    out: list[str] = []
    run: tuple[str, int, int] | None = None  # (prefix, first, last)
    for name in names + [""]:
        m = _INDEXED.match(name)
        if run and m and m.group(1) == run[0] and int(m.group(2)) == run[2] + 1:
            run = (run[0], run[1], int(m.group(2)))
            continue
        if run:
            out.append(f"{run[0]}.{run[1]}" + (f"-{run[2]}" if run[2] != run[1] else ""))
            run = None
        if m:
            run = (m.group(1), int(m.group(2)), int(m.group(2)))
        elif name:
            out.append(name)
    return out


def model_placement(model: nn.Module, strategy: dict | None = None) -> dict:
    """Where a model lives: {"parts": {device: [module ranges]}, "parameters": {device: count}, "execution_device",
    plus the Placement's fields (strategy: Placement.as_dict) under a device map. One device: parts
    {device: ["all"]}."""
    device_map = getattr(model, "hf_device_map", None)
    dev = device_name(execution_device(model))
    if not device_map:
        count = sum(p.numel() for p in model.parameters())
        return {**(strategy or {"device_map": None}), "execution_device": dev, "parts": {dev: ["all"]},
                "parameters": {dev: count}}
    names: dict[str, list[str]] = {}
    counts: dict[str, int] = {}
    order = [n for n, _ in model.named_modules()]  # the model's own order: embeddings, layers 0.., norm, head
    rank = {n: i for i, n in enumerate(order)}
    seen: set[int] = set()  # tied weights (embeddings and head) count once, where they first appear
    for key in sorted(device_map, key=lambda k: rank.get(k, len(order))):
        where = device_name(device_map[key])
        names.setdefault(where, []).append(key or "all")
        module = model.get_submodule(key) if key else model
        fresh = [p for p in module.parameters() if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        counts[where] = counts.get(where, 0) + sum(p.numel() for p in fresh)
    out = {**(strategy or {}), "execution_device": dev, "main_device": device_name(main_device(device_map)),
           "parts": {d: module_ranges(n) for d, n in names.items()}, "parameters": counts,
           "modules": {d: len(n) for d, n in names.items()}}
    return out


def drafter_device(drafter) -> str | None:
    """The device a drafter computes on: its draft model's or its draft head's; None for prompt lookup."""
    inner = getattr(drafter, "model", None)
    if inner is not None and not isinstance(inner, nn.Module):  # the hybrid: its model drafter
        return drafter_device(inner)
    module = inner if isinstance(inner, nn.Module) else getattr(drafter, "head", None)
    if isinstance(module, nn.Module):
        return device_name(next(module.parameters()).device)
    return None


def draft_lm(drafter) -> nn.Module | None:
    """A drafter's draft causal LM (the hybrid's too); None for an EAGLE-3 head or prompt lookup."""
    inner = getattr(drafter, "model", None)
    if inner is not None and not isinstance(inner, nn.Module):  # the hybrid: its model drafter
        return draft_lm(inner)
    return inner if isinstance(inner, nn.Module) else None


def draft_head(drafter) -> nn.Module | None:
    """A drafter's EAGLE-3 head (the hybrid's too); None for a draft LM or prompt lookup."""
    inner = getattr(drafter, "model", None)
    if inner is not None and not isinstance(inner, nn.Module):  # the hybrid: its draft's drafter
        return draft_head(inner)
    head = getattr(drafter, "head", None)
    return head if isinstance(head, nn.Module) else None


def placement_line(placement: dict) -> str:
    """One line for people: where the target's parts and the draft live (from pair_placement's dict)."""
    t, d = placement["target"], placement.get("draft") or {}
    parts = "; ".join(f"{dev}: {', '.join(names)}" for dev, names in t["parts"].items())
    line = f"target on {parts}"
    if t.get("device_map"):
        runs_on = t.get("main_device") or t["execution_device"]
        line += f" (device map {t['device_map']}, offloaded parts run on {runs_on}"
        line += f", max memory {t['max_memory']}" if t.get("max_memory") else ""
        line += ")"
    if d.get("device"):
        line += f"; draft on {d['device']}"
    return line


def to_device(values, device: torch.device | str | None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host values (a list, nested lists, or a CPU tensor; `dtype` as torch.tensor's) as a tensor on `device`,
    queued behind the work already there without the host waiting for it: on CUDA staged in pinned memory first,
    since a copy from pageable memory may make the host wait until the stream's queued work is done (CUDA's API
    synchronization behaviour; vLLM keeps its step inputs in pinned buffers for this). The pinned block is not reused
    before the copy is done (torch's caching host allocator records the copy's event). Every host value a decode
    step sends to the device comes through here or `staged` (tests/test_host_copies.py). `device` None: the CPU."""
    host = staged(values, device, dtype)
    return host if device is None else host.to(device, non_blocking=True)


def staged(values, device: torch.device | str | None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host values as a CPU tensor to copy into a buffer on `device` (`buffer.copy_(staged(...), non_blocking=True)`):
    pinned where the device is CUDA, as to_device."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    cuda = device is not None and torch.device(device).type == "cuda"
    return host.pin_memory() if cuda and not host.is_pinned() else host


def on_host(values, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host values as a CPU tensor that stays there (read by the host, never copied to a device): said where it is
    made, so that tests/test_host_copies.py can hold every other tensor made from host values to to_device."""
    return torch.tensor(values, dtype=dtype)
