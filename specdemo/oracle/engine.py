"""Autoregressive and speculative decoders as generators of step events. KV caches and their rollback live here.

The decoders work on token ids; text comes from text.IncrementalDetokenizer only to honour stop strings
and to hand each event its text delta. No UI code, no metrics beyond per-step timings.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..config import MAX_K_ENGINE, GenerationConfig
from .drafters import Drafter, DraftRequest, Verdict, crop_cache, with_cache
from ..placement import execution_device
from ..engine.text import IncrementalDetokenizer, find_stop
from ..engine.timing import Clock
from ..engine.verify import choose, greedy_accept, logits_to_probs, rejection_accept


TOP_N = 5  # the target's most likely tokens recorded at each verified position, for the app's step inspector


class GenerationError(ValueError):
    """Bad input to a decoder (empty prompt, absurd k, ...); the message says what to change."""


@dataclass
class StepEvent:
    """One decoder step. `elapsed` is this run's own compute time so far, excluding time paused at `yield`."""

    kind: str  # "prefill" (first token), "ar" (one target pass, one token) or "spec" (draft + verify)
    tokens: list[int]  # tokens committed by this step (after EOS / stop / length truncation)
    text: str  # text delta for those tokens
    elapsed: float
    num_generated: int  # total committed new tokens after this step
    drafted: list[int] = field(default_factory=list)  # spec: the proposal, in order
    num_accepted: int = 0  # spec: drafted[:num_accepted] were kept
    correction: int | None = None  # spec: the target's token replacing drafted[num_accepted]
    bonus: int | None = None  # spec: the target's extra token after a full acceptance
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    k: int = 0  # k asked of the drafter this step
    finish_reason: str | None = None  # "eos", "stop" or "length" on the last event
    target_cache_length: int = 0  # positions in the target's KV cache after the step (for rollback checks)
    # spec, per verified position i = 0..len(drafted) (the last one is where the bonus comes from), read from the
    # verify pass's own logits: the target's TOP_N tokens and their probabilities p (the processed distribution that
    # rejection sampling uses; softmax at temperature 1 when greedy), and when greedy the top-2 logit gap
    target_top_ids: list[list[int]] = field(default_factory=list)
    target_top_probs: list[list[float]] = field(default_factory=list)
    target_top2_gap: list[float] = field(default_factory=list)
    target_token_probs: list[float] = field(default_factory=list)  # spec: p(x_i) of each drafted token
    draft_token_probs: list[float] | None = None  # spec: q(x_i) of each drafted token; None: deterministic (q = 1)

    @property
    def rejected(self) -> list[int]:
        """Drafted tokens that were thrown away (the first one is replaced by `correction`)."""
        return self.drafted[self.num_accepted :]


class Committer:
    """Appends tokens one at a time, stopping at EOS, a stop string or max_new_tokens; same rules for both decoders."""

    def __init__(self, tokenizer, prompt_ids: list[int], config: GenerationConfig, eos: frozenset[int]):
        self.ids = list(prompt_ids)
        self.num_prompt = len(prompt_ids)
        self.config = config
        self.eos = eos
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.finish_reason: str | None = None

    @property
    def num_generated(self) -> int:
        return len(self.ids) - self.num_prompt

    def commit(self, tokens: list[int]) -> tuple[list[int], str]:
        kept, text = [], ""
        for t in tokens:
            self.ids.append(t)
            kept.append(t)
            delta = self.detok.add(t)
            text += delta
            if t in self.eos:
                self.finish_reason = "eos"
            elif delta and find_stop(self.detok.text, self.config.stop_strings, len(delta)) >= 0:
                self.finish_reason = "stop"
            elif self.num_generated >= self.config.max_new_tokens:
                self.finish_reason = "length"
            if self.finish_reason:
                break
        if self.finish_reason:
            text += self.detok.flush()
        return kept, text


def eos_ids(model, tokenizer) -> frozenset[int]:
    """EOS ids from the generation config and the tokenizer."""
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return frozenset(ids)


def encode_prompt(tokenizer, prompt: str, use_chat_template: bool = True) -> list[int]:
    """Prompt ids, wrapped in the chat template when the tokenizer has one."""
    if not prompt or not prompt.strip():
        raise GenerationError("the prompt is empty; type something for the model to continue")
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        ids = ids["input_ids"] if isinstance(ids, dict) else ids
        return list(ids)
    return list(tokenizer(prompt)["input_ids"])


