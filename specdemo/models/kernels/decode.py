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

GROUPED = "specdemo_grouped"  # the name grouped_attention is registered under in transformers' attention interface


def left_pad(rows: list[list[int]], pad: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (B, W), attention mask (B, W), 1 on real tokens) for token rows of different lengths, padded on the left
    with `pad` so that every row's next token is written at the same column."""
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    return ids, mask


@functools.cache
def _preallocated_layer() -> type:
    """The PreallocatedLayer class, made on first use so that importing kernels does not import transformers."""
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        """A KV-cache layer (transformers' DynamicLayer) that writes into a buffer of `capacity` positions instead of
        concatenating; keys and values are views of its first positions."""

        def __init__(self, capacity: int):
            super().__init__()
            self.capacity = capacity

        def update(self, key_states, value_states, *args, **kwargs):
            t = key_states.shape[-2]
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
                b, h, _, d = key_states.shape
                self.k_buf = key_states.new_empty(b, h, max(self.capacity, t), d)
                self.v_buf = value_states.new_empty(b, h, max(self.capacity, t), value_states.shape[-1])
                self.n = 0
            self.k_buf[:, :, self.n : self.n + t] = key_states
            self.v_buf[:, :, self.n : self.n + t] = value_states
            self.n += t
            self.keys, self.values = self.k_buf[:, :, : self.n], self.v_buf[:, :, : self.n]
            return self.keys, self.values

    return PreallocatedLayer


def decode_cache(model, capacity: int):
    """A DynamicCache for `model`; on a CPU, each layer writes into a buffer of `capacity` positions (prompt width
    plus every token to be fed) instead of concatenating at every step."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    if model.device.type == "cpu":
        cache.layers = [_preallocated_layer()(capacity) for _ in cache.layers]
    return cache


def grouped_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """sdpa's attention, for one query token as plain products over the key/value heads (query (B, Hq, 1, D), key
    and value (B, Hkv, L, D)); anything else goes to sdpa itself."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.shape[2] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
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
