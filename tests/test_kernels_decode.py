"""specdemo.models.kernels.decode: left padding, the preallocated KV cache and grouped one-query attention give what a
stock cache and sdpa give, up to float rounding, and the attention switch is undone after its block."""

import torch
from conftest import tiny_llama

from specdemo.engine.kv import with_cache
from specdemo.models import kernels

VOCAB = 40


def test_left_pad_aligns_every_rows_last_token():
    ids, mask = kernels.left_pad([[5, 6, 7], [8], [9, 10]], pad=0, device="cpu")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 9, 10]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]
    assert ids.dtype == mask.dtype == torch.long


def _decode(model, prompts, steps, fast):
    """Greedy batched decoding, step by step; returns the last hidden states (B, T, H) of every pass, concatenated."""
    from transformers import DynamicCache

    x, mask = kernels.left_pad(prompts, 0, model.device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = kernels.decode_cache(model, x.shape[1] + steps) if fast else DynamicCache(config=model.config)
    states = []
    with kernels.grouped_attention_on(model) if fast else torch.no_grad():
        for _ in range(steps):
            h = model.model(input_ids=x, attention_mask=mask, position_ids=pos, use_cache=True,
                            **with_cache(model.model, cache)).last_hidden_state
            states.append(h)
            x = model.lm_head(h[:, -1]).argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(x)], dim=1)
            pos = pos[:, -1:] + 1
    return torch.cat(states, dim=1)


@torch.inference_mode()
def test_preallocated_cache_and_grouped_attention_match_the_stock_path():
    model = tiny_llama(VOCAB, seed=5, sharpness=6.0)
    assert model.config._attn_implementation == "sdpa"
    prompts = [[3, 5, 7, 9, 11, 2], [4], [8, 8, 1]]
    stock = _decode(model, prompts, 12, fast=False)
    fast = _decode(model, prompts, 12, fast=True)
    assert model.config._attn_implementation == "sdpa"  # restored after the block
    real = kernels.left_pad(prompts, 0, "cpu")[1].bool()  # the padded positions' states are never read
    torch.testing.assert_close(fast[:, : real.shape[1]][real], stock[:, : real.shape[1]][real], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fast[:, real.shape[1] :], stock[:, real.shape[1] :], rtol=1e-4, atol=1e-5)


@torch.inference_mode()
def test_several_queries_under_a_mask_attend_over_the_key_value_heads_as_transformers_sdpa_does(monkeypatch):
    """A verify pass's queries under a 4D mask (4 query heads, 2 key/value heads): grouped_attention gives sdpa's
    output without copying the keys and values per query head (transformers' repeat_kv is never called)."""
    from transformers.integrations import sdpa_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, t, 8, generator=g) for h, t in ((4, 5), (2, 12), (2, 12)))
    mask = torch.rand(2, 1, 5, 12, generator=g) > 0.3
    mask[..., 0] = True  # every query sees something
    module = type("Attn", (), {"num_key_value_groups": 2, "is_causal": True})()
    stock, _ = sdpa_attention.sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    monkeypatch.setattr(sdpa_attention, "repeat_kv", None)  # a call would fail
    grouped, _ = kernels.grouped_attention(module, q, k, v, mask, scaling=0.3)
    torch.testing.assert_close(grouped, stock, rtol=1e-6, atol=1e-6)
    assert grouped.shape == (2, 5, 4, 8) and grouped.is_contiguous()


def test_grouped_attention_is_switched_on_only_inside_the_block_and_only_for_sdpa():
    model = tiny_llama(VOCAB, seed=5)
    with kernels.grouped_attention_on(model):
        assert model.config._attn_implementation == kernels.decode.GROUPED
    assert model.config._attn_implementation == "sdpa"
    model.config._attn_implementation = "eager"  # a model asked for eager attention keeps it
    with kernels.grouped_attention_on(model):
        assert model.config._attn_implementation == "eager"


def test_preallocated_cache_layers_hold_one_buffer_of_the_given_capacity():
    model = tiny_llama(VOCAB, seed=5)
    cache = kernels.decode_cache(model, 20)
    with torch.inference_mode():
        model.model(input_ids=torch.tensor([[3, 4, 5]]), use_cache=True, **with_cache(model.model, cache))
    layer = cache.layers[0]
    assert layer.k_buf.shape[2] == 20 and layer.keys.shape[2] == 3 and cache.get_seq_length() == 3
    assert layer.keys.data_ptr() == layer.k_buf.data_ptr()  # a view of the buffer, not a copy


def test_preallocated_layer_rolls_back_selects_compacts_and_grows_as_a_dynamic_layer_does():
    """crop, row selection, hold (compaction's write) and growth past the capacity leave the same keys and values as
    transformers' DynamicLayer given the same calls, and writes after them land where the DynamicLayer's would."""
    from transformers.cache_utils import DynamicLayer

    g = torch.Generator().manual_seed(0)
    fast, stock = kernels.decode._preallocated_layer()(0, room=2), DynamicLayer()

    def kv(b, t):
        return torch.randn(b, 2, t, 4, generator=g), torch.randn(b, 2, t, 4, generator=g)

    def both(f):
        return f(fast), f(stock)

    def same():
        assert torch.equal(fast.keys, stock.keys) and torch.equal(fast.values, stock.values)

    k, v = kv(3, 5)
    both(lambda layer: layer.update(k, v))
    assert fast.k_buf.shape[2] == 7  # the first pass plus room
    k, v = kv(3, 4)
    both(lambda layer: layer.update(k, v))  # past the capacity: grows
    same()
    both(lambda layer: layer.crop(-3))
    same()
    both(lambda layer: layer.batch_select_indices(torch.tensor([2, 0])))
    same()
    k, v = kv(2, 1)
    both(lambda layer: layer.update(k, v))
    same()
    keep = torch.tensor([[0, 2, 3], [1, 4, 6]])  # a compaction's gather: each row's kept slots, moved to the front
    gathered = [x.gather(2, keep[:, None, :, None].expand(2, 2, 3, 4)) for x in (stock.keys, stock.values)]
    fast.hold(*gathered)
    stock.keys, stock.values = gathered
    same()
    k, v = kv(2, 9)
    both(lambda layer: layer.update(k, v))
    same()
    assert fast.keys.data_ptr() == fast.k_buf.data_ptr()  # still a view of its buffer
