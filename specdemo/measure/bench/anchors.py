"""The reference implementations every figure is checked against: transformers' generate, its assisted generation
(the same draft model, exactly k tokens per step) and its prompt lookup, on the same ids, model object and clock."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from ...config import SamplingConfig
from ...engine.timing import timed_call
from .timing import Measured, measuring

# generate()'s best plain decoding on a GPU: a static cache, whose forward transformers then compiles itself (its
# automatic compile for compileable caches, CompileConfig's fullgraph reduce-overhead); on a CPU plain generate()
STATIC_CACHE = {"cache_implementation": "static"}
ASSISTANT_FIELDS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


@contextmanager
def assistant_k(assistant: torch.nn.Module, k: int) -> Iterator[object]:
    """Make transformers' assisted generation draft exactly k tokens per step, then restore the config.

    In transformers 5.x, AssistedCandidateGenerator reads num_assistant_tokens, its schedule and the confidence
    threshold from assistant_model.generation_config (generate()'s kwargs for them are not used); the defaults are
    20 tokens with an early stop below confidence 0.4, which is not the k we compare with.
    """
    gc = assistant.generation_config
    old = {name: getattr(gc, name, None) for name in ASSISTANT_FIELDS}
    gc.num_assistant_tokens = k
    gc.num_assistant_tokens_schedule = "constant"
    gc.assistant_confidence_threshold = 0.0  # falsy: no ConfidenceCriteria, no ROC threshold tuning
    try:
        yield gc
    finally:
        for name, value in old.items():
            setattr(gc, name, value)


def hf_kwargs(sampling: SamplingConfig, max_new_tokens: int, eos: Sequence[int]) -> dict:
    """generate() settings matching our decoders: same length bound, EOS ids and sampling."""
    out = dict(max_new_tokens=max_new_tokens, eos_token_id=list(eos), pad_token_id=next(iter(eos), None))
    if sampling.greedy:
        out.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    else:
        out.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or None,
                   top_p=sampling.top_p)
    return out


def hf_generate(model, prompt_ids: list[int], kwargs: dict, seed: int = 0) -> tuple[list[int], float]:
    """transformers' generate on the same ids; (new token ids, wall seconds with the engine's clock)."""
    device = next(model.parameters()).device
    x = torch.tensor([prompt_ids], device=device)
    torch.manual_seed(seed)
    with torch.inference_mode():
        out, seconds = timed_call(lambda: model.generate(input_ids=x, attention_mask=torch.ones_like(x), **kwargs),
                                  device)
    return out[0, len(prompt_ids):].tolist(), seconds


def measure_hf(model, prompt_ids: list[int], kwargs: dict, timers, seed: int) -> Measured:
    """generate() on the same ids, with the forward time inside it."""
    stats: dict = {}
    with measuring(timers, stats):
        ids, seconds = hf_generate(model, prompt_ids, kwargs, seed)
    return Measured(ids, seconds, **stats)


def has_static_anchor(model) -> bool:
    """Whether the bench also times generate() with a static, compiled cache: on CUDA, where it is the fast one."""
    return next(model.parameters()).device.type == "cuda"


def measure_hf_static(model, prompt_ids: list[int], kwargs: dict, timers, seed: int) -> Measured:
    """generate() with a static cache and its compiled forward on the same ids, timed on its second call: the first
    one compiles for this prompt's cache length, which no user pays twice."""
    hf_generate(model, prompt_ids, {**kwargs, **STATIC_CACHE}, seed)
    return measure_hf(model, prompt_ids, {**kwargs, **STATIC_CACHE}, timers, seed)


def hf_assistant(pair) -> torch.nn.Module | None:
    """The draft as a transformers model generate() can use as assistant_model: a draft LM's own causal LM (None for
    prompt lookup, an EAGLE-3 head, the hybrid, whose `model` is a drafter)."""
    model = getattr(pair.drafter, "model", None)
    return model if isinstance(model, torch.nn.Module) and hasattr(model, "generate") else None
