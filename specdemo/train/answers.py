"""Stage 1: the target's answers to the instructions, stage by stage, cached batch by batch in work/samples.jsonl so
that a rerun resumes; with `record`, the answering passes also keep the features and greedy labels build_features
would compute. Answers come from the engine. Knows the instructions; nothing of training.
"""

from __future__ import annotations

import collections
import json
import random
import time
from pathlib import Path

import torch

from ..config import GenerationConfig, SamplingConfig
from ..engine import decode, eos_ids, row_outputs
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
from .recorder import Recorder

RECORDED = "recorded"  # per-batch features and labels of a --features writer run, until features.pt holds them
PARAGRAPH_TOKENS = 160
STEERED_TOKENS = 128  # room for the text or code a steered instruction brings along


def prompt_ids(tokenizer, convs: list[list[dict]]) -> list[list[int]]:
    """Each conversation's chat-templated prompt, ending with the assistant turn's opening."""
    texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in convs]
    return [tokenizer(t, add_special_tokens=False).input_ids for t in texts]


def _until_eos(answer: list[int], stops: frozenset[int]) -> list[int]:
    """The answer up to and including its first EOS: the draft should learn when answers end."""
    end = next((i for i, t in enumerate(answer) if t in stops), None)
    return answer if end is None else answer[: end + 1]


def _sampling(sample_temp: float) -> SamplingConfig:
    """Greedy at 0, else plain sampling at that temperature (no top-k, no top-p)."""
    return SamplingConfig(temperature=sample_temp) if sample_temp > 0 else SamplingConfig()


def generate_answers(target, tokenizer, convs: list[list[dict]], max_new_tokens: int, batch_size: int,
                     sample_temp: float = 0.0, seed: int = 0) -> list[Sample]:
    """The engine's answers (no drafter), batch_size conversations at a time; returns {ids, prompt_len} per
    conversation, in order. Row r of the batch that starts at conversation i samples from seed + i + r."""
    prompts = prompt_ids(tokenizer, convs)
    results = []
    for start in range(0, len(prompts), batch_size):
        rows = prompts[start : start + batch_size]
        config = GenerationConfig(max_new_tokens=max_new_tokens, sampling=_sampling(sample_temp), seed=seed + start)
        events = list(decode(target, tokenizer, rows, config, text=False))  # an answer ends with its EOS, if any
        results += [{"ids": p + a, "prompt_len": len(p)} for p, a in zip(rows, row_outputs(events, len(rows)))]
    return results


def generate_recorded(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, sample_temp: float = 0.0,
                      seed: int = 0, layers: tuple[int, ...] = ()
                      ) -> tuple[list[Sample], list[tuple[torch.Tensor, torch.Tensor]]]:
    """One batch of prompts (token ids, `prompt_ids`) answered by the engine with a `Recorder`, so that the passes
    that write the answers also give what `build_features` would record: the final hidden state (fp16; then each of
    `layers`' hidden states, as engine.kv.target_features lays them out) and the greedy token (the label, also where a
    token was sampled; row r samples from seed + r) at every position. Returns ({ids, prompt_len} per prompt, in
    order, and (features (n, W), top1 (n,)) for each).

    An answer's last token must be fed too, for its position's features: the engine decodes one token more than
    asked and does not stop at EOS (a finished row leaves the batch before its last token is fed); each answer is
    then cut at max_new_tokens and after its first EOS."""
    stops = eos_ids(model, tokenizer)
    recorder = Recorder(model.get_output_embeddings(), model.config.hidden_size, layers)
    # k = 1 so that the engine asks the recorder (which drafts nothing) every step and hands it the features
    config = GenerationConfig(max_new_tokens=max_new_tokens + 1, num_draft_tokens=1, sampling=_sampling(sample_temp),
                              seed=seed, ignore_eos=True)
    events = list(decode(model, tokenizer, prompts, config, recorder, text=False))
    samples, recorded = [], []
    for r, (p, answer) in enumerate(zip(prompts, row_outputs(events, len(prompts)))):
        a = _until_eos(answer[:max_new_tokens], stops)
        samples.append({"ids": p + a, "prompt_len": len(p)})
        recorded.append(recorder.recorded(r, len(p) + len(a)))
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