def check_request(prompt_ids: list[int], config: GenerationConfig) -> None:
    """Refuse an empty prompt or invalid settings with a GenerationError saying what to change."""
    if not prompt_ids:
        raise GenerationError("the prompt is empty; type something for the model to continue")
    try:
        config.validate()
    except ValueError as exc:
        raise GenerationError(str(exc)) from exc


def seeded_generator(device: torch.device, seed: int) -> torch.Generator:
    """The explicit torch.Generator a run samples from (its own, so a seed reproduces the run)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def target_features(model, layers: tuple[int, ...] = (), **inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(last_hidden_state (B, T, H), features (B, T, W)): the final hidden state, then the hidden state after each
    decoder layer in `layers` (EAGLE-3 style fusion; W = H * (1 + len(layers)))."""
    out = model.model(**inputs, output_hidden_states=bool(layers))
    last = out.last_hidden_state
    if not layers:
        return last, last
    return last, torch.cat([last] + [out.hidden_states[i] for i in layers], dim=-1)


def _target_pass(target, ids: list[int], cache, keep: int, layers: tuple[int, ...] | None):
    """Run the target on `ids` after its cache; return logits (keep, V) and, unless layers is None, features (len, W),
    both on the device of its input ids (under a device map the head may compute elsewhere)."""
    x, before = torch.tensor([ids], device=execution_device(target)), cache.get_seq_length()
    features = None
    if layers is not None:
        last, features = target_features(target, layers, input_ids=x, use_cache=True,
                                         **with_cache(target.model, cache))  # (1, T, .)
        logits, features = target.lm_head(last[:, -keep:])[0].to(x.device), features[0].to(x.device)
    else:
        logits = target(input_ids=x, **with_cache(target, cache), use_cache=True, logits_to_keep=keep).logits[0]
        logits = logits.to(x.device)
    if cache.get_seq_length() != before + len(ids):  # a forward that drops the cache would decode from nothing
        raise GenerationError(f"{type(target).__name__}'s forward did not fill the KV cache it was given "
                              f"({before} + {len(ids)} positions expected, {cache.get_seq_length()} held)")
    return logits, features


def inspect_verify(logits: torch.Tensor, target_probs: torch.Tensor | None, drafted: torch.Tensor) -> dict:
    """StepEvent's target_* fields from a verify pass: logits (k+1, V); target_probs (k+1, V) when sampling, None when
    greedy (then p is the softmax at temperature 1); drafted (k,). One topk, no extra forward pass."""
    k, n = drafted.shape[0], min(TOP_N, logits.shape[-1])
    rows = torch.arange(k, device=logits.device)
    if target_probs is None:
        logits = logits.float()
        top = torch.topk(logits, n, dim=-1)  # (k+1, n)
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # (k+1, 1)
        top_probs, token_probs = (top.values - lse).exp(), (logits[rows, drafted] - lse[:k, 0]).exp()
        gap = top.values[:, 0] - top.values[:, 1] if n > 1 else torch.zeros_like(lse[:, 0])
    else:
        top = torch.topk(target_probs, n, dim=-1)
        top_probs, token_probs, gap = top.values, target_probs[rows, drafted], None
    floats = torch.cat([top_probs.flatten(), token_probs] + ([gap] if gap is not None else [])).tolist()
    m = top_probs.numel()
    return {"target_top_ids": top.indices.tolist(),
            "target_top_probs": [floats[i : i + n] for i in range(0, m, n)],
            "target_token_probs": floats[m : m + k], "target_top2_gap": floats[m + k :]}


def _new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


