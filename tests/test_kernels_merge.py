"""Merged q/k/v and gate/up products (models/kernels/merge.py): a merged tiny llama gives the unmerged logits (to
float rounding) with and without the few-row CPU products, and the same greedy tokens through the engine, eager and
under the static runner; its parts are views of the merged weight (no copy), so a write into a part reaches the
merged product; a part called on its own, a model cast after merging, a pass with gradients on (training reaches the
parts' weights) and parts under accelerate's hook compute their own products."""

import pytest
import torch
from conftest import TEST_DEVICE, tiny_llama
from torch.nn import functional as F

from specdemo.config import GenerationConfig
from specdemo.engine import decode, graphs, row_outputs
from specdemo.models import kernels

IDS = [[1, 5, 3, 9, 2, 7, 7, 4], [3, 5, 7, 3, 5, 9, 2, 2]]
ATOL = 1e-5 if TEST_DEVICE.type == "cpu" else 1e-4  # another GEMM algorithm for the merged shape on CUDA


def logits(model, ids=IDS):
    with torch.inference_mode():
        return model(input_ids=torch.tensor(ids, device=model.device)).logits


@pytest.mark.parametrize("fast", [False, True])
def test_merged_products_give_the_same_logits(fast):
    """Every layer's q/k/v and gate/up of a tiny llama merged (two groups a layer): the same logits as before, on
    prompts of 8 tokens and 1, with the few-row CPU products and packed weights under it or not."""
    if fast and TEST_DEVICE.type != "cpu":
        pytest.skip("the few-row products serve the CPU")
    model = tiny_llama(16, seed=3, layers=3)
    if fast:
        kernels.patch_linears(model, packed=True)
    before, one = logits(model), logits(model, [[4]])
    assert kernels.merge_projections(model) == 2 * 3
    assert kernels.merge_projections(model) == 0  # once
    assert torch.allclose(logits(model), before, atol=ATOL) and torch.allclose(logits(model, [[4]]), one, atol=ATOL)
    merged = model.model.layers[0].self_attn._specdemo_merged
    assert (merged.packed is not None) == fast
    assert model.model.layers[0].self_attn.q_proj._specdemo_packed is None if fast else True


def test_merged_models_decode_the_same_tokens(tiny_tok):
    """A merged tiny llama's greedy decode through the engine is the unmerged one's, eager and under the static
    runner (the code a CUDA graph captures), at B = 2."""
    config = GenerationConfig(max_new_tokens=24)
    prompts = [[3, 5, 7, 3, 5, 9, 2], [4, 4, 1]]
    model = tiny_llama(16, seed=4, layers=2)
    before = row_outputs(list(decode(model, tiny_tok, prompts, config)), 2)
    kernels.merge_projections(model)
    assert row_outputs(list(decode(model, tiny_tok, prompts, config)), 2) == before
    graphs.attach(model, "on")
    try:
        assert row_outputs(list(decode(model, tiny_tok, prompts, config)), 2) == before
    finally:
        graphs.detach(model)


def test_parts_are_views_of_the_merged_weight():
    """No weight is duplicated: each part's weight is its block of the merged one; a write into a part
    (load_state_dict) changes the merged product, which then matches the new weights."""
    model = tiny_llama(16, seed=5, layers=1)
    kernels.merge_projections(model)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    weight = attn._specdemo_merged.weight
    assert attn.q_proj.weight.data_ptr() == weight.data_ptr()
    assert attn.k_proj.weight.data_ptr() == weight.data_ptr() + attn.q_proj.weight.numel() * weight.element_size()
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == mlp._specdemo_merged.weight.untyped_storage().data_ptr()
    state = {k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    fresh = tiny_llama(16, seed=5, layers=1)
    fresh.load_state_dict(state)
    assert torch.allclose(logits(model), logits(fresh), atol=ATOL)


def test_a_part_on_its_own_computes_its_own_product():
    """k_proj or v_proj called on a tensor q_proj did not see (or twice) computes its own product."""
    model = tiny_llama(16, seed=6, layers=1)
    kernels.merge_projections(model)
    attn = model.model.layers[0].self_attn
    x, y = torch.randn(1, 3, 32, device=TEST_DEVICE), torch.randn(1, 3, 32, device=TEST_DEVICE)
    with torch.inference_mode():
        attn.q_proj(x)
        assert torch.allclose(attn.k_proj(y), F.linear(y, attn.k_proj.weight), atol=ATOL)
        assert torch.allclose(attn.k_proj(x), F.linear(x, attn.k_proj.weight), atol=ATOL)
        assert torch.allclose(attn.k_proj(x), F.linear(x, attn.k_proj.weight), atol=ATOL)  # handed out once
        assert torch.allclose(attn.v_proj(x), F.linear(x, attn.v_proj.weight), atol=ATOL)


def test_a_model_cast_after_merging_computes_part_by_part():
    """Cast after merging (its parts no longer lie in the merged weight), a model computes each part's own product:
    the logits of the same model cast unmerged."""
    model = tiny_llama(16, seed=7, layers=2)
    kernels.merge_projections(model)
    model.double()
    plain = tiny_llama(16, seed=7, layers=2).double()
    assert torch.allclose(logits(model), logits(plain), atol=1e-10)


def test_gradients_reach_the_parts_weights():
    """With gradients on, a merged model computes part by part, so a loss's gradient reaches every part's weight, as
    in the unmerged model."""
    model, plain = tiny_llama(16, seed=10, layers=1), tiny_llama(16, seed=10, layers=1)
    kernels.merge_projections(model)
    ids = torch.tensor(IDS, device=model.device)
    for m in (model, plain):
        m(input_ids=ids).logits.square().mean().backward()
    for name in ("self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj"):
        mine, theirs = (m.model.layers[0].get_submodule(name).weight.grad for m in (model, plain))
        assert mine is not None and torch.allclose(mine, theirs, atol=1e-6)


def test_parts_under_accelerates_hook_stay_apart():
    """A part under accelerate's hook (a device map streams its weight in at its own call) is not merged."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    model = tiny_llama(16, seed=8, layers=2)
    add_hook_to_module(model.model.layers[0].self_attn.k_proj, ModelHook())
    add_hook_to_module(model.model.layers[1].mlp.up_proj, ModelHook())
    assert kernels.merge_projections(model) == 2
    assert getattr(model.model.layers[0].self_attn, "_specdemo_merged", None) is None
    assert getattr(model.model.layers[1].mlp, "_specdemo_merged", None) is None


def test_a_merged_pass_compiles_whole():
    """torch.compile(fullgraph=True) traces a merged model's forward (q_proj's hand-out included) without a graph
    break, and gives the eager logits."""
    model = tiny_llama(16, seed=9, layers=2)
    kernels.merge_projections(model)
    ids = torch.tensor(IDS, device=model.device)
    torch._dynamo.reset()
    try:
        with torch.inference_mode():
            eager = model(input_ids=ids).logits
            compiled = torch.compile(lambda: model(input_ids=ids).logits, fullgraph=True, backend="aot_eager")()
    finally:
        torch._dynamo.reset()
    assert torch.allclose(compiled, eager, atol=ATOL)
