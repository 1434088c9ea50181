"""The drafter seam: `begin` a sequence, `propose` k tokens, `update` from the target's verdict.

Drafters know token ids and their own state (a KV cache, an n-gram index); they never see text or the UI.
"""

from __future__ import annotations

import functools
import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace

import torch

from ..config import SamplingConfig
from ..engine.verify import generator_on, logits_to_probs


@dataclass
class DraftRequest:
    """What a drafter is asked: continue `ids` (prompt + generated; the last one is not yet in the target's cache)."""

    ids: list[int]
    k: int
    sampling: SamplingConfig
    generator: torch.Generator | None
    eos_token_ids: frozenset[int] = frozenset()


@dataclass
class Proposal:
    """Drafted tokens (k,) and their draft distributions q (k, V); probs None means a deterministic drafter.

    token_probs: q(x_i), the draft's probability of each drafted token under its own processed distribution (greedy
    drafters fill it too: the softmax of their logits at the token); None for a deterministic drafter (q = 1). Only
    the step inspector reads it; acceptance uses `probs`.
    """

    tokens: list[int]
    probs: torch.Tensor | None = None
    token_probs: list[float] | None = None


@dataclass
class Verdict:
    """The target's answer to a proposal: how many drafts it kept and the sequence now committed."""

    num_accepted: int
    ids: list[int]  # committed sequence, ending with the target's correction or bonus token
    target_hidden: torch.Tensor | None = None  # (num_accepted + 1, W) target features, for drafters that read them


class Drafter(ABC):
    """Proposes tokens for the target to verify."""

    name: str = "drafter"
    needs_target_hidden: bool = False  # if True, the engine passes the target's last hidden states
    target_layers: tuple[int, ...] = ()  # and, after them, these decoder layers' hidden states

    @abstractmethod
    def begin(self, prompt_ids: list[int], target_hidden: torch.Tensor | None = None) -> None:
        """Start a new sequence (drops all state)."""

    @abstractmethod
    def propose(self, request: DraftRequest) -> Proposal:
        """Up to request.k tokens continuing request.ids (fewer, or none, is allowed)."""

    def update(self, verdict: Verdict) -> None:
        """Learn from the verdict, e.g. roll back a KV cache to the accepted prefix."""


class ModelDrafter(Drafter):
    """A smaller causal LM with its own KV cache, rolled back exactly to the accepted prefix."""

    name = "model"

    def __init__(self, model: torch.nn.Module, target_device: torch.device | None = None):
        self.model = model
        self.device = next(model.parameters()).device
        self.target_device = target_device or self.device
        self.cache = None
        self.num_cached = 0  # ids[:num_cached] are in self.cache

    def begin(self, prompt_ids: list[int], target_hidden: torch.Tensor | None = None) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        self.num_cached = 0

    def _step(self, ids: list[int]) -> torch.Tensor:
        """Feed ids after the cached prefix; return the logits (V,) for the next token."""
        x = torch.tensor([ids], device=self.device)
        logits = self.model(input_ids=x, **with_cache(self.model, self.cache), use_cache=True, logits_to_keep=1).logits
        self.num_cached += len(ids)
        return logits[0, -1]

    @torch.inference_mode()
    def propose(self, request: DraftRequest) -> Proposal:
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        token_probs: list[torch.Tensor] = []  # q(x_i), 0-d tensors: read back once, after the loop
        feed = request.ids[self.num_cached :]
        gen = None if request.sampling.greedy else generator_on(request.generator, self.device)  # once per proposal
        for _ in range(request.k):
            logits = self._step(feed)
            if request.sampling.greedy:
                token = int(torch.argmax(logits))
                token_probs.append(torch.softmax(logits.float(), -1)[token])
            else:
                q = logits_to_probs(logits, request.sampling)
                token = int(torch.multinomial(q, 1, generator=gen))
                probs.append(q.to(self.target_device))
                token_probs.append(q[token])
            tokens.append(token)
            if token in request.eos_token_ids:
                break
            feed = [token]
        q_tokens = torch.stack(token_probs).tolist() if token_probs else []
        return Proposal(tokens, torch.stack(probs) if probs else None, q_tokens)

    def update(self, verdict: Verdict) -> None:
        # the cache holds committed ids plus drafted tokens; keep only the part the target agreed with
        agreed = len(verdict.ids) - 1  # everything but the correction/bonus, which was never fed to the draft
        if self.num_cached > agreed:
            crop_cache(self.cache, agreed)
            self.num_cached = agreed


