"""Batched decoding: B prompts of different lengths decoded together, one target pass per step for all of them.

A batched autoregressive decoder and a batched speculative one, both generators of BatchEvents over the same
machinery (BatchKV: a left-padded KV cache whose rows hold different numbers of valid positions). Each row drafts
with its own state (prompt lookup, a draft model or the EAGLE head, batched), accepts its own number of tokens and
finishes on its own (EOS, stop string, length; engine's committer). Acceptance uses verify's rules per row. No UI,
no metrics beyond per-step timings and the pass-cost micro-benchmark that auto k reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from .batch_drafters import BatchDrafter
from .batch_kv import BatchKV, check_cache, left_padded, right_padded
from .config import MAX_K_ENGINE, GenerationConfig, SamplingConfig
from .drafters import Proposal, Verdict
from .engine import Committer, GenerationError, check_request, eos_ids, seeded_generator
from .timing import Clock, timed_call
from .verify import logits_to_probs, rejection_accept

# ---- the decoders ----

@dataclass
class BatchEvent:
    """One batched step. Lists run over the rows in this pass (`rows` holds their prompt indices); `elapsed` is
    the run's own compute time so far, excluding time paused at `yield`."""

    kind: str  # "prefill", "ar" (one token per row) or "spec" (draft + verify)
    rows: list[int]
    tokens: list[list[int]]  # per row: tokens committed by this step (after EOS / stop / length truncation)
    text: list[str]  # per row: text delta, with stop strings only (else empty: decode row_outputs)
    elapsed: float
    num_generated: int  # committed new tokens over all rows after this step
    drafted: list[list[int]] = field(default_factory=list)  # spec: each row's proposal
    num_accepted: list[int] = field(default_factory=list)  # spec: drafted[r][:num_accepted[r]] were kept
    finished: dict[int, str] = field(default_factory=dict)  # prompt index -> "eos", "stop" or "length"
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    k: int = 0  # k asked of the drafter this step (0: no speculation)
    width: int = 1  # tokens per row in the target pass (1 + the longest proposal)
    cache_counts: list[int] = field(default_factory=list)  # per row: valid target KV positions after the step
    target_kv: BatchKV | None = field(default=None, repr=False, compare=False)  # for rollback checks only


class _TokenCommitter:
    """engine.Committer's EOS and length rules without its detokenizer, for runs with no stop strings: at a batch of
    64 on a GPU, two decodes per row per step would cost a sixth of a step, which generate() does not pay."""

    def __init__(self, prompt_ids: list[int], config: GenerationConfig, eos: frozenset[int]):
        self.ids = list(prompt_ids)
        self.num_prompt = len(prompt_ids)
        self.max_new_tokens = config.max_new_tokens
        self.eos = eos
        self.finish_reason: str | None = None

    @property
    def num_generated(self) -> int:
        return len(self.ids) - self.num_prompt

    def commit(self, tokens: list[int]) -> tuple[list[int], str]:
        kept = []
        for t in tokens:
            self.ids.append(t)
            kept.append(t)
            if t in self.eos:
                self.finish_reason = "eos"
            elif self.num_generated >= self.max_new_tokens:
                self.finish_reason = "length"
            if self.finish_reason:
                break
        return kept, ""


class _Rows:
    """The rows still decoding: their prompt index, committer (engine's EOS / stop / length rules; text deltas only
    where stop strings need them) and generator."""

    def __init__(self, tokenizer, prompts: Sequence[list[int]], config: GenerationConfig, eos: frozenset[int],
                 device: torch.device):
        self.index = list(range(len(prompts)))
        self.out = [Committer(tokenizer, p, config, eos) if config.stop_strings else _TokenCommitter(p, config, eos)
                    for p in prompts]
        self.gens = [seeded_generator(device, config.seed + i) for i in range(len(prompts))]
        self.generated = 0

    def __len__(self) -> int:
        return len(self.index)

    def commit(self, tokens: Sequence[list[int]]) -> tuple[list[list[int]], list[str], dict[int, str]]:
        kept, texts, finished = [], [], {}
        for i, out, t in zip(self.index, self.out, tokens):
            k, text = out.commit(t)
            kept.append(k)
            texts.append(text)
            self.generated += len(k)
            if out.finish_reason:
                finished[i] = out.finish_reason
        return kept, texts, finished

    def unfinished(self) -> list[int]:
        """Positions of rows that have not finished."""
        return [r for r, out in enumerate(self.out) if out.finish_reason is None]

    def select(self, rows: list[int]) -> None:
        self.index = [self.index[r] for r in rows]
        self.out = [self.out[r] for r in rows]
        self.gens = [self.gens[r] for r in rows]


