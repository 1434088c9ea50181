"""The one decoder: B prompts decoded together, one target pass per step for all of them; B = 1 is the ordinary case
and autoregressive decoding is the engine with no drafter.

Each row drafts with the drafter's state for it, accepts its own number of tokens (verify's rules) and finishes on
its own (EOS, stop string, length). Yields a BatchEvent per step; `speculative` and `autoregressive` give one row's
StepEvents. No UI, no metrics beyond per-step timings.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from ..config import MAX_K_ENGINE, GenerationConfig, SamplingConfig
from ..drafters.base import Drafter, DraftRequest, Proposal, Verdict
from .events import BatchEvent, Committer, StepEvent, check_request, eos_ids
from .kv import BatchKV, check_cache, left_padded, right_padded
from .timing import Clock
from .verify import (
    ACCEPT_RULES,
    greedy_accept_batch,
    inspect_verify,
    logits_to_probs,
)

KPolicy = Callable[[int], int]  # the current batch size -> k (0: no speculation this step)


def seeded_generator(device: torch.device, seed: int) -> torch.Generator:
    """The explicit torch.Generator a row samples from (its own, so a seed reproduces the run)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


class _Rows:
    """The rows still decoding: their prompt index, committer and generator (row i samples from seed + i)."""

    def __init__(self, tokenizer, prompts: Sequence[list[int]], config: GenerationConfig, eos: frozenset[int],
                 device: torch.device, text: bool):
        self.index = list(range(len(prompts)))
        self.out = [Committer(tokenizer, p, config, eos, text) for p in prompts]
        self.gens = [seeded_generator(device, config.seed + i) for i in range(len(prompts))]
        self.generated = 0

    def __len__(self) -> int:
        return len(self.index)

    def commit(self, tokens: Sequence[list[int]]) -> list[tuple[list[int], str]]:
        """Each row's (kept tokens, text delta)."""
        done = [out.commit(t) for out, t in zip(self.out, tokens)]
        self.generated += sum(len(k) for k, _ in done)
        return done

    def unfinished(self) -> list[int]:
        """Positions of rows that have not finished."""
        return [r for r, out in enumerate(self.out) if out.finish_reason is None]

    def select(self, rows: list[int]) -> None:
        self.index = [self.index[r] for r in rows]
        self.out = [self.out[r] for r in rows]
        self.gens = [self.gens[r] for r in rows]


def _choose(logits: torch.Tensor, sampling: SamplingConfig, gens) -> list[int]:
    """The next token of each row from logits (B, V): one argmax when greedy, else a sample per row."""
    if sampling.greedy:
        return logits.argmax(-1).tolist()
    probs = logits_to_probs(logits, sampling)
    return [int(torch.multinomial(p, 1, generator=g)) for p, g in zip(probs, gens)]


@dataclass
class _Verified:
    """One row's verdict from a verify pass."""

    num_accepted: int
    next_token: int
    inspected: dict


def _verify(logits: torch.Tensor, tokens: torch.Tensor, drafted: list[list[int]], proposals: list[Proposal],
            sampling: SamplingConfig, gens, inspect: bool) -> list[_Verified]:
    """Each row's acceptance from the verify pass: logits (B, W, V), tokens (B, W) = pending token + drafts."""
    lengths = [len(d) for d in drafted]
    if sampling.greedy:
        accepted, nxt = greedy_accept_batch(tokens[:, 1:], torch.tensor(lengths, device=tokens.device), logits)
        probs = None
    else:
        probs = logits_to_probs(logits, sampling)  # (B, W, V)
        accept = ACCEPT_RULES[sampling.verification]
        accepted, nxt = [], []
        for r, (n, p) in enumerate(zip(lengths, proposals)):
            q = p.probs[:n].to(probs.device) if p.probs is not None else None
            a, t = accept(tokens[r, 1 : 1 + n], q, probs[r, : n + 1], gens[r])
            accepted.append(a)
            nxt.append(t)
    out = []
    for r, n in enumerate(lengths):
        seen = {}
        if inspect:
            seen = inspect_verify(logits[r, : n + 1], None if probs is None else probs[r, : n + 1],
                                  tokens[r, 1 : 1 + n])
        out.append(_Verified(accepted[r], nxt[r], seen))
    return out


