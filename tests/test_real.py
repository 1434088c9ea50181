"""End to end on the real bundled SmolLM2-135M: greedy losslessness, rollback under rejections, stop strings, the
CLI's bad-input message (test_packaging runs `specdemo generate --json` itself)."""

import subprocess
import sys

import pytest
import torch

from specdemo.config import GenerationConfig
from specdemo.drafters import ModelDrafter, NgramDrafter
from specdemo.engine import autoregressive, encode_prompt, generated_ids, speculative

pytestmark = pytest.mark.slow

PROMPTS = [
    "Summarize in one sentence: The museum reopened after a two-year renovation that added a glass roof.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Return a JSON object with keys name, age and city for a fictional person.",
    "What is the capital of Australia?",
    "Write a two-line poem about autumn leaves.",
    "Translate to French: The cat sleeps on the warm windowsill.",
    "If a train travels 60 km in 45 minutes, what is its speed in km/h?",
    "Repeat exactly: red green blue, red green blue, red green blue.",
]
KS = [1, 8]  # the bonus-token path and the longest rollback; tiny-model tests cover every k exactly, and k = 2, 4 run
# on this model in the perturbed-draft test and test_batch_real
PERTURBED_KS = [2, 8]  # the app's default and the longest rollback; tiny-model tests cover every k exactly
PERTURBED_NEW = 16  # of the reference's NEW tokens
PERTURBED_PROMPTS = 4  # each step drafts k tokens with a quarter of the target: dearer than lookup's free drafts
SELF_DRAFT_KS = [1, 8]
NEW = 24
PERTURBED_LAYERS = 8
SELF_DRAFT_PROMPTS = 4  # the target drafting for itself costs k target passes a step


@pytest.fixture(scope="module")
def reference(bundled):
    """Each prompt's ids and the target's own greedy tokens."""
    config = GenerationConfig(max_new_tokens=NEW)
    out = {}
    for prompt in PROMPTS:
        ids = encode_prompt(bundled.tokenizer, prompt)
        out[prompt] = (ids, generated_ids(list(autoregressive(bundled.model, bundled.tokenizer, ids, config))))
    return out


@pytest.fixture(scope="module")
def perturbed(bundled):
    """The target's first PERTURBED_LAYERS layers with noise on their weights: a draft that agrees often but not
    always, at a fraction of a target pass (so k = 8 drafts cost little more than one verify)."""
    import copy

    model = copy.deepcopy(bundled.model)
    model.model.layers = model.model.layers[:PERTURBED_LAYERS]
    model.config.num_hidden_layers = PERTURBED_LAYERS
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:PERTURBED_LAYERS]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.std() * 0.5)
    return model


def _spec(bundled, drafter, ids, k, new=NEW):
    config = GenerationConfig(max_new_tokens=new, num_draft_tokens=k)
    return list(speculative(bundled.model, bundled.tokenizer, drafter, ids, config))


@pytest.mark.parametrize("k", KS)
def test_prompt_lookup_is_lossless(bundled, reference, k):
    for prompt, (ids, expected) in reference.items():
        assert generated_ids(_spec(bundled, NgramDrafter(), ids, k)) == expected, prompt


@pytest.mark.parametrize("k", SELF_DRAFT_KS)
def test_self_draft_is_lossless_and_accepts_everything(bundled, reference, k):
    """The target drafting for itself: identical output and every draft accepted."""
    for prompt, (ids, expected) in list(reference.items())[:SELF_DRAFT_PROMPTS]:
        events = _spec(bundled, ModelDrafter(bundled.model), ids, k)
        assert generated_ids(events) == expected, prompt
        spec = [e for e in events if e.kind == "spec"]
        assert all(e.num_accepted == len(e.drafted) for e in spec), prompt


@pytest.mark.parametrize("k", PERTURBED_KS)
def test_perturbed_draft_is_lossless_with_rejections(bundled, perturbed, reference, k):
    """A noisy copy gets rejected sometimes; rollback keeps the output exact and the target cache exact."""
    rejected = accepted = 0
    for prompt, (ids, expected) in list(reference.items())[:PERTURBED_PROMPTS]:
        events = _spec(bundled, ModelDrafter(perturbed), ids, k, PERTURBED_NEW)
        assert generated_ids(events) == expected[:PERTURBED_NEW], prompt
        n = len(ids)
        for e in events:
            n += len(e.tokens)
            assert e.target_cache_length == n - 1
        spec = [e for e in events if e.kind == "spec"]
        rejected += sum(e.num_accepted < len(e.drafted) for e in spec)
        accepted += sum(e.num_accepted for e in spec)
    assert rejected > 0 and accepted > 0


def test_stop_string_ends_both_decoders_identically(bundled, reference):
    prompt = PROMPTS[1]
    ids, expected = reference[prompt]
    full_text = bundled.tokenizer.decode(expected, skip_special_tokens=True)
    stop = full_text[len(full_text) // 2 :][:3]
    config = GenerationConfig(max_new_tokens=NEW, num_draft_tokens=4, stop_strings=(stop,))
    ar = list(autoregressive(bundled.model, bundled.tokenizer, ids, config))
    sd = list(speculative(bundled.model, bundled.tokenizer, NgramDrafter(), ids, config))
    assert generated_ids(ar) == generated_ids(sd)
    text = "".join(e.text for e in ar)
    assert ar[-1].finish_reason == sd[-1].finish_reason == "stop"
    assert stop in text and len(generated_ids(ar)) < len(expected)


def test_cli_reports_bad_input_clearly():
    proc = subprocess.run([sys.executable, "-m", "specdemo", "generate", "--prompt", "hi", "--drafter", "ngram",
                           "--k", "1000"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "k must be a whole number from 1 to 64, got 1000." in proc.stderr