def _check_batch(prompts: Sequence[list[int]], config: GenerationConfig) -> None:
    if not prompts:
        raise GenerationError("the batch is empty; give at least one prompt")
    for p in prompts:
        check_request(p, config)


def _prefill(kv: BatchKV, prompts: Sequence[list[int]], layers: tuple[int, ...] | None):
    """One left-padded pass over every prompt: logits (B, V) at each row's last token, and each row's features."""
    tokens, real = left_padded(prompts, kv.device)
    logits, features = kv.forward(tokens, real, 1, layers)
    hidden = None if features is None else [features[r, tokens.shape[1] - len(p):] for r, p in enumerate(prompts)]
    return logits[:, -1], hidden


def _choose(logits: torch.Tensor, sampling: SamplingConfig, gens) -> list[int]:
    """The next token of each row from logits (B, V): one argmax when greedy, else a sample per row."""
    if sampling.greedy:
        return logits.argmax(-1).tolist()
    probs = logits_to_probs(logits, sampling)
    return [int(torch.multinomial(p, 1, generator=g)) for p, g in zip(probs, gens)]


@torch.inference_mode()
def batch_autoregressive(target, tokenizer, prompts: Sequence[list[int]],
                         config: GenerationConfig) -> Iterator[BatchEvent]:
    """Plain decoding of a padded batch: one target pass per token for every row; finished rows leave the batch."""
    _check_batch(prompts, config)
    check_cache(target)
    kv = BatchKV(target, len(prompts))
    device = kv.device  # where the input ids go, under a device map too
    clock = Clock(device)
    rows = _Rows(tokenizer, prompts, config, eos_ids(target, tokenizer), device)
    kind = "prefill"
    clock.start()
    logits, _ = _prefill(kv, prompts, None)
    while True:
        chosen = _choose(logits, config.sampling, rows.gens)
        kept, texts, finished = rows.commit([[t] for t in chosen])
        dt = clock.stop()
        yield BatchEvent(kind, list(rows.index), kept, texts, clock.total, rows.generated, finished=finished,
                         verify_seconds=dt, cache_counts=list(kv.counts), target_kv=kv)
        clock.start()
        keep = rows.unfinished()
        if not keep:
            clock.stop()
            return
        if len(keep) < len(rows):
            rows.select(keep)
            kv.select(keep)
            chosen = [chosen[r] for r in keep]
        x = torch.tensor(chosen, device=kv.device)[:, None]
        logits = kv.forward(x, torch.ones_like(x, dtype=torch.bool), 1)[0][:, -1]
        kind = "ar"


