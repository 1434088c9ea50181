"""The one engine at batch size 1 against the single-sequence engine it replaced (specdemo.oracle), on the real bundled
SmolLM2-135M: for every drafter, greedy and sampled with one seed, the same tokens and the same step events."""

import copy

import pytest
import torch

from specdemo.compare import make_drafter
from specdemo.config import GenerationConfig, SamplingConfig
from specdemo.drafters import Eagle3Drafter, HybridDrafter, ModelDrafter, NgramDrafter
from specdemo.engine import autoregressive, encode_prompt, speculative
from specdemo.oracle import drafters as old_drafters
from specdemo.oracle import engine as old_engine
from specdemo.oracle.eagle3_drafter import Eagle3Drafter as OldEagle3

pytestmark = pytest.mark.slow

PROMPTS = ["Summarize in one sentence: The museum reopened after a two-year renovation that added a glass roof, a new "
           "wing for modern art and a cafe on the terrace overlooking the river.",
           "Write a Python function that returns the n-th Fibonacci number."]
EXACT = ("kind", "tokens", "text", "num_generated", "drafted", "num_accepted", "correction", "bonus", "k",
         "finish_reason", "target_cache_length", "target_top_ids")
CLOSE = ("target_top_probs", "target_token_probs", "target_top2_gap", "draft_token_probs")


@pytest.fixture(scope="module")
def perturbed(bundled):
    """A noisy copy of the target: a draft LM that agrees often but not always."""
    model = copy.deepcopy(bundled.model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.std() * 0.3)
    return model


def oracle_of(drafter):
    """The single-sequence drafter with the same settings."""
    if isinstance(drafter, NgramDrafter):
        return old_drafters.NgramDrafter(drafter.max_ngram, drafter.min_ngram, drafter.full_ngram, drafter.latest)
    if isinstance(drafter, ModelDrafter):
        return old_drafters.ModelDrafter(drafter.model, drafter.target_device)
    if isinstance(drafter, Eagle3Drafter):
        return OldEagle3(drafter.head, drafter.num_speculative_tokens, drafter.min_confidence, drafter.held_out_chain)
    if isinstance(drafter, HybridDrafter):
        return old_drafters.HybridDrafter(oracle_of(drafter.model), drafter.lookup.min_ngram, drafter.model_k)
    raise AssertionError(type(drafter))


def drafters(bundled, perturbed):
    """Every drafter kind: prompt lookup, a draft LM, the shipped EAGLE-3 head, the hybrid over each draft."""
    head, _, _ = make_drafter(bundled, "model", None)
    hybrid, _, _ = make_drafter(bundled, "hybrid", None)
    lm = ModelDrafter(perturbed)
    return {"ngram": NgramDrafter(), "model-lm": lm, "eagle3": head, "hybrid-eagle3": hybrid,
            "hybrid-lm": HybridDrafter(ModelDrafter(perturbed), model_k=2)}


def assert_same_events(new, old):
    assert len(new) == len(old)
    for i, (a, b) in enumerate(zip(new, old)):
        for name in EXACT:
            assert getattr(a, name) == getattr(b, name), (i, name, getattr(a, name), getattr(b, name))
        for name in CLOSE:
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None), (i, name)
            if x is not None:
                assert torch.allclose(torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64),
                                      rtol=1e-4, atol=1e-6), (i, name)


SAMPLED = SamplingConfig(temperature=0.8, top_p=0.95)


@pytest.mark.parametrize("sampling", [SamplingConfig(), SAMPLED], ids=["greedy", "sampled"])
def test_batch_one_equals_the_single_sequence_engine_for_every_drafter(bundled, perturbed, sampling):
    tok, model = bundled.tokenizer, bundled.model
    for prompt in PROMPTS:
        ids = encode_prompt(tok, prompt)
        config = GenerationConfig(max_new_tokens=40, num_draft_tokens=4, sampling=sampling, seed=7)
        assert_same_events(list(autoregressive(model, tok, ids, config)),
                           list(old_engine.autoregressive(model, tok, ids, config)))
        for name, drafter in drafters(bundled, perturbed).items():
            new = list(speculative(model, tok, drafter, ids, config))
            old = list(old_engine.speculative(model, tok, oracle_of(drafter), ids, config))
            assert any(e.num_accepted for e in new), name
            try:
                assert_same_events(new, old)
            except AssertionError as exc:
                raise AssertionError(f"{name}: {exc}") from exc


def test_dynamic_k_and_stop_strings_match_too(bundled, perturbed):
    tok, model = bundled.tokenizer, bundled.model
    ids = encode_prompt(tok, PROMPTS[0])
    config = GenerationConfig(max_new_tokens=48, num_draft_tokens=2, dynamic_k=True, stop_strings=(" roof",))
    for drafter in (NgramDrafter(), ModelDrafter(perturbed)):
        assert_same_events(list(speculative(model, tok, drafter, ids, config)),
                           list(old_engine.speculative(model, tok, oracle_of(drafter), ids, config)))
