"""Batched drafters: the drafter seam (begin / propose / update) for B rows at once.

Prompt lookup per row, the draft model and an EAGLE-3 head batched over rows, and the hybrid; batch_drafter maps a
single-sequence drafter to its batched form. Knows nothing of verification.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from .batch_kv import PAD, BatchKV, Slots, check_cache, gather_slots, left_padded
from .config import MAX_K_ENGINE, SamplingConfig
from .drafters import Drafter, DraftRequest, HybridDrafter, ModelDrafter, NgramDrafter, Proposal, Verdict
from .engine import GenerationError
from .verify import generator_on, logits_to_probs


class BatchDrafter(ABC):
    """Proposes tokens for each row of a batch; rows are dropped with `select` as they finish."""

    name: str = "drafter"
    needs_target_hidden: bool = False
    target_layers: tuple[int, ...] = ()

    @abstractmethod
    def begin(self, prompts: Sequence[list[int]], target_hidden: Sequence[torch.Tensor] | None = None) -> None:
        """Start a batch (drops all state); target_hidden[r] is (len(prompts[r]), W) for drafters that read it."""

    @abstractmethod
    def propose(self, ids: Sequence[list[int]], ks: Sequence[int], sampling: SamplingConfig,
                generators: Sequence[torch.Generator | None], eos: frozenset[int]) -> list[Proposal]:
        """Up to ks[r] tokens continuing ids[r] (whose last token is not yet in the target's cache) for each row."""

    def update(self, verdicts: Sequence[Verdict]) -> None:
        """Learn from each row's verdict (roll back to the accepted prefix)."""

    def select(self, rows: Sequence[int]) -> None:
        """Keep only these rows, in this order."""


class BatchNgram(BatchDrafter):
    """Prompt lookup per row (drafters.NgramDrafter): no model, no state."""

    name = "ngram"

    def __init__(self, lookup: NgramDrafter | None = None):
        self.lookup = lookup or NgramDrafter()

    def begin(self, prompts, target_hidden=None) -> None:
        pass

    def propose(self, ids, ks, sampling, generators, eos) -> list[Proposal]:
        return [self.lookup.propose(DraftRequest(row, k, sampling, gen, eos)) if k > 0 else Proposal([])
                for row, k, gen in zip(ids, ks, generators)]


class BatchModelDrafter(BatchDrafter):
    """A draft causal LM over the batch with its own padded KV cache (BatchKV), rolled back per row.

    Each proposal is one catch-up pass (each row feeds what its cache lacks: 1 or 2 tokens after a verdict, more
    after a hybrid's lookup steps) and then one single-token pass per drafted position, rows that stopped drafting
    feeding a hole; as in ModelDrafter, the last drafted token is never fed.
    """

    name = "model"

    def __init__(self, model: torch.nn.Module, target_device: torch.device | None = None):
        check_cache(model)
        self.model = model
        self.device = next(model.parameters()).device
        self.target_device = target_device or self.device
        self.kv: BatchKV | None = None

    def begin(self, prompts, target_hidden=None) -> None:
        self.kv = BatchKV(self.model, len(prompts))

    @torch.inference_mode()
    def propose(self, ids, ks, sampling, generators, eos) -> list[Proposal]:
        rows = len(ids)
        tokens: list[list[int]] = [[] for _ in range(rows)]
        probs: list[list[torch.Tensor]] = [[] for _ in range(rows)]
        if max(ks, default=0) <= 0:
            return [Proposal([]) for _ in range(rows)]
        gens = [generator_on(g, self.device) for g in generators]
        active = [k > 0 for k in ks]
        logits = self.kv.step([row[n:] for row, n in zip(ids, self.kv.counts)])  # (B, V)
        while True:
            if sampling.greedy:
                choice = logits.argmax(-1).tolist()
            else:
                q = logits_to_probs(logits, sampling)  # (B, V)
            for r in range(rows):
                if not active[r]:
                    continue
                if sampling.greedy:
                    token = choice[r]
                else:
                    token = int(torch.multinomial(q[r], 1, generator=gens[r]))
                    probs[r].append(q[r].to(self.target_device))
                tokens[r].append(token)
                active[r] = token not in eos and len(tokens[r]) < ks[r]
            if not any(active):
                break
            logits = self.kv.step([[t[-1]] if a else [] for t, a in zip(tokens, active)])
        return [Proposal(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs)]

    def update(self, verdicts) -> None:
        # the cache holds committed ids plus drafted tokens; keep the part the target agreed with (not its own token)
        agreed = [min(n, len(v.ids) - 1) for n, v in zip(self.kv.counts, verdicts)]
        self.kv.keep(agreed)

    def select(self, rows) -> None:
        self.kv.select(rows)


class BatchEagle3(BatchDrafter):
    """An EAGLE-3 head (eagle3.Eagle3Head: ours or a published one) over the batch: its own keys and values with
    per-row slots, the midlayer over (embedding, hidden) and the pre-norm output fed back, as Eagle3Drafter does one
    row at a time.

    As in Eagle3Drafter, between proposals the cache holds entries computed from true target features only; the
    entries of drafted features sit after `true_length` and are cut at the next verdict. The midlayer is run here
    rather than the head's forward because that takes one position vector for all rows, and rows sit at different
    positions.
    """

    name = "eagle3"
    needs_target_hidden = True

    def __init__(self, head, min_confidence: float = 0.0):
        self.head = head
        self.target_layers = head.target_layers
        self.min_confidence = min_confidence
        self.device = head.norm.weight.device
        self.dtype = head.norm.weight.dtype

    def begin(self, prompts, target_hidden=None) -> None:
        if target_hidden is None:
            raise ValueError("BatchEagle3 needs the target's hidden states (needs_target_hidden)")
        self.slots = Slots(len(prompts), self.device)
        self.k = self.v = None  # (B, KV, L, D)
        self.pending: list[torch.Tensor | None] = [h for h in target_hidden]  # true features not yet fed, (m, W)
        self.true_counts: list[int] | None = None  # counts after the last catch-up pass: the true entries

    def _pass(self, hidden: torch.Tensor, tokens: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """hidden (B, T, H), tokens (B, T) (the token after each hidden state's position) -> what the next draft step
        reads, (B, T, H): the midlayer's pre-norm output, each row at its own positions."""
        freqs = self.slots.positions(real).float()[..., None] * self.head.inv_freq  # (B, T, D/2)
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # (B, 1, T, D), broadcast over heads
        scale = self.head.rope_scale  # the rope type's attention scaling
        cos, sin = (emb.cos() * scale).to(hidden.dtype), (emb.sin() * scale).to(hidden.dtype)
        past, t = self.slots.length, tokens.shape[1]
        causal = torch.ones(t, past + t, dtype=torch.bool, device=self.device).tril(diagonal=past)
        mask = causal[None] & self.slots.mask(real)[:, None, :]  # (B, T, L + T)
        mask = (mask | ~mask.any(-1, keepdim=True))[:, None]  # a query with nothing to see reads garbage, not NaN
        head = self.head
        out, k, v = head.midlayer(head.embed(tokens).to(hidden.dtype), hidden, cos, sin, self.k, self.v, mask)
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        self.slots.append(real)
        return out

    def _drop_drafted(self) -> None:
        if self.true_counts is not None:
            self._crop(self.slots.keep(self.true_counts))
            self.true_counts = None

    def _crop(self, length: int) -> None:
        if self.k is not None and self.k.shape[2] > length:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]

    @torch.inference_mode()
    def propose(self, ids, ks, sampling, generators, eos) -> list[Proposal]:
        rows = len(ids)
        tokens: list[list[int]] = [[] for _ in range(rows)]
        probs: list[list[torch.Tensor]] = [[] for _ in range(rows)]
        if max(ks, default=0) <= 0:
            return [Proposal([]) for _ in range(rows)]
        self._drop_drafted()
        # catch up: each row feeds its pending true features, paired with the token that follows each position
        feats, feeds = [], []
        for r in range(rows):
            pend = self.pending[r]
            m = 0 if pend is None else len(pend)
            n = self.slots.counts[r]
            if n + m != len(ids[r]) - 1:
                raise ValueError(f"draft state of row {r} covers {n + m} positions but the request has "
                                 f"{len(ids[r]) - 1}")
            if ks[r] > 0 and m == 0:
                raise ValueError(f"row {r} has no new target features to draft from")
            feats.append(pend)
            feeds.append(ids[r][n + 1:])
        tok, real = left_padded(feeds, self.device)
        width = next(f.shape[-1] for f in feats if f is not None)  # the engine's features: final and aux layers
        x = torch.zeros(rows, tok.shape[1], width, dtype=self.dtype, device=self.device)
        for r, f in enumerate(feats):
            if f is not None and len(f):
                x[r, tok.shape[1] - len(f):] = f.to(self.dtype)
        feature = self._pass(self.head.prepare(x), tok, real)[:, -1]  # (B, H)
        self.pending = [None] * rows
        self.true_counts = list(self.slots.counts)
        subset = self.head.subset
        gens = [generator_on(g, self.device) for g in generators]
        active = [k > 0 for k in ks]
        while True:
            logits = self.head.logits(feature)  # (B, S)
            q_sub = torch.softmax(logits.float(), -1) if sampling.greedy else logits_to_probs(logits, sampling)
            confidence = q_sub.max(-1).values.tolist()
            top = q_sub.argmax(-1).tolist() if sampling.greedy else None
            for r in range(rows):
                if not active[r]:
                    continue
                if tokens[r] and confidence[r] < self.min_confidence:  # Eagle3Drafter's early stop
                    active[r] = False
                    continue
                if sampling.greedy:
                    token = int(subset[top[r]])
                else:
                    token = int(subset[int(torch.multinomial(q_sub[r], 1, generator=gens[r]))])
                    q = torch.zeros(self.head.c.vocab_size, dtype=q_sub.dtype, device=q_sub.device)
                    probs[r].append(q.index_copy_(0, subset, q_sub[r]))
                tokens[r].append(token)
                active[r] = token not in eos and len(tokens[r]) < ks[r]
            if not any(active):
                break
            step_tok = torch.tensor([[t[-1] if a else PAD] for t, a in zip(tokens, active)], device=self.device)
            step_real = torch.tensor([[a] for a in active], device=self.device)
            feature = self._pass(feature[:, None], step_tok, step_real)[:, -1]
        return [Proposal(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs)]

    def update(self, verdicts) -> None:
        self._drop_drafted()
        for r, v in enumerate(verdicts):
            if v.target_hidden is None:
                raise ValueError("BatchEagle3 needs the target's hidden states in the verdict")
            hidden = v.target_hidden.to(self.dtype)
            self.pending[r] = hidden if self.pending[r] is None else torch.cat([self.pending[r], hidden])
        self._compact()

    def select(self, rows) -> None:
        self._drop_drafted()
        if self.k is not None:
            index = torch.tensor(rows, device=self.device)
            self.k, self.v = self.k[index], self.v[index]
        self._crop(self.slots.select(rows))
        self.pending = [self.pending[r] for r in rows]
        self._compact()

    def _compact(self) -> None:
        index = self.slots.compaction()
        if index is not None and self.k is not None:
            self.k, self.v = gather_slots(self.k, index), gather_slots(self.v, index)


class BatchHybrid(BatchDrafter):
    """drafters.HybridDrafter per row: prompt lookup where a row's context repeats, the batched model elsewhere (at
    most model_k tokens). Rows that look up feed the model nothing new that step; it catches up later."""

    name = "hybrid"

    def __init__(self, model: BatchDrafter, lookup: NgramDrafter, model_k: int | None = None):
        self.model = model
        self.lookup = lookup
        self.model_k = model_k
        self.needs_target_hidden = model.needs_target_hidden
        self.target_layers = model.target_layers
        self.sources: list[str] = []  # per row: "lookup" or "model" for the last proposal

    def begin(self, prompts, target_hidden=None) -> None:
        self.model.begin(prompts, target_hidden)

    def propose(self, ids, ks, sampling, generators, eos) -> list[Proposal]:
        looked = [self.lookup.propose(DraftRequest(row, k, sampling, gen, eos)) if k > 0 else Proposal([])
                  for row, k, gen in zip(ids, ks, generators)]
        cap = self.model_k if self.model_k is not None else MAX_K_ENGINE
        model_ks = [0 if p.tokens else min(k, cap) for p, k in zip(looked, ks)]
        modeled = self.model.propose(ids, model_ks, sampling, generators, eos)
        self.sources = ["lookup" if p.tokens else "model" for p in looked]
        return [p if p.tokens else m for p, m in zip(looked, modeled)]

    def update(self, verdicts) -> None:
        self.model.update(verdicts)

    def select(self, rows) -> None:
        self.model.select(rows)


def batch_drafter(drafter: Drafter) -> BatchDrafter:
    """The batched form of a drafter built by compare.make_drafter (prompt lookup, a draft LM, an EAGLE-3 head, or
    the hybrid of lookup and one of those); same settings, same proposals per row."""
    from .eagle3_drafter import Eagle3Drafter

    if isinstance(drafter, BatchDrafter):
        return drafter
    if isinstance(drafter, NgramDrafter):
        return BatchNgram(drafter)
    if isinstance(drafter, ModelDrafter):
        return BatchModelDrafter(drafter.model, drafter.target_device)
    if isinstance(drafter, Eagle3Drafter):
        return BatchEagle3(drafter.head, drafter.min_confidence)
    if isinstance(drafter, HybridDrafter):
        return BatchHybrid(batch_drafter(drafter.model), drafter.lookup, drafter.model_k)
    raise GenerationError(f"no batched form of the {type(drafter).__name__} drafter")
