"""Stage 3: training the head (regression to the target's next feature and cross-entropy to its token, unrolled
`depth` draft steps), its held-out evaluation, and the split. Knows samples and features as answers and features make
them, and TrainConfig; nothing of generating data or of the command line.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .config import LogFn, Sample, TrainConfig


def common_prefix(samples: list[Sample]) -> int:
    """How many leading tokens every sample shares (the chat template's system preamble): the default `skip`."""
    first = samples[0]["ids"]
    n = min(len(s["ids"]) for s in samples)
    for i in range(n):
        if any(s["ids"][i] != first[i] for s in samples):
            return i
    return n


def padded_batch(samples: list[Sample], data: dict, idx: list[int], max_len: int, skip: int, depth: int,
                 sub_index: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Padded tensors for sequences `idx`: (features (B, T + depth, H), tokens (B, T + depth), labels (B, T + depth)
    as subset indices, -100 where no loss, valid (labels != -100), T)."""
    lens = [min(len(samples[i]["ids"]), max_len) for i in idx]
    t = max(lens)
    b, h = len(idx), data["features"][0].shape[-1]
    feats = torch.zeros(b, t + depth, h)
    tokens = torch.zeros(b, t + depth, dtype=torch.long)
    labels = torch.full((b, t + depth), -100, dtype=torch.long)
    for r, (i, n) in enumerate(zip(idx, lens)):
        feats[r, :n] = data["features"][i][:n].float()
        tokens[r, :n] = torch.tensor(samples[i]["ids"][:n])
        lab = sub_index[data["top1"][i][:n].long()]
        # Loss on the answer only: the draft never proposes prompt text, and templated prompts are easy to memorise,
        # which inflated held-out agreement far above the acceptance measured on real prompts.
        lab[: max(skip, samples[i]["prompt_len"] - 1)] = -100
        labels[r, :n] = lab
    valid = labels != -100
    return feats.to(device), tokens.to(device), labels.to(device), valid.to(device), t


def losses(head, feats: torch.Tensor, tokens: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, t: int,
           depth: int, noise: float, feat_weight: float, gen: torch.Generator | None = None,
           soft_weight: float = 0.0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per-depth (ce, feature loss, correct mask); row i of depth d predicts position i + d. `head` is a
    heads.Eagle3Trainee.

    ce mixes cross-entropy to the target's greedy token with, at `soft_weight`, cross-entropy to the target's own
    distribution over the subset (EAGLE's classification loss), computed from the recorded final hidden state with
    the same frozen head: the whole distribution, not one token, per position."""
    inp = feats[:, :t]
    if noise > 0:  # in the units the head reads its features in (input_scale: per channel)
        scale = noise * head.input_scale.to(inp.dtype)
        inp = inp + (torch.rand(inp.shape, generator=gen, device=inp.device) - 0.5) * 2 * scale
    outs = head.unrolled(inp, tokens, depth)
    res = []
    for d, g in enumerate(outs, start=1):
        lab, ok = labels[:, d : d + t], valid[:, d : d + t]
        logits = head.logits(g[ok])  # (N, S)
        true = feats[:, d : d + t, : g.shape[-1]][ok]  # the target's final hidden state there
        ce = F.cross_entropy(logits.float(), lab[ok])
        if soft_weight > 0:
            with torch.no_grad():
                target_probs = torch.softmax(head.teacher_logits(true).float(), dim=-1)  # (N, S)
            soft = -(target_probs * torch.log_softmax(logits.float(), dim=-1)).sum(-1).mean()
            ce = (1 - soft_weight) * ce + soft_weight * soft
        fl = F.smooth_l1_loss(g[ok].float(), true)
        res.append((ce, fl * feat_weight, logits.argmax(-1) == lab[ok], ok))
    return res


def _draftable_rows(samples: list[Sample], idx: list[int], max_len: int, skip: int, t: int, depth: int) -> torch.Tensor:
    """(B, t) rows whose draft steps 1..depth all predict answer tokens a drafter could propose: row i at step d
    predicts token i + d + 1, which must lie between the second answer token (the first comes from the prefill) and
    the sequence's end, so every step and every depth counts the same kind of rows."""
    rows = torch.zeros(len(idx), t, dtype=torch.bool)
    for r, i in enumerate(idx):
        n = min(len(samples[i]["ids"]), max_len)
        lo = max(skip, samples[i]["prompt_len"])  # label p is the token at p + 1
        rows[r, max(0, lo - 1) : max(0, n - 1 - depth)] = True
    return rows


@torch.no_grad()
def evaluate(head, samples: list[Sample], data: dict, idx: list[int], sub_index: torch.Tensor, device: torch.device,
             *, depth: int, batch_size: int, max_len: int, skip: int) -> dict:
    """Held-out top-1 agreement with the target at draft steps 1..depth, and the chain rate (all steps right).

    A target token outside the draft's subset counts as a miss, since the draft can never propose it: the figure at
    step 1 is the acceptance a greedy run at k = 1 measures. (Leaving those tokens out, as an earlier version did at
    depth 1, overstates it: docs/notes/draft-experiments.md, "A fix to the agreement figure".)"""
    head.eval()
    right = torch.zeros(depth)
    chain = torch.zeros(depth)
    total = 0
    for s in range(0, len(idx), batch_size):
        batch = idx[s : s + batch_size]
        feats, tokens, labels, valid, t = padded_batch(samples, data, batch, max_len, skip, depth, sub_index, device)
        rows = _draftable_rows(samples, batch, max_len, skip, t, depth).to(device)
        outs = head.unrolled(feats[:, :t], tokens, depth)
        alive = rows.clone()
        for d, g in enumerate(outs, start=1):
            hit = (head.logits(g).argmax(-1) == labels[:, d : d + t]) & valid[:, d : d + t]
            right[d - 1] += float((hit & rows).sum())
            alive = alive & hit
            chain[d - 1] += float(alive.sum())
        total += float(rows.sum())
    head.train()
    acc = (right / max(total, 1)).tolist()
    chain_rate = (chain / max(total, 1)).tolist()
    return {"top1_step": [round(a, 4) for a in acc], "chain": [round(c, 4) for c in chain_rate],
            "est_mean_accepted": round(1 + sum(chain_rate), 3)}  # per target pass at k = depth, bonus included


def subset_index(head) -> torch.Tensor:
    """(V,) on the CPU: each target id's index in the head's subset, -100 (ignored by the losses) outside it."""
    index = torch.full((head.c.vocab_size,), -100, dtype=torch.long)
    index[head.subset.cpu()] = torch.arange(len(head.subset))
    return index


def split_held_out(samples: list[Sample], rng: random.Random) -> tuple[list[int], list[int]]:
    """(held-out, training) sample indices: 1 in 20 held out, from the self-written or file-given instructions when
    there are enough. Templated ones are near-duplicates of training items and overstate agreement on new prompts
    (an early draft's held-out figure on a mixed split was far above its acceptance on dev.jsonl)."""
    order = list(range(len(samples)))
    rng.shuffle(order)
    n_eval = max(4, len(order) // 20)
    own = [i for i in order if samples[i].get("stage") in ("self", "written")]
    held = own[:n_eval] if len(own) >= 2 * n_eval else order[:n_eval]
    held_set = set(held)
    return held, [i for i in order if i not in held_set]


def training_share(train_idx: list[int], fraction: float, minimum: int) -> list[int]:
    """The first `fraction` of the (shuffled) training indices, at least `minimum`: nested shares of one split, so a
    data-scaling run keeps the held-out set and every smaller share lies inside every larger one."""
    return train_idx if fraction >= 1 else train_idx[: max(minimum, round(len(train_idx) * fraction))]


def train(head, samples: list[Sample], data: dict, config: TrainConfig, device: torch.device, log_fn: LogFn,
          checkpoint: Callable[[int, dict], None] | None = None) -> dict:
    """AdamW with warmup and cosine decay over config.steps steps (fewer under config.train_minutes); returns the
    last held-out metrics, and calls `checkpoint(step, metrics)` at every evaluation."""
    rng = random.Random(config.seed)
    held, train_idx = split_held_out(samples, rng)
    train_idx = training_share(train_idx, config.train_fraction, config.batch_size)
    log_fn({"event": "split", "held_out": len(held), "training": len(train_idx)})
    sub_index = subset_index(head)
    evaluate_held = lambda: evaluate(head, samples, data, held, sub_index, device, depth=config.depth,  # noqa: E731
                                     batch_size=config.batch_size, max_len=config.max_len, skip=config.skip)
    params = [p for p in head.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": config.weight_decay},  # not the norms
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95))
    total = [config.steps]  # shortened once the pace is known when --train-minutes sets a time budget
    warm = max(1, config.steps // 20)

    def lr_factor(s: int) -> float:  # a linear warm-up, then a cosine down to 0.1
        return min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, total[0]) / total[0])))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    gen = torch.Generator(device=device).manual_seed(config.seed)
    head.train()
    t0, cursor = time.perf_counter(), len(train_idx)
    metrics = evaluate_held()
    eval_seconds = time.perf_counter() - t0
    log_fn({"event": "eval", "step": 0, **metrics})
    step, t_train = 0, time.perf_counter()
    while step < total[0]:
        step += 1
        if step == 11:
            t_warm = time.perf_counter()
        if step == 31 and config.train_minutes:  # the pace after 10 warm-up steps: a GPU's first steps are far slower
            now = time.perf_counter()
            pace = (now - t_warm) / 20 + eval_seconds / config.eval_every  # evaluations count too
            left = config.train_minutes * 60 - (now - t_train)
            total[0] = max(step, min(config.steps, step - 1 + int(left / pace)))
            log_fn({"event": "budget", "seconds_per_step": round(pace, 3), "steps": total[0]})
        if cursor + config.batch_size > len(train_idx):
            rng.shuffle(train_idx)
            cursor = 0
        idx = train_idx[cursor : cursor + config.batch_size]
        cursor += config.batch_size
        feats, tokens, labels, valid, t = padded_batch(samples, data, idx, config.max_len, config.skip,
                                                       config.depth, sub_index, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.train_dtype == "bf16"):
            res = losses(head, feats, tokens, labels, valid, t, config.depth, config.noise, config.feat_weight, gen,
                         config.soft_weight)
        loss = sum((config.decay ** d) * (ce + fl) for d, (ce, fl, _, _) in enumerate(res))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % config.log_every == 0 or step == total[0]:
            log_fn({"event": "train", "step": step, "loss": round(loss.item(), 4),
                    "ce": [round(r[0].item(), 3) for r in res], "feat": [round(r[1].item(), 4) for r in res],
                    "acc": [round(float(r[2].float().mean()), 3) for r in res],
                    "lr": round(sched.get_last_lr()[0], 6), "seconds": round(time.perf_counter() - t0, 1)})
        if step % config.eval_every == 0 or step == total[0]:
            metrics = evaluate_held()
            log_fn({"event": "eval", "step": step, **metrics, "seconds": round(time.perf_counter() - t0, 1)})
            if checkpoint is not None:  # a usable asset at every evaluation, in case the run is cut short
                checkpoint(step, metrics)
    return metrics
