"""A static KV cache: each layer's keys and values in buffers allocated once, at fixed addresses (views of one block
where the layers' shapes agree, so that moving rows or slots is one op for all of them), each row written at its own
positions. The forwards that feed it are plain tensor code over those buffers, so a CUDA graph can capture
them (engine.graphs); on a CPU the same code runs uncaptured.

Row r holds its positions 0..lengths[r]-1 contiguously, with no holes: a pass writes row r's j-th entry at slot
lengths[r] + j and attends to the slots before them and, among its own entries, to those the pass's layout allows (a
chain: the earlier ones; a draft tree: its ancestors, each at its row's length plus its depth). The layout sits in
device buffers, so one captured graph per width serves chains and trees. Rollback sets a row's length and copies
nothing: what lies past it is never read and is overwritten by the next pass; after a tree, the accepted path's
entries are copied down to follow the row's length (at most its depth per layer). Knows nothing of drafting,
acceptance or graphs.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from ..config import MAX_K_ENGINE
from ..models.placement import execution_device, staged, to_device
from .kv import PAD, path_moves, right_padded, target_features, with_cache
from .kv import move_slots as _move_slots  # the tests watch this name

CAPACITY_STEP = 256  # a storage's positions per row are a multiple of this, so nearby requests share one (and graphs)
LAYOUT_WIDTH = MAX_K_ENGINE + 1  # the widest pass whose layout (depths, ancestry) comes from the buffers: any verify
# (class, method) of the code that captured graphs replay: Storage.run here, a head's (drafters.eagle3_static) added
# when it is imported; what specdemo.measure.glue leaves out when it counts a step's work between graphs
CAPTURED: list[tuple[type, str]] = []


@functools.cache
def _classes() -> tuple[type, type]:
    """(RowLayer, RowCache), made on first use so that importing the engine does not import transformers."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    class RowLayer(CacheLayerMixin):
        """One layer's keys and values (rows, H, capacity, D); a pass writes each row at the storage's `write` slots
        (b, T) and returns the first b rows' whole buffers (the mask says which slots a query reads)."""

        is_compileable = True
        is_sliding = False

        def __init__(self, storage: Storage, index: int):
            super().__init__()
            self.storage, self.index = storage, index

        def lazy_initialization(self, key_states, value_states) -> None:
            s, (h, d), dv = self.storage, key_states.shape[1::2], value_states.shape[-1]
            block = s.block
            if block is not None and block.shape[3::2] == (h, d) and dv == d and block.dtype == key_states.dtype:
                self.keys, self.values = block[self.index, 0], block[self.index, 1]  # views: (rows, H, capacity, D)
                s.in_block += 1
            else:  # a layer of another shape: its own buffers, and no moves over the block
                s.block = None
                self.keys = key_states.new_zeros(s.rows, h, s.capacity, d)
                self.values = value_states.new_zeros(s.rows, h, s.capacity, dv)
            if not torch.compiler.is_compiling():
                torch._dynamo.mark_static_address(self.keys)  # fixed addresses: what a captured graph reads
                torch._dynamo.mark_static_address(self.values)
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            b, h, t, d = key_states.shape
            index = self.storage.write[:, None, :, None]  # (b, 1, T, 1): row r's j-th entry goes to its write slot
            self.keys[:b].scatter_(2, index.expand(b, h, t, d), key_states)
            self.values[:b].scatter_(2, index.expand(b, h, t, value_states.shape[-1]), value_states)
            return self.keys[:b], self.values[:b]

        def copy_rows(self, other, rows: int) -> None:
            """Hold the first `rows` rows of another RowLayer (a smaller storage's), position for position."""
            if not other.is_initialized:
                return
            if not self.is_initialized:
                self.lazy_initialization(other.keys[:1, :, :1], other.values[:1, :, :1])
            n = min(other.keys.shape[2], self.keys.shape[2])
            self.keys[:rows, :, :n] = other.keys[:rows, :, :n]
            self.values[:rows, :, :n] = other.values[:rows, :, :n]

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.storage.capacity, 0

        def get_seq_length(self) -> int:
            return 0  # positions are always given explicitly

        def get_max_length(self) -> int:
            return self.storage.capacity

    class RowCache(Cache):
        """transformers' Cache over RowLayers (so the model's attention calls `update` as with any cache)."""

        def __init__(self, storage: Storage, num_layers: int):
            super().__init__(layers=[RowLayer(storage, i) for i in range(num_layers)])

    return RowLayer, RowCache


def _text_config(model):
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def num_cache_layers(model) -> int:
    return _text_config(model).num_hidden_layers


