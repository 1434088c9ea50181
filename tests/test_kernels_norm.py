"""CUDA's fused RMSNorm (models/kernels/norm.py): transformers' Llama-style norms computed by torch's rms_norm. On the
CPU it decomposes into transformers' own ops, so a patched model's logits are bit for bit the unpatched ones (float32
and bfloat16, whole passes, and a greedy decode); on CUDA (scripts/gpu_check.sh) each norm is one fused kernel, its
output the eager norm's to float rounding."""

import pytest
import torch
from conftest import TEST_DEVICE, tiny_llama
from torch.utils._python_dispatch import TorchDispatchMode

from specdemo.models.kernels import fuse_norms


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norms_give_the_same_logits(dtype):
    """Every norm of a tiny llama (two a layer and the last) patched: the same logits as before, to the bit on the
    CPU, on prompts of several lengths."""
    model = tiny_llama(16, seed=3, layers=3).to(dtype)
    ids = torch.tensor([[1, 5, 3, 9, 2, 7, 7, 4]], device=model.device)
    with torch.inference_mode():
        before = model(input_ids=ids).logits
        assert fuse_norms(model) == 2 * 3 + 1
        after = model(input_ids=ids).logits
    if TEST_DEVICE.type == "cpu":
        assert torch.equal(before, after)
    else:
        assert torch.allclose(before.float(), after.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-4,
                              atol=1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_fused_norms_decode_the_same_tokens(tiny_tok):
    """A patched tiny llama's greedy decode through the engine is the unpatched one's."""
    from specdemo.config import GenerationConfig
    from specdemo.engine import decode, row_outputs

    config = GenerationConfig(max_new_tokens=24)
    prompts = [[3, 5, 7, 3, 5, 9, 2], [4, 4, 1]]
    model = tiny_llama(16, seed=4, layers=2)
    before = row_outputs(list(decode(model, tiny_tok, prompts, config)), 2)
    fuse_norms(model)
    assert row_outputs(list(decode(model, tiny_tok, prompts, config)), 2) == before


@pytest.mark.skipif(TEST_DEVICE.type != "cuda", reason="the fused kernel is CUDA's")
def test_a_fused_norm_is_one_kernel_on_cuda():
    """On CUDA a patched norm dispatches aten._fused_rms_norm, not the six ops of transformers' eager norm."""
    model = tiny_llama(16, seed=3, layers=1)
    fuse_norms(model)
    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    with torch.inference_mode(), Ops():
        model.model.norm(torch.randn(1, 4, 32, device=TEST_DEVICE))
    assert "_fused_rms_norm" in seen and "pow" not in seen, seen


def test_a_norm_under_accelerates_hook_keeps_it():
    """A norm that accelerate hooked (as a device map does, to stream its weight in) still runs the hook around the
    fused forward: the hook's pre_forward sees every call, and the output is the unpatched one."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    class Counting(ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            Counting.calls += 1
            return args, kwargs

    model = tiny_llama(16, seed=3, layers=1)
    norm = model.model.norm
    add_hook_to_module(norm, Counting())
    x = torch.randn(1, 4, 32, device=TEST_DEVICE)
    with torch.inference_mode():
        before = norm(x)
        assert fuse_norms(model) == 3 and Counting.calls == 1
        after = norm(x)
    assert Counting.calls == 2
    assert torch.allclose(before, after, rtol=1e-5, atol=1e-6)
    assert TEST_DEVICE.type != "cpu" or torch.equal(before, after)