def greedy_accept_batch(drafted: torch.Tensor, lengths: torch.Tensor,
                        logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """verify.greedy_accept for every row at once: drafted (B, W-1) with lengths (B,) real drafts, logits (B, W, V)
    -> (num_accepted per row, next token per row)."""
    choice = logits.argmax(-1)  # (B, W)
    w = drafted.shape[1]
    real = torch.arange(w, device=drafted.device)[None, :] < lengths[:, None]
    matches = ((drafted == choice[:, :w]) & real).int()
    accepted = matches.cumprod(dim=1).sum(dim=1)  # (B,)
    nxt = choice.gather(1, accepted[:, None])[:, 0]
    return accepted.tolist(), nxt.tolist()


KPolicy = Callable[[int], int]  # the current batch size -> k (0: no speculation this step)


@torch.inference_mode()
def batch_speculative(target, tokenizer, drafter: BatchDrafter, prompts: Sequence[list[int]],
                      config: GenerationConfig, k_policy: KPolicy | None = None) -> Iterator[BatchEvent]:
    """Each row drafts up to k tokens, one target pass verifies every row's drafts (B x (k+1) positions, padded for
    rows that drafted fewer), each row keeps its agreed prefix plus the target's own next token.

    k is config.num_draft_tokens, or k_policy(rows still decoding) at every step when given (see AutoK); with
    config.dynamic_k each row adapts its own k. Finished rows leave the batch after the step that ends them.
    """
    _check_batch(prompts, config)
    check_cache(target)
    kv = BatchKV(target, len(prompts))
    device = kv.device  # where the input ids go, under a device map too
    clock = Clock(device)
    eos = eos_ids(target, tokenizer)
    sampling = config.sampling
    rows = _Rows(tokenizer, prompts, config, eos, device)
    layers = tuple(drafter.target_layers) if drafter.needs_target_hidden else None

    clock.start()  # prefill: each row's first token, exactly as in batch_autoregressive
    logits, hidden = _prefill(kv, prompts, layers)
    chosen = _choose(logits, sampling, rows.gens)
    drafter.begin(prompts, hidden)
    kept, texts, finished = rows.commit([[t] for t in chosen])
    dt = clock.stop()
    yield BatchEvent("prefill", list(rows.index), kept, texts, clock.total, rows.generated, finished=finished,
                     verify_seconds=dt, cache_counts=list(kv.counts), target_kv=kv)
    row_k = [config.num_draft_tokens] * len(prompts)
    while True:
        clock.start()
        keep = rows.unfinished()
        if not keep:
            clock.stop()
            return
        if len(keep) < len(rows):
            for part in (rows, kv, drafter):
                part.select(keep)
            row_k = [row_k[r] for r in keep]
        if k_policy is not None:
            row_k = [k_policy(len(rows))] * len(rows)
        ids = [out.ids for out in rows.out]  # ids[r][-1] is pending: not yet in the target's cache
        ks = [max(0, min(k, config.max_new_tokens - out.num_generated - 1)) for k, out in zip(row_k, rows.out)]
        proposals = (drafter.propose(ids, ks, sampling, rows.gens, eos) if max(ks) > 0
                     else [Proposal([]) for _ in ks])
        drafted = [p.tokens[:k] for p, k in zip(proposals, ks)]
        draft_seconds = clock.stop()

        clock.start()
        tokens, real = right_padded([[row[-1]] + d for row, d in zip(ids, drafted)], device)
        width = tokens.shape[1]
        before = list(kv.counts)
        logits, features = kv.forward(tokens, real, width, layers)  # (B, W, V)
        lengths = [len(d) for d in drafted]
        if sampling.greedy:
            accepted, nxt = greedy_accept_batch(tokens[:, 1:], torch.tensor(lengths, device=device), logits)
        else:
            accepted, nxt = [], []
            probs = logits_to_probs(logits, sampling)  # (B, W, V)
            for r, (d, p) in enumerate(zip(drafted, proposals)):
                q = p.probs[: len(d)] if p.probs is not None else None
                a, t = rejection_accept(tokens[r, 1: 1 + len(d)], q, probs[r, : len(d) + 1], rows.gens[r])
                accepted.append(a)
                nxt.append(t)
        kv.keep([n + 1 + a for n, a in zip(before, accepted)])  # the pending token and the accepted drafts
        new = [d[:a] + [t] for d, a, t in zip(drafted, accepted, nxt)]
        drafter.update([Verdict(a, row + n, None if features is None else features[r, : a + 1])
                        for r, (a, row, n) in enumerate(zip(accepted, ids, new))])
        kept, texts, finished = rows.commit(new)
        kv.compact()
        verify_seconds = clock.stop()
        yield BatchEvent("spec", list(rows.index), kept, texts, clock.total, rows.generated, drafted=drafted,
                         num_accepted=accepted, finished=finished, draft_seconds=draft_seconds,
                         verify_seconds=verify_seconds, k=max(ks), width=width, cache_counts=list(kv.counts),
                         target_kv=kv)
        if config.dynamic_k and k_policy is None:  # engine's heuristic, per row
            row_k = [(min(k + 2, MAX_K_ENGINE) if a == len(d) == k else max(1, k - 1)) if d else k
                     for k, a, d in zip(row_k, accepted, drafted)]


def row_outputs(events: Sequence[BatchEvent], num_rows: int) -> list[list[int]]:
    """Each prompt's committed tokens, by prompt index."""
    out: list[list[int]] = [[] for _ in range(num_rows)]
    for e in events:
        for i, t in zip(e.rows, e.tokens):
            out[i] += t
    return out


@dataclass
class BatchStats:
    """What one batched run achieved, pooled over its rows."""

    tokens: int
    seconds: float
    tokens_per_s: float  # all rows' tokens over the run's compute time
    steps: int = 0  # speculative target passes (prefill excluded)
    row_steps: int = 0  # (row, speculative pass) pairs: each row's own verify passes
    drafted: int = 0
    accepted: int = 0
    acceptance_rate: float = 0.0  # accepted drafts / drafted tokens
    mean_accepted: float = 0.0  # tokens per row per verify pass, bonus/correction included
    mean_width: float = 0.0  # tokens per row in a target pass (1 + the step's longest proposal)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    draft_positions: int = 0  # sum over steps of the longest proposal: sequential draft positions
    passes: int = 0  # target passes after the prefill (autoregressive or speculative steps)
    pass_seconds: float = 0.0  # their seconds (a speculative step's verify part: pass, acceptance, rollback)


def batch_stats(events: Sequence[BatchEvent]) -> BatchStats:
    """Summarize a finished batched run."""
    if not events:
        return BatchStats(0, 0.0, 0.0)
    tokens, seconds = events[-1].num_generated, events[-1].elapsed
    spec = [e for e in events if e.kind == "spec"]
    row_steps = sum(len(e.rows) for e in spec)
    drafted = sum(len(d) for e in spec for d in e.drafted)
    accepted = sum(sum(e.num_accepted) for e in spec)
    return BatchStats(
        tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
        steps=len(spec), row_steps=row_steps, drafted=drafted, accepted=accepted,
        acceptance_rate=accepted / drafted if drafted else 0.0,
        mean_accepted=sum(len(t) for e in spec for t in e.tokens) / row_steps if row_steps else 0.0,
        mean_width=sum(e.width for e in spec) / len(spec) if spec else 0.0,
        draft_seconds=sum(e.draft_seconds for e in spec), verify_seconds=sum(e.verify_seconds for e in spec),
        draft_positions=sum(max((len(d) for d in e.drafted), default=0) for e in spec),
        passes=sum(e.kind != "prefill" for e in events),
        pass_seconds=sum(e.verify_seconds for e in events if e.kind != "prefill"),
    )


# ---- costs and auto k ----

@torch.inference_mode()
def batch_forward_seconds(model, prompts: Sequence[list[int]], widths: Sequence[int],
                          repeats: int = 3) -> dict[int, float]:
    """{w: the best seconds of a B x w forward after the B prompts' padded cache} for each width and 1
    (timing.forward_seconds for a batch: widths take turns, round 0 warms up and is not counted)."""
    kv = BatchKV(model, len(prompts))
    _prefill(kv, prompts, None)
    counts = list(kv.counts)
    order = sorted(set(widths) | {1})
    seconds = {w: float("inf") for w in order}
    last = torch.tensor([p[-1] for p in prompts], device=kv.device)[:, None]
    for round_ in range(repeats + 1):
        for w in order:
            x = last.expand(-1, w).contiguous()  # the content does not change the cost
            real = torch.ones_like(x, dtype=torch.bool)
            _, dt = timed_call(lambda: kv.forward(x, real, w), kv.device)
            if round_:
                seconds[w] = min(seconds[w], dt)
            kv.keep(counts)
    return seconds


def verify_costs_from(seconds: dict[int, float], k_max: int) -> dict[int, float]:
    """{k: seconds of a (k+1)-wide pass / a 1-wide one} for k = 1..k_max, linear between the measured widths."""
    known = sorted((w, s / seconds[1]) for w, s in seconds.items())
    out = {}
    for k in range(1, k_max + 1):
        w = k + 1
        lo = max((x for x in known if x[0] <= w), key=lambda x: x[0])
        hi = min((x for x in known if x[0] >= w), key=lambda x: x[0], default=lo)
        out[k] = lo[1] if hi[0] == lo[0] else lo[1] + (hi[1] - lo[1]) * (w - lo[0]) / (hi[0] - lo[0])
    return out


def cost_widths(k_max: int) -> list[int]:
    """The widths the micro-benchmark measures for k up to k_max (as timing.verify_costs_for: 2..5, then sparser)."""
    return sorted({w for w in (2, 3, 4, 5, 7, 9, 13, 17) if w <= k_max + 1} | {k_max + 1})


@dataclass(frozen=True)
class AutoK:
    """k by batch size, chosen from measured costs (batch_sweep.calibrate): a KPolicy for batch_speculative.

    Between measured batch sizes it takes the largest measured one not above the current size (the smallest if none),
    so as rows finish and the batch shrinks, k follows."""

    by_batch_size: dict[int, int]

    def __call__(self, batch_size: int) -> int:
        sizes = sorted(self.by_batch_size)
        below = [b for b in sizes if b <= batch_size]
        return self.by_batch_size[below[-1] if below else sizes[0]]
