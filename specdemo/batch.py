"""Batched decoding: B prompts of different lengths decoded together, one target pass per step for all of them.

A batched autoregressive decoder and a batched speculative one, both generators of BatchEvents over the same
machinery (BatchKV: a left-padded KV cache whose rows hold different numbers of valid positions). Each row drafts
with its own state (prompt lookup, a draft model or the EAGLE head, batched), accepts its own number of tokens and
finishes on its own (EOS, stop string, length; engine's committer). Acceptance uses verify's rules per row. No UI,
no metrics beyond per-step timings and the pass-cost micro-benchmark that auto k reads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from .config import MAX_K_ENGINE, GenerationConfig, SamplingConfig
from .drafters import (
    Drafter,
    DraftRequest,
    HybridDrafter,
    ModelDrafter,
    NgramDrafter,
    Proposal,
    Verdict,
    crop_cache,
    with_cache,
)
from .engine import Committer, GenerationError, check_request, eos_ids, seeded_generator, target_features
from .kernels import left_pad
from .metrics import expected_speedup
from .timing import Clock, timed_call
from .verify import logits_to_probs, rejection_accept

PAD = 0  # the token id fed at padded positions; they are masked out, so any id would do
# compaction: when a storage holds more than COMPACT_SLACK + COMPACT_FRACTION x the longest row's slots of holes
COMPACT_SLACK = 32
COMPACT_FRACTION = 0.5


# ---- which storage slots each row holds ----

class Slots:
    """Which slots of a (B, L) storage each row attends to, and each row's next RoPE position.

    The rollback choice: rows share one storage length L, and a slot a row does not keep (left padding, a padded
    query, a rejected draft) stays in storage as a hole, masked out by `valid`. Rollback is then a mask update, never
    a copy; columns that no row holds any more are cut off the end (trim), and when holes outgrow the rows' own
    lengths the storage is compacted by one gather (compaction). Positions count a row's valid slots only, so every
    row sees exactly the RoPE positions of its own single-sequence run; causality follows storage order, which is
    the order in which tokens were fed.
    """

    def __init__(self, rows: int, device: torch.device):
        self.valid = torch.zeros(rows, 0, dtype=torch.bool, device=device)  # (B, L)
        self.counts = [0] * rows  # valid slots per row: the next position of each row

    @property
    def length(self) -> int:
        return self.valid.shape[1]

    def positions(self, real: torch.Tensor) -> torch.Tensor:
        """RoPE positions (B, T) of a pass whose real (not padded) entries are `real` (B, T) bool."""
        start = torch.tensor(self.counts, device=real.device)[:, None]
        return (start + real.long().cumsum(1) - 1).clamp(min=0)

    def mask(self, real: torch.Tensor) -> torch.Tensor:
        """The 2D attention mask (B, L + T) of a pass: the valid slots, then the pass's real entries."""
        return torch.cat([self.valid, real], dim=1)

    def append(self, real: torch.Tensor) -> None:
        self.valid = torch.cat([self.valid, real], dim=1)
        self.counts = [c + n for c, n in zip(self.counts, real.sum(1).tolist())]

    def keep(self, counts: Sequence[int]) -> int:
        """Keep each row's first counts[r] valid slots (in storage order); returns the trimmed storage length."""
        if list(counts) != self.counts:
            n = torch.tensor(counts, device=self.valid.device)[:, None]
            self.valid = self.valid & (self.valid.cumsum(1) <= n)
            self.counts = [min(a, b) for a, b in zip(self.counts, counts)]
        return self.trim()

    def trim(self) -> int:
        """Cut storage columns that no row holds; returns the new length."""
        used = self.valid.any(0).nonzero()
        length = int(used[-1]) + 1 if used.numel() else 0
        self.valid = self.valid[:, :length]
        return length

    def select(self, rows: Sequence[int]) -> int:
        """Keep only these rows, in this order; returns the trimmed storage length."""
        index = torch.tensor(rows, device=self.valid.device)
        self.valid = self.valid[index]
        self.counts = [self.counts[r] for r in rows]
        return self.trim()

    def compaction(self) -> torch.Tensor | None:
        """Where holes have piled up (past COMPACT_SLACK + COMPACT_FRACTION x the longest row): the gather index
        (B, m) that moves each row's valid slots, in order, to the front of m = max(counts) slots; else None."""
        m = max(self.counts, default=0)
        if self.length - m <= COMPACT_SLACK + COMPACT_FRACTION * m:
            return None
        slots = torch.arange(self.length, device=self.valid.device)
        key = torch.where(self.valid, slots, slots + self.length)  # valid slots first, each row in storage order
        index = key.argsort(dim=1)[:, :m]
        self.valid = torch.arange(m, device=self.valid.device)[None, :] < torch.tensor(self.counts,
                                                                                    device=self.valid.device)[:, None]
        return index


