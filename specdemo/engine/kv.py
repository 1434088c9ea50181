"""The KV cache of a batch: B rows of different lengths in one left-padded cache, each row's valid positions as
slots; batch size 1 is the same cache with no holes. Also the forward that feeds it and the target's features.

Rows grow, accept or roll back on their own; holes left by rollbacks are masked and compacted now and then. Knows
nothing of drafting or acceptance.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Sequence

import torch

from ..models.kernels import decode_cache, grouped_attention_on, left_pad
from ..models.placement import execution_device, to_device
from .events import GenerationError

PAD = 0  # the token id fed at padded positions; they are masked out, so any id would do
# compaction: when a storage holds more than COMPACT_SLACK + COMPACT_FRACTION x the longest row's slots of holes
COMPACT_SLACK = 32
COMPACT_FRACTION = 0.5
# CPU kernels (kernels.decode), where measured faster (docs/notes/kernels.md, "The engine's KV cache"): a buffer per
# layer with ROOM positions past the prefill (it grows by half when full) from PREALLOCATE_ROWS rows up, and grouped
# one-query attention from GROUPED_ROWS rows up; 0 turns either off
ROOM = 96
PREALLOCATE_ROWS = 64
GROUPED_ROWS = 64


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
        start = to_device(self.counts, real.device)[:, None]
        return (start + real.long().cumsum(1) - 1).clamp(min=0)

    def mask(self, real: torch.Tensor) -> torch.Tensor:
        """The 2D attention mask (B, L + T) of a pass: the valid slots, then the pass's real entries."""
        return torch.cat([self.valid, real], dim=1)

    def append(self, real: torch.Tensor, fed: Sequence[int] | None = None) -> None:
        """A pass's entries join the storage; `fed` (each row's real entries, where the caller knows them) spares a
        read back from the device."""
        self.valid = torch.cat([self.valid, real], dim=1)
        self.counts = [c + n for c, n in zip(self.counts, real.sum(1).tolist() if fed is None else fed)]

    def full(self) -> bool:
        """Whether every row holds every slot (no hole, no padding), from the host's counts alone."""
        return all(c == self.length for c in self.counts)

    def keep_entries(self, width: int, entries: Sequence[Sequence[int]]) -> int:
        """Of the last pass's `width` entries (the storage's last columns), keep these per row (entry 0 is the pass's
        first); the rest become holes, as a draft tree's nodes off its accepted path do. Each row's kept entries must
        hold its next positions in order (a tree's root and accepted path do). Returns the trimmed storage length."""
        keep = torch.zeros(len(entries), width, dtype=torch.bool)
        for r, e in enumerate(entries):
            keep[r, list(e)] = True
        tail = self.valid[:, self.length - width :]
        kept = tail & keep.to(tail.device)
        dropped = (tail & ~kept).sum(1).tolist()
        self.valid = torch.cat([self.valid[:, : self.length - width], kept], dim=1)
        self.counts = [c - d for c, d in zip(self.counts, dropped)]
        return self.trim()

    def keep(self, counts: Sequence[int]) -> int:
        """Keep each row's first counts[r] valid slots (in storage order); returns the trimmed storage length."""
        if list(counts) != self.counts:
            n = to_device(counts, self.valid.device)[:, None]
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
        index = to_device(rows, self.valid.device)
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


