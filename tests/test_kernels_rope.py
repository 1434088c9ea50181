"""q and k's RoPE together (models/kernels/rope.py): transformers' apply_rotary_pos_emb bit for bit (float32 and
bfloat16, grouped-query heads, two rows, every position), a tiny llama's logits and greedy decode the same with it
installed, calls it cannot take (another unsqueeze_dim) passed to transformers' own, and fewer ops a layer."""

import pytest
import torch
from conftest import TEST_DEVICE, tiny_llama
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.llama import modeling_llama

from specdemo.config import GenerationConfig
from specdemo.engine import decode, row_outputs
from specdemo.models import kernels
from specdemo.models.kernels import rope


@pytest.fixture
def fused():
    """joint RoPE installed for the test, transformers' own restored after it (it is process-wide)."""
    kernels.unfuse_rope()
    kernels.fuse_rope()
    yield modeling_llama.apply_rotary_pos_emb
    kernels.unfuse_rope()


def rotary(rows, positions, dim, dtype):
    """cos and sin as LlamaRotaryEmbedding makes them: (rows, T, D)."""
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = positions[:, :, None].float() * inv[None, None, :]
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype).to(TEST_DEVICE), emb.sin().to(dtype).to(TEST_DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_joint_rope_is_transformers_bit_for_bit(fused, dtype):
    original = fused._specdemo_original
    torch.manual_seed(0)
    q = torch.randn(2, 9, 5, 64, dtype=dtype, device=TEST_DEVICE)
    k = torch.randn(2, 3, 5, 64, dtype=dtype, device=TEST_DEVICE)
    cos, sin = rotary(2, torch.tensor([[3, 4, 5, 6, 7], [90, 91, 92, 93, 94]]), 64, dtype)
    want, got = original(q, k, cos, sin), fused(q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert got[0].shape == q.shape and got[1].shape == k.shape
    cos2, sin2 = rotary(2, torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]]), 64, dtype)
    for c, s in ((cos2, sin2), (cos, sin), (cos2, sin2)):  # passes taking turns: each its own sine's signed copy
        assert all(torch.equal(a, b) for a, b in zip(original(q, k, c, s), fused(q, k, c, s)))
    q2, k2 = q.transpose(1, 2), k.transpose(1, 2)  # heads at dim 2: another layout, transformers' own function
    assert all(torch.equal(a, b) for a, b in zip(original(q2, k2, cos, sin, unsqueeze_dim=2),
                                                  fused(q2, k2, cos, sin, unsqueeze_dim=2)))
    assert all(torch.equal(a, b) for a, b in zip(original(q2, k2, cos, sin, 2), fused(q2, k2, cos, sin, 2)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_with_joint_rope_gives_the_same_logits_and_tokens(tiny_tok, dtype):
    model = tiny_llama(16, seed=11, layers=2).to(dtype)
    ids = torch.tensor([[1, 5, 3, 9, 2, 7, 7, 4], [3, 5, 7, 3, 5, 9, 2, 2]], device=model.device)
    config, prompts = GenerationConfig(max_new_tokens=16), [[3, 5, 7, 3, 5, 9, 2], [4, 4, 1]]
    kernels.unfuse_rope()
    with torch.inference_mode():
        before = model(input_ids=ids).logits
    tokens = row_outputs(list(decode(model, tiny_tok, prompts, config)), 2)
    assert kernels.fuse_rope() == len(rope.MODULES) and kernels.fuse_rope() == 0
    try:
        with torch.inference_mode():
            assert torch.equal(model(input_ids=ids).logits, before)
        assert row_outputs(list(decode(model, tiny_tok, prompts, config)), 2) == tokens
    finally:
        kernels.unfuse_rope()


def test_joint_rope_launches_half_the_ops(fused):
    """A layer's RoPE: 5 ops for q and k together (cat, two products, roll, sum) where transformers' takes 10."""
    q, k = torch.randn(1, 4, 3, 8, device=TEST_DEVICE), torch.randn(1, 2, 3, 8, device=TEST_DEVICE)
    cos, sin = rotary(1, torch.tensor([[0, 1, 2]]), 8, torch.float32)
    counts = []
    for fn in (fused._specdemo_original, fused):
        fn(q, k, cos, sin)  # the signed sine made on the first call of a pass

        class Ops(TorchDispatchMode):
            n = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.__name__.split(".")[0] not in ("slice", "unsqueeze", "view", "expand", "alias", "transpose"):
                    Ops.n += 1
                return func(*args, **(kwargs or {}))

        with Ops():
            fn(q, k, cos, sin)
        counts.append(Ops.n)
    assert counts[1] <= 6 and counts[0] >= 10, counts