@torch.inference_mode()
def autoregressive(target, tokenizer, prompt_ids: list[int], config: GenerationConfig) -> Iterator[StepEvent]:
    """Plain decoding with a KV cache: one target pass per token."""
    check_request(prompt_ids, config)
    device = execution_device(target)
    clock = Clock(device)
    gen = seeded_generator(device, config.seed)
    out = Committer(tokenizer, prompt_ids, config, eos_ids(target, tokenizer))
    cache = _new_cache(target)
    feed, kind = prompt_ids, "prefill"
    while out.finish_reason is None:
        clock.start()
        logits, _ = _target_pass(target, feed, cache, 1, None)
        token = choose(logits[-1], config.sampling, gen)
        kept, text = out.commit([token])
        dt = clock.stop()
        yield StepEvent(kind, kept, text, clock.total, out.num_generated, verify_seconds=dt,
                        finish_reason=out.finish_reason, target_cache_length=cache.get_seq_length())
        feed, kind = [token], "ar"


@torch.inference_mode()
def speculative(
    target, tokenizer, drafter: Drafter, prompt_ids: list[int], config: GenerationConfig
) -> Iterator[StepEvent]:
    """Draft k tokens, verify them in one target pass, keep the agreed prefix plus the target's own next token."""
    check_request(prompt_ids, config)
    device = execution_device(target)
    clock = Clock(device)
    gen = seeded_generator(device, config.seed)
    eos = eos_ids(target, tokenizer)
    out = Committer(tokenizer, prompt_ids, config, eos)
    cache = _new_cache(target)
    feature_layers = tuple(drafter.target_layers) if drafter.needs_target_hidden else None  # None: logits only
    sampling = config.sampling

    clock.start()  # prefill: the target's first token, exactly as in autoregressive()
    logits, hidden = _target_pass(target, prompt_ids, cache, 1, feature_layers)
    token = choose(logits[-1], sampling, gen)
    drafter.begin(prompt_ids, hidden)
    kept, text = out.commit([token])
    dt = clock.stop()
    yield StepEvent("prefill", kept, text, clock.total, out.num_generated, verify_seconds=dt,
                    finish_reason=out.finish_reason, target_cache_length=cache.get_seq_length())

    k = config.num_draft_tokens
    while out.finish_reason is None:
        ids = out.ids  # ids[-1] is pending: not yet in the target's cache
        k_step = min(k, config.max_new_tokens - out.num_generated - 1)  # no drafting past the length bound
        clock.start()
        proposal = drafter.propose(DraftRequest(ids, k_step, sampling, gen, eos)) if k_step > 0 else None
        drafted = proposal.tokens[:k_step] if proposal else []
        draft_seconds = clock.stop()

        clock.start()
        logits, hidden = _target_pass(target, [ids[-1]] + drafted, cache, len(drafted) + 1, feature_layers)
        draft_t = torch.tensor(drafted, dtype=torch.long, device=logits.device)
        if sampling.greedy:
            num_accepted, next_token = greedy_accept(draft_t, logits)
            inspected = inspect_verify(logits, None, draft_t)
        else:
            q = proposal.probs[: len(drafted)].to(logits.device) if proposal and proposal.probs is not None else None
            p = logits_to_probs(logits, sampling)
            num_accepted, next_token = rejection_accept(draft_t, q, p, gen)
            inspected = inspect_verify(logits, p, draft_t)
        crop_cache(cache, len(ids) + num_accepted)  # keep the pending token and the accepted drafts
        new_ids = ids + drafted[:num_accepted] + [next_token]
        drafter.update(Verdict(num_accepted, new_ids, hidden[: num_accepted + 1] if hidden is not None else None))
        kept, text = out.commit(drafted[:num_accepted] + [next_token])
        verify_seconds = clock.stop()

        full = num_accepted == len(drafted)
        yield StepEvent(
            "spec", kept, text, clock.total, out.num_generated,
            drafted=drafted, num_accepted=num_accepted,
            correction=None if full else next_token, bonus=next_token if full and drafted else None,
            draft_seconds=draft_seconds, verify_seconds=verify_seconds, k=k_step,
            finish_reason=out.finish_reason, target_cache_length=cache.get_seq_length(),
            draft_token_probs=proposal.token_probs[: len(drafted)] if proposal and proposal.token_probs is not None
            else None, **inspected,
        )
        if config.dynamic_k and drafted:  # transformers' heuristic: +2 after a full acceptance, -1 otherwise
            k = min(k + 2, MAX_K_ENGINE) if full and len(drafted) == k else max(1, k - 1)


def generated_ids(events: list[StepEvent]) -> list[int]:
    """All tokens committed by a run."""
    return [t for e in events for t in e.tokens]
