"""Stage 2: the target's features (its final hidden state, then the head's aux layers' states; fp16) and greedy next
token at every position of every sample, cached in work/features.pt; and the draft's vocabulary subset chosen from
them. Knows the samples' shape and where answers recorded them; nothing of training.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from ..engine.kv import target_features
from .answers import RECORDED
from .config import Sample


@torch.inference_mode()
def build_features(target, samples: list[Sample], work: Path, batch_size: int = 8,
                   layers: tuple[int, ...] = ()) -> dict:
    """Target features (fp16: the final hidden state, then each of `layers`' hidden states) and the target's greedy
    next token at every position; cached in work/features.pt. Those recorded while answering (`RECORDED`) are read,
    not computed again; `target` computes the rest."""
    path = work / "features.pt"
    cached = torch.load(path) if path.exists() else None
    have_layers = tuple(cached.get("layers", ())) if cached is not None else ()
    if cached is not None and have_layers[: len(layers)] == tuple(layers) and len(have_layers) > len(layers):
        # Recorded with more layers: the final state comes first, then each layer, so the columns of a prefix of
        # them are a slice, with no new target passes. The file keeps all its layers unless samples are added.
        width = cached["features"][0].shape[-1] // (1 + len(have_layers)) * (1 + len(layers))
        cached = {"features": [f[:, :width].clone() for f in cached["features"]], "top1": cached["top1"],
                  "layers": tuple(layers)}
    elif cached is None or have_layers != tuple(layers):
        cached = {"features": [], "top1": [], "layers": tuple(layers)}
    have = len(cached["features"])  # samples only grow at the end, so a cached prefix stays valid
    if have >= len(samples):
        return {k: (v[: len(samples)] if isinstance(v, list) else v) for k, v in cached.items()}
    head = target.get_output_embeddings().weight
    feats, top1 = cached["features"], cached["top1"]
    out: dict[int, tuple] = {}
    files: dict[str, list] = {}
    for i in range(have, len(samples)):  # recorded while answering (--features writer)
        rec = samples[i].get("recorded")
        rec_layers = tuple(rec[2]) if rec and len(rec) > 2 else ()  # older caches: [file, row], no layers
        if rec and rec_layers == tuple(layers) and (work / RECORDED / rec[0]).is_file():
            file, row = rec[0], rec[1]
            if file not in files:
                files[file] = torch.load(work / RECORDED / file)
            out[i] = files[file][row]
    order = sorted((i for i in range(have, len(samples)) if i not in out), key=lambda i: len(samples[i]["ids"]))
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        width = max(len(samples[i]["ids"]) for i in idx)
        x = torch.zeros(len(idx), width, dtype=torch.long)
        mask = torch.zeros(len(idx), width, dtype=torch.long)
        for r, i in enumerate(idx):  # right padding: real positions keep their own indices
            ids = samples[i]["ids"]
            x[r, : len(ids)], mask[r, : len(ids)] = torch.tensor(ids), 1
        last, h = target_features(target, layers, input_ids=x.to(target.device), attention_mask=mask.to(target.device))
        for r, i in enumerate(idx):
            n = len(samples[i]["ids"])
            out[i] = (h[r, :n].half().cpu(), (last[r, :n] @ head.T).argmax(-1).int().cpu())
    for i in range(have, len(samples)):
        feats.append(out[i][0])
        top1.append(out[i][1])
    data = {"features": feats, "top1": top1, "layers": tuple(layers)}
    torch.save(data, path)
    if files:  # features.pt holds them now
        shutil.rmtree(work / RECORDED, ignore_errors=True)
    return data


def choose_subset(samples: list[Sample], top1: list[torch.Tensor], size: int, vocab: int,
                  always: list[int]) -> torch.Tensor:
    """The `size` most frequent target tokens (greedy labels and answer tokens), `always` among them; low ids (early
    BPE merges) fill the rest. Returns the sorted ids (size,)."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for s, t in zip(samples, top1):
        counts += torch.bincount(t.long(), minlength=vocab)
        counts += torch.bincount(torch.tensor(s["ids"][s["prompt_len"]:], dtype=torch.long), minlength=vocab)
    counts[always] = counts.max() + 1
    ranked = torch.argsort(-(counts.double() + 1.0 / (2.0 + torch.arange(vocab, dtype=torch.double))))
    return ranked[:size].sort().values