def kv_block(model, rows: int, capacity: int, device: torch.device) -> torch.Tensor | None:
    """Every layer's keys and values in one tensor (layers, 2, rows, H, capacity, D) of the shapes the config says,
    made outside any compiled or captured code, so that moving rows or slots is one op for all layers; None where the
    config does not say them (each layer then allocates its own at its first pass, as it does if its shape differs)."""
    c = _text_config(model)
    heads = getattr(c, "num_key_value_heads", None) or getattr(c, "num_attention_heads", None)
    dim = getattr(c, "head_dim", None) or (c.hidden_size // c.num_attention_heads
                                           if getattr(c, "num_attention_heads", None) else None)
    if not heads or not dim:
        return None
    block = torch.zeros(num_cache_layers(model), 2, rows, heads, capacity, dim, dtype=model.dtype, device=device)
    torch._dynamo.mark_static_address(block)
    return block


class Storage:
    """The static buffers of up to `rows` rows and `capacity` positions each: the cache, each row's length (a device
    tensor that the passes read), the write slots of the current pass, and a flat token buffer the passes read their
    input ids from. A graph captured over a Storage replays against these same addresses."""

    def __init__(self, model, rows: int, capacity: int):
        self.model, self.rows, self.capacity = model, rows, capacity
        self.device = execution_device(model)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=self.device)  # (rows,)
        self.slots = torch.arange(capacity, device=self.device)  # (capacity,)
        self.tokens = torch.full((rows * capacity,), PAD, dtype=torch.long, device=self.device)
        self.write = self.lengths[:1, None]  # (b, T): set by each pass before the model runs
        # each pass's layout over its entries: depth (rows, W) and ancestry (rows, W, W), [j, i] = entry j sees entry
        # i; a chain's is arange and causal (set_layout); a wider pass (a long prefill) is causal by construction
        self.chain_depth = torch.arange(LAYOUT_WIDTH, device=self.device)
        self.chain_ancestry = torch.ones(LAYOUT_WIDTH, LAYOUT_WIDTH, dtype=torch.bool, device=self.device).tril()
        self.depth = self.chain_depth.repeat(rows, 1)
        self.ancestry = self.chain_ancestry.repeat(rows, 1, 1)
        self.tree_rows = 0  # rows whose layout a tree pass changed (set back before the next chain pass)
        self.block = kv_block(model, rows, capacity, self.device)  # the layers' keys and values are views of it
        self.in_block = 0  # layers whose buffers are views of the block (all of them: whole())
        self.cache = _classes()[1](self, num_cache_layers(model))
        self.cache_argument = with_cache(model, self.cache)  # once: nothing to look up inside a captured pass
        self.eager_mask = model.config._attn_implementation == "eager"  # an additive float mask instead of a bool
        self.busy = False  # held by one decode (or drafter) at a time
        self.released = 0  # when it was last released (Runner.acquire takes the latest first)
        self.graphs: dict = {}  # (b, T, features) -> engine.graphs.Captured, kept with the addresses they read
        self.inputs: dict = {}  # static inputs of captured code from elsewhere (a draft LM's chain: drafters.model)

    def buffers(self) -> list[torch.Tensor]:
        """The cache's buffers, once allocated, rows at dim -4 (..., rows, H, capacity, D): the block alone where every
        layer's keys and values are views of it (one op moves them all), else each layer's keys and values."""
        if (block := self.whole()) is not None:
            return [block]
        return [t for layer in self.cache.layers if layer.is_initialized for t in (layer.keys, layer.values)]

    def whole(self) -> torch.Tensor | None:
        """The block (layers, 2, rows, H, capacity, D) where every layer's buffers are views of it, else None."""
        return self.block if self.block is not None and self.in_block == len(self.cache.layers) else None

    def copy_rows(self, other: Storage, rows: int) -> None:
        """Hold the first `rows` rows of another storage's cache (a smaller one's), position for position."""
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.copy_rows(theirs, rows)

    def input_view(self, b: int, t: int) -> torch.Tensor:
        """The (b, T) input ids a pass of that shape reads: the front of the flat token buffer."""
        return self.tokens[: b * t].view(b, t)

    def set_layout(self, tree=None) -> None:
        """The next pass's layout: a draft tree's (engine.tree.TreeBatch: its rows' depths and ancestry masks), or
        with None the chain's (written back only where a tree pass changed it). An entry sees none after it (a
        node's ancestors come before it), so a pass padded past the tree's entries (engine.graphs.WIDTH_BUCKETS)
        leaves them as they are."""
        if tree is not None:
            b, t = tree.depths.shape
            self.depth[:b, :t].copy_(tree.depths, non_blocking=True)
            self.ancestry[:b, :t, :t].copy_(tree.mask, non_blocking=True)
            self.tree_rows = max(self.tree_rows, b)
        elif self.tree_rows:
            self.depth[: self.tree_rows] = self.chain_depth
            self.ancestry[: self.tree_rows] = self.chain_ancestry
            self.tree_rows = 0

    def run(self, b: int, t: int, keep: int, layers: tuple[int, ...] | None,
            offset: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One pass of the first b rows over input_view(b, t): logits (b, keep, V) and, with layers, features
        (b, T, W). Straight-line tensor code over fixed buffers (what a graph captures); lengths are not moved.
        `offset`: the entries start that far past each row's length (a greedy chain's later passes, drafters.model),
        seeing what lies between as its past."""
        tokens = self.input_view(b, t)
        start = self.lengths[:b, None] + offset if offset else self.lengths[:b, None]  # (b, 1)
        self.write = start + self.slots[None, :t]  # (b, T): the slots written
        if t <= LAYOUT_WIDTH:  # each entry at its row's length plus its depth, seeing the past and what the layout says
            positions = start + self.depth[:b, :t]
            rel = self.slots[None, :] - start  # (b, capacity): each slot's entry of this pass
            seen = self.ancestry[:b, :t, :t].gather(2, rel.clamp(0, t - 1)[:, None, :].expand(b, t, self.capacity))
            allowed = ((rel < 0)[:, None, :] | (((rel >= 0) & (rel < t))[:, None, :] & seen))[:, None]  # (b,1,T,cap)
        else:  # a long prefill: causal
            positions = self.write
            allowed = self.slots[None, None, None, :] <= self.write[:, None, :, None]  # (b, 1, T, capacity)
        if self.eager_mask:
            dtype = self.model.dtype
            allowed = torch.zeros((), dtype=dtype, device=self.device).masked_fill(~allowed, torch.finfo(dtype).min)
        inputs = dict(input_ids=tokens, attention_mask=allowed, position_ids=positions, use_cache=True,
                      **self.cache_argument)
        if layers is None:
            return self.model(**inputs, logits_to_keep=keep).logits, None
        last, features = target_features(self.model, layers, **inputs)
        return self.model.lm_head(last[:, -keep:]), features


CAPTURED.append((Storage, "run"))


class StaticRows:
    """Rows over a storage of static buffers (a Storage, or an EAGLE-3 head's, drafters.eagle3_static): each row's
    length on the host and in the device tensor the passes read, rollback (a length moves), row selection (gathered
    to the front of the same buffers) and growth (one copy into a larger storage from the runner)."""

    def __init__(self, runner, storage, rows: int):
        self.runner, self.storage = runner, storage
        self.device = storage.device
        self.counts = [0] * rows  # the host's copy of each row's length
        storage.lengths.zero_()

    @property
    def rows(self) -> int:
        return len(self.counts)

    def reserve(self, width: int) -> None:
        """Room for a pass of `width` entries past every row's length (growing the storage if it lacks it)."""
        need = max(self.counts, default=0) + width
        if need > self.storage.capacity:
            self._grow(need)

    def _grow(self, need: int) -> None:
        """Move to a storage with room for `need` positions and more (one copy; a draft's cache, which is not told
        the answer's length, may need it)."""
        old = self.storage
        self.storage = self.runner.acquire(self.rows, rounded_capacity(need + CAPACITY_STEP))
        self.storage.copy_rows(old, self.rows)
        self._set_counts(self.counts, clear=True)
        self.runner.release(old)

    def _set_counts(self, counts: Sequence[int], clear: bool = False) -> None:
        """Each row's length, on the host and in the storage's device tensor the passes read; `clear` also sets the
        rows past the batch to 0 (padding that writes at slot 0 and up, never past the end), as a new storage or a
        smaller batch needs."""
        self.counts = list(counts)
        if clear:
            self.storage.lengths.zero_()
        self.storage.lengths[: self.rows].copy_(staged(self.counts, self.device), non_blocking=True)

    def _advance(self, fed: Sequence[int]) -> None:
        """Each row's length grows by what it fed: on the device alone where every row fed the same (a verify pass,
        an autoregressive step), else copied from the host."""
        if len(set(fed)) == 1:
            self.grew(fed[0])
        else:
            self._set_counts([c + n for c, n in zip(self.counts, fed)])

    def grew(self, n: int) -> None:
        """Every row's length grows by n, on the device (one add: nothing copied from the host) and on the host: a
        pass every row fed alike (_advance), or the entries a captured chain wrote past each row's length (cut at the
        next verdict)."""
        if n:
            self.storage.lengths[: self.rows] += n
            self.counts = [c + n for c in self.counts]

    def keep(self, counts: Sequence[int]) -> None:
        """Roll each row back to its first counts[r] positions: a length moves, nothing is copied."""
        counts = [min(a, b) for a, b in zip(self.counts, counts)]
        if counts != self.counts:
            self._set_counts(counts)

    def select(self, rows: Sequence[int]) -> None:
        """Keep only these rows, in this order: gathered to the front of the same buffers (finished rows leave)."""
        rows = list(rows)
        if rows == list(range(self.rows)):
            return
        index = to_device(rows, self.device)
        for buf in self.storage.buffers():  # rows at dim -4
            buf[..., : len(rows), :, :, :] = buf.index_select(-4, index)
        self._set_counts([self.counts[r] for r in rows], clear=True)

    def compact(self) -> None:
        """Nothing to compact: rows hold no holes."""

    def release(self) -> None:
        """Hand the storage back to the runner (the decode or drafter that held it is done)."""
        self.runner.release(self.storage)


class StaticKV(StaticRows):
    """engine.kv.BatchKV's interface over a Storage: the engine's and a draft LM's cache when a graph runner serves
    the model (engine.graphs.Runner), captured passes where it captured them, the same code eagerly elsewhere.

    Prefill runs each prompt but its last token as one right-padded pass, then the last tokens as a one-token pass,
    so every row's first logits come from an ordinary decode-shaped pass.
    """

    takes_trees = True  # a pass may feed a draft tree (Storage.set_layout)

    def _pass(self, tokens: torch.Tensor, keep: int, layers, graph: bool = True, tree=None):
        self.reserve(self.runner.width(tokens.shape[1], keep, graph))  # padded where graphs are captured per bucket
        self.storage.set_layout(tree)
        return self.runner.replay(self.storage, tokens, keep, layers, graph)

    def prefill(self, prompts: Sequence[list[int]], layers: tuple[int, ...] | None = None):
        """Feed each prompt; (logits (B, V) at each prompt's last token, per row features (len(prompt), W) or None)."""
        head = [p[:-1] for p in prompts]
        feats = None
        if max(map(len, head)) > 0:
            tokens, _ = right_padded(head, self.device)
            _, feats = self._pass(tokens, 1, layers, graph=False)
            self._advance([len(h) for h in head])
        logits, last = self._pass(to_device([[p[-1]] for p in prompts], self.device), 1, layers)
        self._advance([1] * len(prompts))
        if layers is None:
            return logits[:, -1], None
        hidden = [last[r] if feats is None else torch.cat([feats[r, : len(h)], last[r]]) for r, h in enumerate(head)]
        return logits[:, -1], hidden

    def forward(self, tokens: torch.Tensor, real: torch.Tensor, keep: int, layers: tuple[int, ...] | None = None,
                tree=None, fed: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens (B, T), right-padded (`real` marks each row's first n entries): logits (B, keep, V) of the last
        `keep` columns and, with layers, features (B, T, W); each row's length grows by its real entries. `tree`: the
        pass is a draft tree's (engine.tree.TreeBatch; entry 0 the pending token). `fed`: each row's real entries
        where the caller knows them (the engine does), so that nothing is read back from the device."""
        if fed is None:  # before the pass is queued: reading it after would wait for the whole pass
            fed = real.sum(1).tolist()
        logits, features = self._pass(tokens, keep, layers, tree=tree)
        self.start = list(self.counts)
        self._advance(fed)
        return logits, features

    def keep_entries(self, entries: Sequence[Sequence[int]]) -> None:
        """Of the last forward's entries keep these per row (a tree's root and accepted path, ascending from 0): they
        are copied down to follow the row's length, every layer at once (a gather of at most the path's depth per
        row; a chain's kept entries already lie there, and nothing is copied)."""
        start = self.start
        moves = path_moves(start, entries, self.device)
        if moves is not None:
            src, dst = moves
            for buf in self.storage.buffers():  # rows at dim -4
                _move_slots(buf[..., : self.rows, :, :, :], src, dst)
        self._set_counts([s + len(e) for s, e in zip(start, entries)])

    def step(self, feeds: Sequence[Sequence[int]]) -> torch.Tensor:
        """Feed each row its own tokens (a row may feed none); logits (B, V) at each row's newest token. A step into an
        empty cache (a draft LM's first, its prompts) runs once: uncaptured, as a prefill is."""
        tokens, real = right_padded(feeds, self.device)
        if tokens.shape[1] == 0:
            tokens, real = torch.full((len(feeds), 1), PAD, device=self.device), real.new_zeros(len(feeds), 1)
        logits, _ = self._pass(tokens, tokens.shape[1], None, graph=any(self.counts))
        last = to_device([max(len(f) - 1, 0) for f in feeds], self.device)  # no sync
        self._advance([len(f) for f in feeds])
        return logits[torch.arange(len(feeds), device=self.device), last]


def needed_capacity(prompts: Sequence[list[int]], max_new_tokens: int, width: int) -> int:
    """Positions a row may reach: the longest prompt, every new token, and one more pass's width past them."""
    return rounded_capacity(max(map(len, prompts), default=0) + max_new_tokens + width + 1)


def rounded_capacity(positions: int) -> int:
    """`positions` rounded up to a multiple of CAPACITY_STEP."""
    return -(-positions // CAPACITY_STEP) * CAPACITY_STEP
