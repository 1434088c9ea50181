"""The few-row CPU product equals F.linear up to rounding, and leaves training untouched
(specdemo.models.kernels.linear)."""

import importlib

import pytest
import torch
from torch import nn

from specdemo.models import kernels

linear_module = importlib.import_module("specdemo.models.kernels.linear")  # `kernels.linear` is the function


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 8, 9, 40])
def test_few_row_linear_matches_f_linear(rows, packed):
    torch.manual_seed(rows)
    layer = nn.Linear(64, 300, bias=True)
    x = torch.randn(1, rows, 64)
    want = nn.functional.linear(x, layer.weight, layer.bias)
    copy = kernels.Packed() if packed else None
    assert not packed or copy.get(layer.weight) is not None  # the CPU torch builds this project installs have oneDNN
    with torch.inference_mode():
        got = kernels.linear(x, layer.weight, layer.bias, copy)
    assert got.shape == want.shape
    assert got.is_contiguous()  # a transposed result made every later kernel of the pass 2-5x slower
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_patch_covers_every_linear_and_keeps_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4, bias=False))
    x = torch.randn(2, 8)
    before = model(x)
    assert kernels.patch_linears(model) == 2
    assert kernels.patch_linears(model) == 0  # idempotent
    after = model(x)  # gradients enabled: the stock kernel, bit for bit
    assert torch.equal(before, after)
    after.sum().backward()
    assert model[0].weight.grad is not None
    with torch.inference_mode():
        torch.testing.assert_close(model(x[:1]), before[:1], rtol=1e-5, atol=1e-6)


def test_packed_copy_only_for_cpu_float32_and_made_at_patch_time():
    assert kernels.pack(torch.randn(4, 8, dtype=torch.bfloat16)) is None
    layer = nn.Linear(8, 4)
    kernels.patch_linears(layer)
    assert layer._specdemo_packed.tensor is not None
    other = nn.Linear(8, 4)
    kernels.patch_linears(other, packed=False)
    assert other._specdemo_packed is None
    x = torch.randn(5, 8)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_no_packed_copies_without_memory_for_them(monkeypatch):
    monkeypatch.setattr(linear_module, "available_memory", lambda: 4 * 8 * 4 * 4 - 1)  # a quarter is one byte short
    layer = nn.Linear(8, 4)
    kernels.patch_linears(layer)
    assert layer._specdemo_packed is None
    monkeypatch.setattr(linear_module, "available_memory", lambda: 4 * 8 * 4 * 4)
    layer = nn.Linear(8, 4)
    kernels.patch_linears(layer)
    assert layer._specdemo_packed.tensor is not None


def test_packed_copy_follows_weight_changes_and_deepcopy():
    import copy

    torch.manual_seed(0)
    layer = nn.Linear(8, 4)
    kernels.patch_linears(layer)
    twin = copy.deepcopy(layer)  # an opaque oneDNN tensor cannot be deep-copied; the holder starts empty instead
    with torch.no_grad():
        twin.weight.add_(1.0)
    layer.load_state_dict({"weight": torch.zeros(4, 8), "bias": torch.ones(4)})
    x = torch.randn(5, 8)
    with torch.inference_mode():
        torch.testing.assert_close(twin(x), nn.functional.linear(x, twin.weight, twin.bias), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer(x), torch.ones(5, 4))


def test_enabled_only_for_cpu_float32(monkeypatch):
    """A pure function of device and dtype: SPECDEMO_FAST_LINEAR=0 is read at the edge (config.Runtime.fast_linear),
    and the callers skip the kernels then; here it changes nothing."""
    assert kernels.enabled_for(torch.device("cpu"), torch.float32)
    assert not kernels.enabled_for(torch.device("cpu"), torch.bfloat16)
    assert not kernels.enabled_for(torch.device("cuda"), torch.float32)
    monkeypatch.setenv("SPECDEMO_FAST_LINEAR", "0")
    assert kernels.enabled_for(torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("k", [1, 3, 4])
def test_patched_models_decode_losslessly(tiny_tok, k):
    """With the few-row product in both models, greedy speculative output is still the target's greedy output."""
    from conftest import tiny_llama

    from specdemo.config import GenerationConfig
    from specdemo.drafters import ModelDrafter
    from specdemo.engine import autoregressive, generated_ids, speculative

    target, draft = tiny_llama(16, seed=11, sharpness=4.0), tiny_llama(16, seed=12, sharpness=4.0, layers=1)
    config = GenerationConfig(max_new_tokens=30, num_draft_tokens=k)
    prompt = [3, 5, 7, 3, 5, 9, 2]
    stock = generated_ids(list(autoregressive(target, tiny_tok, prompt, config)))
    kernels.patch_linears(target)
    kernels.patch_linears(draft)
    ar = generated_ids(list(autoregressive(target, tiny_tok, prompt, config)))
    sd = generated_ids(list(speculative(target, tiny_tok, ModelDrafter(draft), prompt, config)))
    assert ar == stock and sd == ar


def test_cudnn_attention_is_left_out_on_cuda_only(monkeypatch):
    """cuDNN attention builds a plan per new shape (every decoding step): it is turned off for CUDA models, unless
    keep_cudnn (SPECDEMO_CUDNN_SDPA=1, read at the edge; the variable itself changes nothing here); a CPU model leaves
    the setting alone."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        assert not kernels.plan_free_attention(torch.device("cpu")) and torch.backends.cuda.cudnn_sdp_enabled()
        assert not kernels.plan_free_attention(torch.device("cuda"), keep_cudnn=True)
        assert torch.backends.cuda.cudnn_sdp_enabled()
        monkeypatch.setenv("SPECDEMO_CUDNN_SDPA", "1")
        assert kernels.plan_free_attention(torch.device("cuda")) and not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