def _gather_slots(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x (B, H, L, D) -> (B, H, m, D) at each row's slots index (B, m)."""
    b, h, _, d = x.shape
    return x.gather(2, index[:, None, :, None].expand(b, h, index.shape[1], d))


class BatchKV:
    """A transformers DynamicCache over B rows with per-row valid slots (see Slots), and the forward that feeds it."""

    def __init__(self, model, rows: int):
        from transformers import DynamicCache

        self.model = model
        self.device = next(model.parameters()).device
        self.cache = DynamicCache(config=model.config)
        self.slots = Slots(rows, self.device)

    @property
    def counts(self) -> list[int]:
        return self.slots.counts

    def inputs(self, tokens: torch.Tensor, real: torch.Tensor) -> dict:
        """Forward keyword arguments for tokens (B, T) whose real entries are `real` (B, T) bool."""
        mask = self.slots.mask(real)
        return dict(input_ids=tokens, attention_mask=None if bool(mask.all()) else mask,
                    position_ids=self.slots.positions(real), use_cache=True, **with_cache(self.model, self.cache))

    def forward(self, tokens: torch.Tensor, real: torch.Tensor, keep: int,
                layers: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the model on tokens (B, T) after the cache; logits (B, keep, V) and, unless layers is None, the
        features (B, T, W) of engine.target_features."""
        before = self.cache.get_seq_length()
        inputs = self.inputs(tokens, real)
        features = None
        if layers is None:
            logits = self.model(**inputs, logits_to_keep=keep).logits
        else:
            last, features = target_features(self.model, layers, **inputs)
            logits = self.model.lm_head(last[:, -keep:])
        if self.cache.get_seq_length() != before + tokens.shape[1]:
            raise GenerationError(f"{type(self.model).__name__}'s forward did not fill the KV cache it was given")
        self.slots.append(real)
        return logits, features

    def step(self, feeds: Sequence[Sequence[int]]) -> torch.Tensor:
        """Feed each row its own tokens (left-padded to one width; a row may feed none) and return the logits (B, V)
        at each row's newest token."""
        tokens, real = left_padded(feeds, self.device)
        return self.forward(tokens, real, 1)[0][:, -1]

    def keep(self, counts: Sequence[int]) -> None:
        """Roll each row back to its first counts[r] valid positions."""
        crop_cache(self.cache, self.slots.keep(counts))

    def select(self, rows: Sequence[int]) -> None:
        """Keep only these rows (finished ones leave the batch)."""
        if list(rows) == list(range(len(self.counts))):
            return
        self.cache.reorder_cache(torch.tensor(rows, device=self.device))
        crop_cache(self.cache, self.slots.select(rows))
        self.compact()

    def compact(self) -> None:
        """Gather each row's valid slots to the front where holes have piled up (Slots.compaction)."""
        index = self.slots.compaction()
        if index is None:
            return
        for layer in self.cache.layers:
            layer.keys, layer.values = _gather_slots(layer.keys, index), _gather_slots(layer.values, index)

    def row_keys_values(self, row: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `row`'s keys and values (H, n, D) at its valid slots, for checks against a fresh prefill."""
        valid = self.slots.valid[row]
        entry = self.cache.layers[layer]
        return entry.keys[row][:, valid], entry.values[row][:, valid]


def left_padded(rows: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (tokens (B, T), real (B, T) bool), padded on the left so each row ends in the last column
    (kernels.left_pad; a row may be empty)."""
    tokens, mask = left_pad([list(r) for r in rows], PAD, device)
    return tokens, mask.bool()


def right_padded(rows: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (tokens (B, T), real (B, T) bool), padded on the right: entry j of a row is its j-th token."""
    width = max((len(r) for r in rows), default=0)
    tokens = torch.full((len(rows), width), PAD, dtype=torch.long)
    real = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(list(r), dtype=torch.long)
        real[i, : len(r)] = True
    return tokens.to(device), real.to(device)


def _check_cache(model) -> None:
    """Holes and per-row positions assume full attention over one growing cache."""
    types = set(getattr(model.config, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"}:
        raise GenerationError(f"batched decoding supports full-attention models only ({type(model).__name__} has "
                              f"{sorted(types)} layers)")


# ---- batched drafters: the drafter seam for B rows at once ----

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


def _row_generator(gen: torch.Generator | None, device: torch.device) -> torch.Generator | None:
    """The row's generator, or one seeded from it where the draft sits on another device (as ModelDrafter does)."""
    if gen is None or gen.device.type == device.type:
        return gen
    own = torch.Generator(device=device)
    own.manual_seed(int(torch.randint(2**62, (1,), generator=gen)))
    return own


class BatchModelDrafter(BatchDrafter):
    """A draft causal LM over the batch with its own padded KV cache (BatchKV), rolled back per row.

    Each proposal is one catch-up pass (each row feeds what its cache lacks: 1 or 2 tokens after a verdict, more
    after a hybrid's lookup steps) and then one single-token pass per drafted position, rows that stopped drafting
    feeding a hole; as in ModelDrafter, the last drafted token is never fed.
    """

    name = "model"

    def __init__(self, model: torch.nn.Module, target_device: torch.device | None = None):
        _check_cache(model)
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
        gens = [_row_generator(g, self.device) for g in generators]
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


class BatchEagle(BatchDrafter):
    """The trained EAGLE head (eagle.EagleHead) over the batch: its own keys and values with per-row slots.

    As in EagleDrafter, between proposals the cache holds entries computed from true target features only; the
    entries of drafted features sit after `true_length` and are cut at the next verdict. The head is run layer by
    layer here because its forward takes one position vector for all rows, and rows sit at different positions.
    """

    name = "eagle"
    needs_target_hidden = True

    def __init__(self, head, min_confidence: float = 0.0):
        self.head = head
        self.target_layers = head.c.fuse_layers
        self.min_confidence = min_confidence
        self.device = head.head_weight.device
        self.dtype = head.head_weight.dtype

    def begin(self, prompts, target_hidden=None) -> None:
        if target_hidden is None:
            raise ValueError("BatchEagle needs the target's hidden states (needs_target_hidden)")
        self.slots = Slots(len(prompts), self.device)
        self.k = self.v = None  # (B, KV * layers, L, D)
        self.pending: list[torch.Tensor | None] = [h for h in target_hidden]  # true features not yet fed, (m, W)
        self.true_counts: list[int] | None = None  # counts after the last catch-up pass: the true entries

    def _pass(self, features: torch.Tensor, tokens: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """features (B, T, H), tokens (B, T) (the token after each feature's position) -> predicted features (B, T, H)."""
        head = self.head
        x = head.fc(torch.cat([features, head.embed[tokens].to(features.dtype)], dim=-1))
        freqs = self.slots.positions(real).float()[..., None] * head.inv_freq  # (B, T, D/2)
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # (B, 1, T, D), broadcast over heads
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        past, t = self.slots.length, tokens.shape[1]
        causal = torch.ones(t, past + t, dtype=torch.bool, device=self.device).tril(diagonal=past)
        mask = causal[None] & self.slots.mask(real)[:, None, :]  # (B, T, L + T)
        mask = (mask | ~mask.any(-1, keepdim=True))[:, None]  # a query with nothing to see reads garbage, not NaN
        layers = head.decoder_layers
        pasts = [(None, None)] * len(layers) if self.k is None else zip(self.k.chunk(len(layers), 1),
                                                                       self.v.chunk(len(layers), 1))
        ks, vs = [], []
        for layer, (pk, pv) in zip(layers, pasts):
            x, k, v = layer(x, cos, sin, pk, pv, mask)
            ks.append(k)
            vs.append(v)
        k, v = torch.cat(ks, dim=1), torch.cat(vs, dim=1)
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        self.slots.append(real)
        return head.norm(x)

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
        width = self.head.c.feature_width
        x = torch.zeros(rows, tok.shape[1], width, dtype=self.dtype, device=self.device)
        for r, f in enumerate(feats):
            if f is not None and len(f):
                x[r, tok.shape[1] - len(f):] = f.to(self.dtype)
        feature = self._pass(self.head.prepare(x), tok, real)[:, -1]  # (B, H)
        self.pending = [None] * rows
        self.true_counts = list(self.slots.counts)
        subset = self.head.subset
        gens = [_row_generator(g, self.device) for g in generators]
        active = [k > 0 for k in ks]
        while True:
            logits = self.head.logits(feature)  # (B, S)
            q_sub = torch.softmax(logits.float(), -1) if sampling.greedy else logits_to_probs(logits, sampling)
            confidence = q_sub.max(-1).values.tolist()
            top = q_sub.argmax(-1).tolist() if sampling.greedy else None
            for r in range(rows):
                if not active[r]:
                    continue
                if tokens[r] and confidence[r] < self.min_confidence:  # EagleDrafter's early stop
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
                raise ValueError("BatchEagle needs the target's hidden states in the verdict")
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
            self.k, self.v = _gather_slots(self.k, index), _gather_slots(self.v, index)


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
    """The batched form of a drafter built by compare.make_drafter (prompt lookup, a draft LM, the EAGLE head, or
    the hybrid of lookup and one of those); same settings, same proposals per row."""
    from .eagle import EagleDrafter

    if isinstance(drafter, BatchDrafter):
        return drafter
    if isinstance(drafter, NgramDrafter):
        return BatchNgram(drafter)
    if isinstance(drafter, ModelDrafter):
        return BatchModelDrafter(drafter.model, drafter.target_device)
    if isinstance(drafter, EagleDrafter) and drafter.name == "eagle3":
        raise GenerationError("the batch decoder has no batched form of an EAGLE-3 head yet; race it one prompt at "
                              "a time, or batch its target with prompt lookup")
    if isinstance(drafter, EagleDrafter):
        return BatchEagle(drafter.head, drafter.min_confidence)
    if isinstance(drafter, HybridDrafter):
        return BatchHybrid(batch_drafter(drafter.model), drafter.lookup, drafter.model_k)
    raise GenerationError(f"no batched form of the {type(drafter).__name__} drafter")


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
    _check_cache(target)
    clock = Clock(target.device)
    rows = _Rows(tokenizer, prompts, config, eos_ids(target, tokenizer), target.device)
    kv = BatchKV(target, len(prompts))
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
    _check_cache(target)
    clock = Clock(target.device)
    eos = eos_ids(target, tokenizer)
    sampling = config.sampling
    rows = _Rows(tokenizer, prompts, config, eos, target.device)
    kv = BatchKV(target, len(prompts))
    layers = tuple(drafter.target_layers) if drafter.needs_target_hidden else None
    device = kv.device

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


def choose_k(alpha: float, c: float, verify_costs: dict[int, float], k_max: int) -> tuple[int, float]:
    """(k, expected speedup): the k in 0..k_max with the best metrics.expected_speedup, where k = 0 (no speculation)
    is worth exactly 1."""
    best, value = 0, 1.0
    for k in range(1, k_max + 1):
        s = expected_speedup(alpha, c, k, verify_costs.get(k, 1.0))
        if s > value:
            best, value = k, s
    return best, value


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
