"""Pieces of fast batched decoding, one new token per row per pass, on a CPU: left-padded batches, a KV cache that
writes into one buffer made for the whole answer, and attention for one query as plain products grouped by key/value
head. Knows transformers' cache and attention registries; nothing of tokenizers, sampling or what is recorded.
"""

# Why (profiled in docs/notes/kernels.md): decoding many rows at once on a CPU spent its time in the weights'
# products, in sdpa's flash kernel running a single query per key/value head, and in concatenating the KV cache. A
# buffer made once for the whole answer removes the copies, and plain products with the query heads of each key/value
# head grouped beat the flash kernel for one query.

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from ..placement import to_device

GROUPED = "specdemo_grouped"  # the name grouped_attention is registered under in transformers' attention interface


def left_pad(rows: list[list[int]], pad: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (B, W), attention mask (B, W), 1 on real tokens) for token rows of different lengths, padded on the left
    with `pad` so that every row's next token is written at the same column."""
    width = max(map(len, rows))
    ids = to_device([[pad] * (width - len(r)) + r for r in rows], device)
    mask = to_device([[0] * (width - len(r)) + [1] * len(r) for r in rows], device)
    return ids, mask


@functools.cache
def _preallocated_layer() -> type:
    """The PreallocatedLayer class, made on first use so that importing kernels does not import transformers."""
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        """A KV-cache layer (transformers' DynamicLayer) that writes into a buffer of `capacity` positions instead of
        concatenating (`room` more than the first pass's length, when that is more); keys and values are views of
        its first `n` positions. Rollback (crop) sets n; row selection and `hold` (compaction) write into the buffer;
        it grows by half when a pass would overflow it."""

        def __init__(self, capacity: int, room: int = 0):
            super().__init__()
            self.capacity, self.room = capacity, room

        def update(self, key_states, value_states, *args, **kwargs):
            t = key_states.shape[-2]
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
                self.k_buf, self.v_buf = self._buffers(key_states, value_states, max(self.capacity, t + self.room))
                self.n = 0
            elif self.n + t > self.k_buf.shape[2]:
                self._grow(self.n + t)
            self.k_buf[:, :, self.n : self.n + t] = key_states
            self.v_buf[:, :, self.n : self.n + t] = value_states
            self.n += t
            self._view()
            return self.keys, self.values

        @staticmethod
        def _buffers(keys, values, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
            b, h, _, d = keys.shape
            return keys.new_empty(b, h, capacity, d), values.new_empty(b, h, capacity, values.shape[-1])

        def _view(self) -> None:
            self.keys, self.values = self.k_buf[:, :, : self.n], self.v_buf[:, :, : self.n]

        def _grow(self, needed: int) -> None:
            self.capacity = max(needed, self.k_buf.shape[2] * 3 // 2)
            k_buf, v_buf = self._buffers(self.k_buf, self.v_buf, self.capacity)
            k_buf[:, :, : self.n], v_buf[:, :, : self.n] = self.keys, self.values
            self.k_buf, self.v_buf = k_buf, v_buf
            self._view()

        def hold(self, keys: torch.Tensor, values: torch.Tensor) -> None:
            """Hold these keys and values (B', H, n, D), B' <= B (a selection or compaction of the layer's own):
            written into the front of the buffer, which they never alias (gather and index_select copy)."""
            b, n = keys.shape[0], keys.shape[2]
            self.k_buf, self.v_buf = self.k_buf[:b], self.v_buf[:b]
            if n > self.k_buf.shape[2]:
                self.n = 0
                self._grow(n)
            self.k_buf[:, :, :n], self.v_buf[:, :, :n] = keys, values
            self.n = n
            self._view()

        def crop(self, tokens_to_remove: int) -> None:
            if tokens_to_remove > 0:
                raise ValueError(f"crop takes a negative count of positions to remove, not {tokens_to_remove}")
            if tokens_to_remove and self.is_initialized:
                self.n = max(0, self.n + tokens_to_remove)
                self._view()

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self.is_initialized:
                indices = torch.as_tensor(indices, device=self.k_buf.device)
                self.hold(self.keys.index_select(0, indices), self.values.index_select(0, indices))

        reorder_cache = batch_select_indices

        def batch_repeat_interleave(self, repeats: int) -> None:
            raise NotImplementedError("a preallocated layer does not repeat its rows")

    return PreallocatedLayer


def decode_cache(model, capacity: int, room: int = 0):
    """A DynamicCache for `model`; on a CPU, each layer writes into a buffer of `capacity` positions (prompt width
    plus every token to be fed), or the first pass's length plus `room` if more, instead of concatenating at every
    step (growing if a pass would overflow it)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    if model.device.type == "cpu":
        cache.layers = [_preallocated_layer()(capacity, room) for _ in cache.layers]
    return cache


_SDPA_GQA = torch.__version__ >= (2, 5)  # sdpa takes enable_gqa (TorchVersion compares with a tuple)


def grouped_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """sdpa's attention, for one query token as plain products over the key/value heads (query (B, Hq, 1, D), key
    and value (B, Hkv, L, D)); several queries under a mask (a verify pass, a tree's, a padded prefill) through sdpa
    over the key/value heads as they are (enable_gqa), where transformers' sdpa first copies the whole cache's keys
    and values Hq / Hkv times (repeat_kv: 1.3 ms of a 2-token pass of the bundled model on 2 cores, more as the
    context grows); anything else goes to transformers' sdpa itself."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.shape[2] != 1:
        if attention_mask is None or not _SDPA_GQA or kwargs.get("position_bias") is not None or \
                key.shape[1] == query.shape[1]:
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                          **kwargs)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                               dropout_p=dropout, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    b, hq, _, d = query.shape
    q = query.reshape(b, key.shape[1], hq // key.shape[1], d)  # (B, Hkv, Hq / Hkv, D): query heads grouped
    scores = torch.matmul(q, key.transpose(-1, -2)).float() * (scaling if scaling is not None else d ** -0.5)
    if attention_mask is not None:  # sdpa's mask: (B, 1, 1, L), True where a row attends
        scores = (scores.masked_fill(~attention_mask, float("-inf")) if attention_mask.dtype == torch.bool
                  else scores + attention_mask)
    out = torch.matmul(torch.softmax(scores, -1).to(value.dtype), value)  # (B, Hkv, Hq / Hkv, D)
    return out.reshape(b, hq, 1, d).transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def grouped_attention_on(model) -> Iterator[None]:
    """Within the block, a CPU `model` that attends with sdpa attends with `grouped_attention` (and sdpa's masks);
    other models (eager on request, a GPU's kernels) are left alone."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    config, before = model.config, model.config._attn_implementation
    if model.device.type != "cpu" or before != "sdpa":
        yield
        return
    AttentionInterface.register(GROUPED, grouped_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(GROUPED, sdpa_mask)
    config._attn_implementation = GROUPED
    try:
        yield
    finally:
        config._attn_implementation = before
