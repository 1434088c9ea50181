"""The drafter seam: `begin` a sequence, `propose` k tokens, `update` from the target's verdict.

Drafters know token ids and their own state (a KV cache, an n-gram index); they never see text or the UI.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from .config import SamplingConfig
from .verify import logits_to_probs


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
    """Drafted tokens (k,) and their draft distributions q (k, V); probs None means a deterministic drafter."""

    tokens: list[int]
    probs: torch.Tensor | None = None


@dataclass
class Verdict:
    """The target's answer to a proposal: how many drafts it kept and the sequence now committed."""

    num_accepted: int
    ids: list[int]  # committed sequence, ending with the target's correction or bonus token
    target_hidden: torch.Tensor | None = None  # (num_accepted + 1, H) target features, for drafters that read them


class Drafter(ABC):
    """Proposes tokens for the target to verify."""

    name: str = "drafter"
    needs_target_hidden: bool = False  # if True, the engine passes the target's last hidden states

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
        logits = self.model(input_ids=x, cache=self.cache, use_cache=True, logits_to_keep=1).logits
        self.num_cached += len(ids)
        return logits[0, -1]

    @torch.inference_mode()
    def propose(self, request: DraftRequest) -> Proposal:
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        feed = request.ids[self.num_cached :]
        for _ in range(request.k):
            logits = self._step(feed)
            if request.sampling.greedy:
                token = int(torch.argmax(logits))
            else:
                q = logits_to_probs(logits, request.sampling)
                token = int(torch.multinomial(q, 1, generator=self._generator(request)))
                probs.append(q.to(self.target_device))
            tokens.append(token)
            if token in request.eos_token_ids:
                break
            feed = [token]
        return Proposal(tokens, torch.stack(probs) if probs else None)

    def _generator(self, request: DraftRequest) -> torch.Generator | None:
        """The engine's generator, or a seeded one of our own when the draft sits on another device."""
        if request.generator is None or request.generator.device.type == self.device.type:
            return request.generator
        gen = torch.Generator(device=self.device)
        gen.manual_seed(int(torch.randint(2**62, (1,), generator=request.generator)))
        return gen

    def update(self, verdict: Verdict) -> None:
        # the cache holds committed ids plus drafted tokens; keep only the part the target agreed with
        agreed = len(verdict.ids) - 1  # everything but the correction/bonus, which was never fed to the draft
        if self.num_cached > agreed:
            crop_cache(self.cache, agreed)
            self.num_cached = agreed


class NgramDrafter(Drafter):
    """Prompt lookup: copy what followed the latest earlier occurrence of the context's last n-gram. No model."""

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def begin(self, prompt_ids: list[int], target_hidden: torch.Tensor | None = None) -> None:
        pass

    def propose(self, request: DraftRequest) -> Proposal:
        ids = request.ids
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            tail = ids[-n:]
            # latest match first: recent text predicts the continuation best
            for start in range(len(ids) - n - 1, -1, -1):
                if ids[start : start + n] == tail:
                    follow = ids[start + n : start + n + request.k]
                    if follow:
                        return Proposal(_cut_at_eos(follow, request.eos_token_ids))
        return Proposal([])


def crop_cache(cache, length: int) -> None:
    """Keep the first `length` positions of a KV cache (transformers 5 crops by a negative count)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def _cut_at_eos(tokens: list[int], eos: frozenset[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens
