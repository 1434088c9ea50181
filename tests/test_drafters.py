"""Drafters on their own: prompt lookup's match rules, the hybrid's routing, the cache keyword of a forward."""

import pytest

from specdemo.config import GenerationConfig
from specdemo.drafters import HybridDrafter, ModelDrafter, NgramDrafter
from specdemo.engine import GenerationError, autoregressive, generated_ids, speculative
from specdemo.engine.kv import with_cache

PROMPT = [3, 5, 7, 3, 5, 9, 2]


def run(gen):
    return list(gen)


def test_hybrid_caps_the_model_not_the_lookup(tiny_target, tiny_draft, tiny_tok):
    """model_k=1: the draft model proposes one token per step, prompt lookup up to k; the output is the target's."""
    config = GenerationConfig(max_new_tokens=60, num_draft_tokens=4)
    prompt = [3, 5, 7, 9, 11, 3, 5, 7, 9, 11, 3, 5]
    ar = generated_ids(run(autoregressive(tiny_target, tiny_tok, prompt, config)))
    hybrid = HybridDrafter(ModelDrafter(tiny_draft), min_match=2, model_k=1)
    widths = {"lookup": [], "model": []}
    events = []
    for event in speculative(tiny_target, tiny_tok, hybrid, prompt, config):
        events.append(event)
        if event.kind == "spec" and event.drafted:
            widths[event.draft_source].append(len(event.drafted))
    assert generated_ids(events) == ar
    assert widths["model"] and max(widths["model"]) == 1
    assert widths["lookup"] and max(widths["lookup"]) > 1


def test_prompt_lookup_match_rules():
    """Longest suffix match wins; ties go to the earliest (default) or latest occurrence; short matches propose
    at most their own length, and nothing is proposed past an EOS."""
    from specdemo.config import SamplingConfig as S
    from specdemo.drafters import DraftRequest

    ids = [1, 2, 9, 4, 1, 2, 8, 5, 1, 2]
    assert NgramDrafter().match(ids) == (2, 1)
    assert NgramDrafter(latest=True).match(ids) == (2, 5)
    longer = [7, 1, 2, 3, 6, 0, 5, 7, 1, 2, 3]
    request = DraftRequest([ids, longer, ids], [4, 4, 0], S(), [None] * 3, frozenset([0]))  # one row each
    assert [p.tokens for p in NgramDrafter().propose(request)] == [
        [9, 4],  # a 2-token match proposes at most 2
        [6, 0],  # 3+ match: up to k, cut after EOS
        []]  # k = 0: nothing


def test_the_cache_goes_by_the_keyword_the_forward_takes(tiny_target, tiny_tok):
    """transformers 5.17 names the cache `past_key_values` and takes an unknown `cache=` into **kwargs (decoding with
    no cache, silently); a forward that drops the cache it is given is refused with a clear message."""
    from transformers import LlamaForCausalLM

    class OldNames(LlamaForCausalLM):  # the forward of earlier transformers 5 releases
        def forward(self, input_ids=None, past_key_values=None, use_cache=None, logits_to_keep=0, **kwargs):
            return super().forward(input_ids=input_ids, **with_cache(tiny_target, past_key_values),  # the real name
                                   use_cache=use_cache, logits_to_keep=logits_to_keep)

    class DropsCache(LlamaForCausalLM):
        def forward(self, input_ids=None, past_key_values=None, **kwargs):
            return super().forward(input_ids=input_ids, **kwargs)

    assert list(with_cache(OldNames(tiny_target.config), None)) == ["past_key_values"]
    config = GenerationConfig(max_new_tokens=12, num_draft_tokens=3)
    ar = generated_ids(run(autoregressive(tiny_target, tiny_tok, PROMPT, config)))
    for cls in (OldNames, DropsCache):
        model = cls(tiny_target.config).to(tiny_target.device).eval()
        model.load_state_dict(tiny_target.state_dict())
        model.generation_config.eos_token_id = 0
        if cls is OldNames:
            assert generated_ids(run(speculative(model, tiny_tok, NgramDrafter(), PROMPT, config))) == ar
            assert generated_ids(run(autoregressive(model, tiny_tok, PROMPT, config))) == ar
        else:
            with pytest.raises(GenerationError, match="did not fill the KV cache"):
                run(autoregressive(model, tiny_tok, PROMPT, config))