@torch.inference_mode()
def decode(target, tokenizer, prompts: Sequence[list[int]], config: GenerationConfig, drafter: Drafter | None = None,
           *, k_policy: KPolicy | None = None, inspect: bool = False, text: bool = True) -> Iterator[BatchEvent]:
    """Decode every prompt; with a drafter, each row drafts up to k tokens and one target pass verifies every row's
    drafts (B x (k+1) positions, padded for rows that drafted fewer), each row keeping its agreed prefix plus the
    target's own next token. Without one, one target pass per token.

    k is config.num_draft_tokens, or k_policy(rows still decoding) at every step when given; with config.dynamic_k
    each row adapts its own k. `inspect` fills each spec StepEvent's target_* fields from the verify logits; `text`
    gives each StepEvent its text delta (stop strings are honoured either way). Finished rows leave the batch after
    the step that ends them.
    """
    check_request(prompts, config)
    check_cache(target, len(prompts))
    kv = BatchKV(target, len(prompts))
    device = kv.device  # where the input ids go, under a device map too
    clock = Clock(device)
    eos = eos_ids(target, tokenizer)
    sampling = config.sampling
    rows = _Rows(tokenizer, prompts, config, eos, device, text)
    layers = tuple(drafter.target_layers) if drafter is not None and drafter.needs_target_hidden else None

    def event(kind: str, done, draft_seconds=0.0, verify_seconds=0.0, k=0, width=1, ks=None, drafted=None,
              verified=None, proposals=None) -> BatchEvent:
        steps = []
        for r, (kept, delta) in enumerate(done):
            out = rows.out[r]
            step = StepEvent(kind, kept, delta, clock.total, out.num_generated, draft_seconds=draft_seconds,
                             verify_seconds=verify_seconds, finish_reason=out.finish_reason,
                             target_cache_length=kv.counts[r])
            if verified is not None:
                d, v, p = drafted[r], verified[r], proposals[r]
                full = v.num_accepted == len(d)
                step.drafted, step.num_accepted, step.k = d, v.num_accepted, ks[r]
                step.correction = None if full else v.next_token
                step.bonus = v.next_token if full and d else None
                step.draft_token_probs = p.token_probs[: len(d)] if p.token_probs is not None else None
                step.draft_source = p.source
                step.verification = sampling.rule
                for name, value in v.inspected.items():
                    setattr(step, name, value)
            steps.append(step)
        return BatchEvent(kind, list(rows.index), steps, clock.total, rows.generated, draft_seconds, verify_seconds,
                          k, width, kv)

    clock.start()  # prefill: each row's first token, the same with or without a drafter
    tokens, real = left_padded(prompts, device)
    logits, features = kv.forward(tokens, real, 1, layers)
    chosen = _choose(logits[:, -1], sampling, rows.gens)
    if drafter is not None:
        hidden = None if features is None else [features[r, tokens.shape[1] - len(p):] for r, p in enumerate(prompts)]
        drafter.begin(prompts, hidden)
    done = rows.commit([[t] for t in chosen])
    dt = clock.stop()
    yield event("prefill", done, verify_seconds=dt)
    row_k = [config.num_draft_tokens] * len(prompts)
    while True:
        clock.start()
        keep = rows.unfinished()
        if not keep:
            clock.stop()
            return
        if len(keep) < len(rows):
            rows.select(keep)
            kv.select(keep)
            if drafter is not None:
                drafter.select(keep)
            row_k = [row_k[r] for r in keep]
            chosen = [chosen[r] for r in keep]
        if drafter is None:  # autoregressive: feed each row's new token
            x = torch.tensor(chosen, device=device)[:, None]
            chosen = _choose(kv.forward(x, torch.ones_like(x, dtype=torch.bool), 1)[0][:, -1], sampling, rows.gens)
            done = rows.commit([[t] for t in chosen])
            dt = clock.stop()
            yield event("ar", done, verify_seconds=dt)
            continue

        if k_policy is not None:
            row_k = [k_policy(len(rows))] * len(rows)
        ids = [out.ids for out in rows.out]  # ids[r][-1] is pending: not yet in the target's cache
        ks = [max(0, min(k, config.max_new_tokens - out.num_generated - 1)) for k, out in zip(row_k, rows.out)]
        proposals = (drafter.propose(DraftRequest(ids, ks, sampling, rows.gens, eos)) if max(ks) > 0
                     else [Proposal([]) for _ in ks])
        drafted = [p.tokens[:k] for p, k in zip(proposals, ks)]
        draft_seconds = clock.stop()

        clock.start()
        tokens, real = right_padded([[row[-1]] + d for row, d in zip(ids, drafted)], device)
        width = tokens.shape[1]
        before = list(kv.counts)
        logits, features = kv.forward(tokens, real, width, layers)  # (B, W, V)
        verified = _verify(logits, tokens, drafted, proposals, sampling, rows.gens, inspect)
        kv.keep([n + 1 + v.num_accepted for n, v in zip(before, verified)])  # the pending token and accepted drafts
        new = [d[: v.num_accepted] + [v.next_token] for d, v in zip(drafted, verified)]
        drafter.update([Verdict(v.num_accepted, row + n, None if features is None else features[r, : v.num_accepted + 1])
                        for r, (v, row, n) in enumerate(zip(verified, ids, new))])
        done = rows.commit(new)
        kv.compact()
        verify_seconds = clock.stop()
        yield event("spec", done, draft_seconds, verify_seconds, max(ks), width, ks, drafted, verified, proposals)
        if config.dynamic_k and k_policy is None:  # transformers' heuristic per row: +2 after a full acceptance, else -1
            row_k = [(min(k + 2, MAX_K_ENGINE) if v.num_accepted == len(d) == k else max(1, k - 1)) if d else k
                     for k, v, d in zip(row_k, verified, drafted)]


def speculative(target, tokenizer, drafter: Drafter, prompt_ids: list[int], config: GenerationConfig,
                inspect: bool = True) -> Iterator[StepEvent]:
    """One prompt's speculative decoding (decode at B = 1), as StepEvents, inspected unless asked not to."""
    for e in decode(target, tokenizer, [prompt_ids], config, drafter, inspect=inspect):
        yield e.steps[0]


def autoregressive(target, tokenizer, prompt_ids: list[int], config: GenerationConfig) -> Iterator[StepEvent]:
    """One prompt's plain decoding: one target pass per token (decode at B = 1 with no drafter)."""
    for e in decode(target, tokenizer, [prompt_ids], config):
        yield e.steps[0]
