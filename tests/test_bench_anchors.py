"""The transformers anchors: assisted generation held to exactly k tokens per step."""

import torch

from specdemo.measure.bench.anchors import assistant_k


def test_assistant_config_gives_constant_k(tiny_draft):
    """assistant_k sets k, a constant schedule and no confidence stop where transformers reads them, then restores."""
    from transformers import GenerationConfig as HFConfig
    from transformers.generation.candidate_generator import AssistedCandidateGenerator

    gc = tiny_draft.generation_config
    before = (gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold)
    with assistant_k(tiny_draft, 3):
        assert (gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold) == (
            3, "constant", 0.0)
        gen = AssistedCandidateGenerator(torch.tensor([[1, 2, 3]]), tiny_draft, HFConfig(max_length=20), {})
        assert gen.num_assistant_tokens == 3
        assert not gen.assistant_generation_config.assistant_confidence_threshold
        assert gen.assistant_generation_config.num_assistant_tokens_schedule == "constant"
    assert (gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold) == before