class NgramDrafter(Drafter):
    """Prompt lookup: find the longest earlier match of the context's suffix and copy what followed it. No model.

    A longer match is stronger evidence: one of length L < `full_ngram` proposes at most L tokens, a longer one k,
    because on a CPU a wide verify pass that fails costs more than a 1-token pass. Ties go to the earliest match,
    which for extractive prompts is usually the source text itself (`latest=True` prefers the most recent one, as
    transformers' prompt lookup does). (Tuned by replaying recorded outputs; docs/draft.md, "The one-off simulators".)
    """

    name = "ngram"

    def __init__(self, max_ngram: int = 8, min_ngram: int = 1, full_ngram: int = 3, latest: bool = False):
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.full_ngram = full_ngram
        self.latest = latest

    def begin(self, prompt_ids: list[int], target_hidden: torch.Tensor | None = None) -> None:
        pass

    def match(self, ids: list[int]) -> tuple[int, int]:
        """(length, end) of the longest earlier match of ids' suffix: ids[end-length+1 : end+1] == ids[-length:]."""
        n, last = len(ids), ids[-1] if ids else None
        best_len, best_end = 0, -1
        ends = range(n - 2, -1, -1) if self.latest else range(n - 1)  # end < n - 1: something follows the match
        for end in ends:
            if ids[end] != last:
                continue
            length = 1
            while length < self.max_ngram and end - length >= 0 and ids[end - length] == ids[n - 1 - length]:
                length += 1
            if length > best_len:  # strictly longer: ties keep the first one visited
                best_len, best_end = length, end
        return best_len, best_end

    def propose(self, request: DraftRequest) -> Proposal:
        length, end = self.match(request.ids)
        if length < self.min_ngram or request.k <= 0:
            return Proposal([])
        count = request.k if length >= self.full_ngram else min(request.k, length)
        return Proposal(cut_at_eos(request.ids[end + 1 : end + 1 + count], request.eos_token_ids))


class HybridDrafter(Drafter):
    """Prompt lookup where the context repeats itself, the draft model everywhere else.

    A suffix match of at least `min_match` tokens is strong evidence (copying from the prompt, a list, code); there
    the lookup's copy costs nothing to draft, and it proposes up to k tokens. Elsewhere the model drafts, at most
    `model_k` tokens (None: k; hybrid.calibrate chooses it from this machine's measured costs). The choice
    depends only on the committed context, so each step still has one well-defined proposal distribution and
    rejection sampling stays exact. The model drafter must follow along when
    skipped: ModelDrafter catches up from `ids`, Eagle3Drafter keeps the target features of skipped passes pending.
    """

    name = "hybrid"

    def __init__(self, model: Drafter, min_match: int = 3, model_k: int | None = None):
        self.model = model
        self.model_k = model_k
        # a match of min_match tokens or more proposes up to k tokens; a shorter one proposes nothing
        self.lookup = NgramDrafter(min_ngram=min_match, full_ngram=min_match)
        self.needs_target_hidden = model.needs_target_hidden
        self.target_layers = model.target_layers
        self.last_source: str | None = None  # "lookup" or "model": who drafted the last proposal

    def begin(self, prompt_ids: list[int], target_hidden: torch.Tensor | None = None) -> None:
        self.model.begin(prompt_ids, target_hidden)

    def propose(self, request: DraftRequest) -> Proposal:
        proposal = self.lookup.propose(request)
        if proposal.tokens:
            self.last_source = "lookup"
            return proposal
        self.last_source = "model"
        if self.model_k is not None and request.k > self.model_k:
            request = replace(request, k=self.model_k)
        return self.model.propose(request)

    def update(self, verdict: Verdict) -> None:
        self.model.update(verdict)


@functools.cache
def _cache_keyword(forward) -> str:
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def with_cache(model, cache) -> dict:
    """The forward's KV-cache keyword argument: `cache` in recent transformers 5 releases, `past_key_values` before
    (5.17 still names it so, and takes an unknown `cache=` into **kwargs: it would decode with no cache at all)."""
    return {_cache_keyword(type(model).forward): cache}


def crop_cache(cache, length: int) -> None:
    """Keep the first `length` positions of a KV cache (transformers 5 crops by a negative count)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def cut_at_eos(tokens: list[int], eos: frozenset[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens
