"""Stage 1: the target's answers to the instructions, stage by stage, cached batch by batch in work/samples.jsonl so
that a rerun resumes; with `record`, the answering passes also keep the features and greedy labels build_features
would compute. Knows the instructions and the decode kernels; nothing of training.
"""

from __future__ import annotations

import collections
import json
import random
import time
from pathlib import Path

import torch

from ..engine import eos_ids
from ..engine.kv import target_features, with_cache
from ..models.kernels import decode_cache, grouped_attention_on, left_pad
from .config import LogFn, Sample, TrainConfig
from .instructions import (
    OPENINGS,
    paragraph_prompts,
    read_instructions,
    read_jsonl,
    self_instructions,
    templated_prompts,
    text_prompts,
)

RECORDED = "recorded"  # per-batch features and labels of a --features writer run, until features.pt holds them
PARAGRAPH_TOKENS = 160
STEERED_TOKENS = 128  # room for the text or code a steered instruction brings along

def pad_id(tokenizer) -> int:
    """The id that fills left padding: the pad token, or EOS for a tokenizer without one (transformers 5.17 converts
    the bundled GGUF's tokenizer without one). Padded positions are masked, so only the shapes depend on it."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def prompt_ids(tokenizer, convs: list[list[dict]]) -> list[list[int]]:
    """Each conversation's chat-templated prompt, ending with the assistant turn's opening."""
    texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in convs]
    return [tokenizer(t, add_special_tokens=False).input_ids for t in texts]


def _until_eos(answer: list[int], stops: frozenset[int]) -> list[int]:
    """The answer up to and including its first EOS: the draft should learn when answers end."""
    end = next((i for i, t in enumerate(answer) if t in stops), None)
    return answer if end is None else answer[: end + 1]


def generate_answers(target, tokenizer, convs: list[list[dict]], max_new_tokens: int, batch_size: int,
                     sample_temp: float = 0.0, seed: int = 0) -> list[Sample]:
    """Batched `generate` with left padding; returns {ids, prompt_len} per conversation, in order."""
    pad, stops = pad_id(tokenizer), eos_ids(target, tokenizer)
    prompts = prompt_ids(tokenizer, convs)
    results = []
    for start in range(0, len(prompts), batch_size):
        rows = prompts[start : start + batch_size]
        x, mask = left_pad(rows, pad, target.device)
        kw = (dict(do_sample=True, temperature=sample_temp, top_k=0, top_p=1.0) if sample_temp > 0
              else dict(do_sample=False))
        torch.manual_seed(seed + start)
        with torch.inference_mode():
            out = target.generate(input_ids=x, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad,
                                  **kw)
        for prompt, answer in zip(rows, out[:, x.shape[1] :].tolist()):
            results.append({"ids": prompt + _until_eos(answer, stops), "prompt_len": len(prompt)})
    return results


@torch.inference_mode()
def generate_recorded(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, sample_temp: float = 0.0,
                      seed: int = 0, layers: tuple[int, ...] = ()) -> tuple[list[Sample], list[tuple[torch.Tensor, torch.Tensor]]]:
    """One batch of prompts (token ids, `prompt_ids`) answered as `generate_answers` does, decoded here step by step,
    so that the passes that write the answers also give what `build_features` would record: the final hidden state
    (fp16; then each of `layers`' hidden states, as engine.target_features lays them out) and the greedy token (the
    label, also where a token was sampled) at every position. Returns ({ids, prompt_len} per prompt, in order, and
    (features (n, W), top1 (n,)) for each). One pass more than `generate`: the last token is fed too. On a CPU it
    decodes with the kernels of specdemo.models.kernels.decode."""
    stops = eos_ids(model, tokenizer)
    b, width, dev = len(prompts), max(map(len, prompts)), model.device
    x, mask = left_pad(prompts, pad_id(tokenizer), dev)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = decode_cache(model, width + max_new_tokens + 1)
    head = model.get_output_embeddings()
    gen = torch.Generator(device=dev).manual_seed(seed)
    answers: list[list[int]] = [[] for _ in range(b)]
    done = [False] * b
    with grouped_attention_on(model):
        h, f = target_features(model, layers, input_ids=x, attention_mask=mask, position_ids=pos, use_cache=True,
                               **with_cache(model.model, cache))
        feats = [f.half().cpu()]
        tops = [torch.stack([head(h[r]).argmax(-1) for r in range(b)]).int().cpu()]  # row by row: (T, V) logits each
        logits = head(h[:, -1]).float()
        for _ in range(max_new_tokens):
            if sample_temp > 0:
                tok = torch.multinomial(torch.softmax(logits / sample_temp, -1), 1, generator=gen)[:, 0]
            else:
                tok = logits.argmax(-1)
            for r, t in enumerate(tok.tolist()):
                if not done[r]:
                    answers[r].append(t)
                    done[r] = t in stops or len(answers[r]) == max_new_tokens
            mask = torch.cat([mask, torch.ones(b, 1, dtype=mask.dtype, device=dev)], dim=1)  # finished rows: unused
            pos = pos[:, -1:] + 1
            h, f = target_features(model, layers, input_ids=tok[:, None], attention_mask=mask, position_ids=pos,
                                   use_cache=True, **with_cache(model.model, cache))
            logits = head(h[:, -1]).float()
            feats.append(f.half().cpu())
            tops.append(logits.argmax(-1, keepdim=True).int().cpu())
            if all(done):  # every answer's last token has been fed
                break
    feats_all, tops_all = torch.cat(feats, dim=1), torch.cat(tops, dim=1)  # (B, width + fed, H), (B, width + fed)
    samples, recorded = [], []
    for r, (p, a) in enumerate(zip(prompts, answers)):
        lo, hi = width - len(p), width + len(a)
        samples.append({"ids": p + a, "prompt_len": len(p)})
        recorded.append((feats_all[r, lo:hi].clone(), tops_all[r, lo:hi].clone()))
    return samples, recorded


def run_stage(name: str, convs: list[list[dict]], target, tokenizer, max_new_tokens: int, batch_size: int,
              temp: float, seed: int, path: Path, samples: list[Sample], log_fn: LogFn, max_sequences: int = 0,
              record: bool = False, layers: tuple[int, ...] = (), deadline: float = 0.0) -> None:
    """Generate answers for the conversations of a stage that are not cached yet, saving after each batch to `path`
    and appending them to `samples` (the cache read so far).

    With `record`, the batches go shortest prompt first (left padding then wastes little: the written requests,
    64 tokens on average, were padded to 164 in file order, and the prefill is half of a batch's time on a CPU), and
    each batch's features (with `layers`' hidden states) and labels are saved beside the samples (`RECORDED`), for
    `build_features` to read. No batch starts after `deadline` (time.perf_counter(); 0: none)."""
    have = sum(s["stage"] == name for s in samples)
    # What is cached is found by its prompt, not its count: a stage whose list grew (a new instructions file) sorts
    # differently shortest first, and a stage cached by one --features mode may be resumed by the other. Copies are
    # counted, since a templated stage may hold the same conversation twice.
    ids = prompt_ids(tokenizer, convs)
    cached = collections.Counter(tuple(s["ids"][: s["prompt_len"]]) for s in samples if s["stage"] == name)
    todo = []
    for i, p in enumerate(map(tuple, ids)):
        if cached[p]:
            cached[p] -= 1
        else:
            todo.append(i)
    if record:
        todo.sort(key=lambda i: len(ids[i]))  # stable: ties stay in file order
    for j in range(0, len(todo), batch_size):
        if max_sequences and len(samples) >= max_sequences or deadline and time.perf_counter() >= deadline:
            return  # a budget: stop at a batch boundary
        t0 = time.perf_counter()
        start = have + j  # sequences of the stage before this batch: names its file and seeds its sampling
        batch = todo[j : j + batch_size]
        if record:
            new, recorded = generate_recorded(target, tokenizer, [ids[i] for i in batch], max_new_tokens, temp,
                                              seed + start, layers)
            (path.parent / RECORDED).mkdir(exist_ok=True)
            file = f"{name}-{start:06d}.pt"
            torch.save(recorded, path.parent / RECORDED / file)
            for row, s in enumerate(new):
                s["recorded"] = [file, row, list(layers)]
        else:
            new = generate_answers(target, tokenizer, [convs[i] for i in batch], max_new_tokens, batch_size, temp,
                                   seed + start)
        with path.open("a") as f:
            for s in new:
                s["stage"] = name
                f.write(json.dumps(s) + "\n")
        samples.extend(new)
        log_fn({"event": "generated", "stage": name, "sequences": start + len(new), "of": len(convs),
                "seconds": round(time.perf_counter() - t0, 1),
                "answer_tokens": sum(len(s["ids"]) - s["prompt_len"] for s in new)})


def build_data(target, tokenizer, work: Path, config: TrainConfig, log_fn: LogFn) -> list[Sample]:
    """All training sequences (prompt + target answer), generated once by `target` (the --gen-dtype copy) and cached
    batch by batch in work/samples.jsonl: paragraphs, the templated instructions, then the self-written, steered and
    file-given ones (config.instructions, the stage "written"), until config.max_sequences or config.data_minutes
    (at a batch boundary; with `record` the written requests go shortest first, so a cut keeps the shorter ones).
    With config.features "writer", the answering passes also keep their features and labels (`run_stage`'s
    `record`)."""
    written = read_instructions(config.instructions)
    seed, scale, tokens, batch_size, limit = (config.seed, config.scale, config.max_new_tokens, config.gen_batch_size,
                                              config.max_sequences)
    deadline = time.perf_counter() + config.data_minutes * 60 if config.data_minutes else 0.0
    path = work / "samples.jsonl"
    samples = read_jsonl(path)
    rng = random.Random(seed)
    simple, sampled = templated_prompts(rng, seed, scale)
    gen = lambda stage, convs, n_tokens, temp: run_stage(  # noqa: E731
        stage, convs, target, tokenizer, n_tokens, batch_size, temp, seed, path, samples, log_fn, limit,
        config.features == "writer", config.layers, deadline)
    full = lambda: bool(limit and len(samples) >= limit or deadline and time.perf_counter() >= deadline)  # noqa: E731
    gen("paragraph", paragraph_prompts(), PARAGRAPH_TOKENS, 0.0)
    paragraphs = [tokenizer.decode(s["ids"][s["prompt_len"]:], skip_special_tokens=True).strip()
                  for s in samples if s["stage"] == "paragraph"]
    gen("text", [m for _, m in text_prompts(rng, paragraphs, scale)], tokens, 0.0)
    gen("simple", [m for _, m in simple], tokens, 0.0)
    gen("sampled", [m for _, m in sampled], tokens, 0.8)
    if config.self_instruct and not full():
        own = self_instructions(target, tokenizer, config.self_instruct, batch_size, seed, work / "instructions.jsonl",
                                log_fn)
        gen("self", [[{"role": "user", "content": x}] for x in own], tokens, 0.0)
    if config.steered_instruct and not full():
        own = self_instructions(target, tokenizer, config.steered_instruct, batch_size, seed + 1,
                                work / "steered.jsonl", log_fn, max_tokens=STEERED_TOKENS, openings=OPENINGS)
        gen("steered", [[{"role": "user", "content": x}] for x in own], tokens, 0.0)
    if written and not full():
        gen("written", [[{"role": "user", "content": x}] for x in written], tokens, 0.0)
    return samples