def gather_slots(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x (B, H, L, D) -> (B, H, m, D) at each row's slots index (B, m)."""
    b, h, _, d = x.shape
    index = index.to(x.device)  # under a device map each layer's cache sits with its layer
    return x.gather(2, index[:, None, :, None].expand(b, h, index.shape[1], d))


class BatchKV:
    """A transformers DynamicCache over B rows with per-row valid slots (see Slots), and the forward that feeds it.

    On a CPU, with `room` > 0 each layer writes into a buffer of the prefill's length plus `room` positions
    (kernels.decode's PreallocatedLayer, which grows when full) instead of concatenating; `grouped` lets one-token
    passes attend with kernels.decode's grouped products where the model attends with sdpa. None: as measured
    faster for this many rows (ROOM, PREALLOCATE_ROWS, GROUPED_ROWS).
    """

    def __init__(self, model, rows: int, room: int | None = None, grouped: bool | None = None):
        from transformers import DynamicCache

        if room is None:
            room = ROOM if PREALLOCATE_ROWS and rows >= PREALLOCATE_ROWS else 0
        self.model = model
        self.device = execution_device(model)  # where the input ids go, under a device map too
        self.cache = decode_cache(model, 0, room) if room else DynamicCache(config=model.config)
        self.grouped = bool(GROUPED_ROWS and rows >= GROUPED_ROWS) if grouped is None else grouped
        self.slots = Slots(rows, self.device)

    @property
    def counts(self) -> list[int]:
        return self.slots.counts

    @property
    def takes_trees(self) -> bool:
        """Whether a pass may feed a draft tree: the model's attention must take a 4D mask (sdpa or eager)."""
        return self.model.config._attn_implementation in ("sdpa", "eager")

    def inputs(self, tokens: torch.Tensor, real: torch.Tensor, fed: Sequence[int] | None = None) -> dict:
        """Forward keyword arguments for tokens (B, T) whose real entries are `real` (B, T) bool (`fed`: each row's
        count of them, where the caller knows it: then nothing is read back from the device)."""
        mask = self.slots.mask(real)
        full = bool(mask.all()) if fed is None else self.slots.full() and all(n == tokens.shape[1] for n in fed)
        if full:  # no hole, no padding: positions follow the cache, as in a plain forward
            return dict(input_ids=tokens, use_cache=True, **with_cache(self.model, self.cache))
        return dict(input_ids=tokens, attention_mask=mask, position_ids=self.slots.positions(real), use_cache=True,
                    **with_cache(self.model, self.cache))

    def tree_inputs(self, tokens: torch.Tensor, tree) -> dict:
        """Forward keyword arguments for a draft tree's pass (engine.tree.TreeBatch, entry 0 the pending token): each
        entry at its row's next position plus its depth, attending to the row's valid slots and its ancestors (a 4D
        mask (B, 1, T, L + T): bool for sdpa, additive for eager attention)."""
        b, t = tokens.shape
        past = self.slots.valid[:, None, :].expand(b, t, self.slots.length)
        mask = torch.cat([past, tree.mask], dim=2)[:, None]  # (B, 1, T, L + T)
        if self.model.config._attn_implementation == "eager":
            dtype = self.model.dtype
            mask = torch.zeros((), dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
        positions = to_device(self.counts, tokens.device)[:, None] + tree.depths
        return dict(input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=True,
                    **with_cache(self.model, self.cache))

    def forward(self, tokens: torch.Tensor, real: torch.Tensor, keep: int, layers: tuple[int, ...] | None = None,
                tree=None, fed: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the model on tokens (B, T) after the cache; logits (B, keep, V) and, unless layers is None, the
        features (B, T, W) of target_features (below). `tree`: the pass is a draft tree's (tree_inputs). `fed`: each
        row's real entries where the caller knows them (nothing is then read back from the device)."""
        before = self.cache.get_seq_length()
        inputs = self.inputs(tokens, real, fed) if tree is None else self.tree_inputs(tokens, tree)
        self.width = tokens.shape[1]
        features = None
        # grouped products for one query per row where many rows decode (sdpa is faster for a few); several queries
        # (a verify pass, a prefill) attend over the key/value heads as they are (kernels.decode.grouped_attention)
        grouped = self.grouped or tokens.shape[1] > 1
        with grouped_attention_on(self.model) if grouped else contextlib.nullcontext():
            if layers is None:
                logits = self.model(**inputs, logits_to_keep=keep).logits
            else:
                last, features = target_features(self.model, layers, **inputs)
                logits = self.model.lm_head(last[:, -keep:])
        if self.cache.get_seq_length() != before + tokens.shape[1]:
            raise GenerationError(f"{type(self.model).__name__}'s forward did not fill the KV cache it was given")
        self.slots.append(real, fed)
        # under a device map the head may compute elsewhere than the embeddings: bring the outputs to the inputs
        return logits.to(self.device), None if features is None else features.to(self.device)

    def prefill(self, prompts: Sequence[list[int]], layers: tuple[int, ...] | None = None):
        """Feed each prompt (left-padded); (logits (B, V) at each prompt's last token, per row features
        (len(prompt), W) or None)."""
        tokens, real = left_padded(prompts, self.device)
        logits, features = self.forward(tokens, real, 1, layers)
        hidden = None if features is None else [features[r, tokens.shape[1] - len(p):] for r, p in enumerate(prompts)]
        return logits[:, -1], hidden

    def step(self, feeds: Sequence[Sequence[int]]) -> torch.Tensor:
        """Feed each row its own tokens (left-padded to one width; a row may feed none) and return the logits (B, V)
        at each row's newest token."""
        tokens, real = left_padded(feeds, self.device)
        return self.forward(tokens, real, 1, fed=[len(f) for f in feeds])[0][:, -1]

    def keep(self, counts: Sequence[int]) -> None:
        """Roll each row back to its first counts[r] valid positions."""
        crop_cache(self.cache, self.slots.keep(counts))

    def keep_entries(self, entries: Sequence[Sequence[int]]) -> None:
        """Of the last forward's entries keep these per row (a tree's root and accepted path, ascending from 0): they
        are copied down to the pass's first slots, every layer at once (a gather of at most the path's depth per row;
        a chain's kept entries already lie there, and nothing is copied), and the rest roll back as a chain's do. So a
        tree step leaves no more holes than a chain step: holes make every later pass attend over them, under a mask,
        until a compaction gathers the whole cache."""
        width = self.width
        moves = path_moves([self.slots.length - width] * len(entries), entries, self.device)
        if moves is not None:
            for layer in self.cache.layers:
                for buf in (layer.keys, layer.values):
                    move_slots(buf, *(m.to(buf.device) for m in moves))  # a device map's other devices
        crop_cache(self.cache, self.slots.keep_entries(width, [range(len(e)) for e in entries]))

    def select(self, rows: Sequence[int]) -> None:
        """Keep only these rows (finished ones leave the batch)."""
        if list(rows) == list(range(len(self.counts))):
            return
        self.cache.reorder_cache(to_device(rows, self.device))
        crop_cache(self.cache, self.slots.select(rows))
        self.compact()

    def compact(self) -> None:
        """Gather each row's valid slots to the front where holes have piled up (Slots.compaction)."""
        index = self.slots.compaction()
        if index is None:
            return
        for layer in self.cache.layers:
            keys, values = gather_slots(layer.keys, index), gather_slots(layer.values, index)
            if hasattr(layer, "hold"):  # a preallocated layer: into its buffer
                layer.hold(keys, values)
            else:
                layer.keys, layer.values = keys, values


def path_moves(starts: Sequence[int], entries: Sequence[Sequence[int]],
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Where a tree step's kept entries go (each row's, ascending from 0, its pass's first entry at slot starts[r]):
    (src, dst) slots (B, m) on `device` that copy entry e[i] down to starts[r] + i (past a row's path, a slot onto
    itself), sent without waiting; None when every row's kept entries already lie there (a chain's)."""
    if all(list(e) == list(range(len(e))) for e in entries):
        return None
    m = max(len(e) for e in entries)
    src = [[s + (e[i] if i < len(e) else i) for i in range(m)] for s, e in zip(starts, entries)]
    dst = [[s + i for i in range(m)] for s in starts]
    return to_device(src, device, torch.long), to_device(dst, device, torch.long)


def move_slots(buf: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """buf (..., B, H, L, D) (one layer's, or every layer's keys and values at once): each row's slots src (B, m)
    copied to its slots dst (B, m), in place (read before written)."""
    if src.shape[0] == 1:  # one row: a plain select and copy, a third of gather and scatter's time on a CPU
        buf.index_copy_(-2, dst[0], buf.index_select(-2, src[0]))
        return
    shape = (*buf.shape[:-2], src.shape[1], buf.shape[-1])
    buf.scatter_(-2, dst[:, None, :, None].expand(shape), buf.gather(-2, src[:, None, :, None].expand(shape)))


def left_padded(rows: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (tokens (B, T), real (B, T) bool), padded on the left so each row ends in the last column
    (kernels.left_pad; a row may be empty)."""
    tokens, mask = left_pad([list(r) for r in rows], PAD, device)
    return tokens, mask.bool()


def right_padded(rows: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (tokens (B, T), real (B, T) bool), padded on the right: entry j of a row is its j-th token."""
    width = max((len(r) for r in rows), default=0)
    shape = (len(rows), width)  # built from Python lists: two tensors, whatever the batch (no op per row)
    tokens = to_device([[*r, *[PAD] * (width - len(r))] for r in rows], device, torch.long).reshape(shape)
    real = to_device([[True] * len(r) + [False] * (width - len(r)) for r in rows], device, torch.bool).reshape(shape)
    return tokens, real  # no wait for queued work


def check_cache(model, rows: int) -> None:
    """Holes and per-row positions assume full attention over one growing cache; a single row has no holes, so any
    cache transformers builds for the model serves it."""
    types = set(getattr(model.config, "layer_types", None) or ["full_attention"])
    if rows > 1 and types != {"full_attention"}:
        raise GenerationError(f"batched decoding supports full-attention models only ({type(model).__name__} has "
                              f"{sorted(types)} layers)")


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


def target_features(model, layers: tuple[int, ...] = (), **inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(last_hidden_state (B, T, H), features (B, T, W)): the final hidden state, then the hidden state after each
    decoder layer in `layers` (EAGLE-3 style fusion; W = H * (1 + len(layers)))."""
    out = model.model(**inputs, output_hidden_states=bool(layers))
    last = out.last_hidden_state
    if not layers:
        return last, last
    return last, torch.cat([last] + [out.hidden_states[i] for i in layers], dim=-1)
