"""Batched decoding on the real bundled SmolLM2-135M: a batch of 4 prompts of mixed lengths gives each prompt its own
single-sequence greedy output, with prompt lookup, the shipped trained draft and the hybrid."""

import pytest
import torch

from specdemo.config import GenerationConfig
from specdemo.engine import (
    autoregressive,
    decode,
    encode_prompt,
    generated_ids,
    row_outputs,
)
from specdemo.measure.compare import first_mismatch, make_drafter
from specdemo.measure.metrics import batch_stats

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of Australia?",
    "Repeat exactly: red green blue, red green blue, red green blue.",
    "Summarize in one sentence: The museum reopened after a two-year renovation that added a glass roof, a new "
    "wing for modern art and a cafe on the terrace overlooking the river.",
    "Write a Python function that returns the n-th Fibonacci number.",
]
NEW = 24
NEAR_TIE = 0.05  # top-2 logit gap under which padding's float rounding (about 1e-4 on the logits) may flip a choice


@pytest.fixture(scope="module")
def reference(bundled):
    """Each prompt's ids and its single-sequence greedy tokens."""
    config = GenerationConfig(max_new_tokens=NEW)
    ids = [encode_prompt(bundled.tokenizer, p) for p in PROMPTS]
    assert len({len(i) for i in ids}) == len(ids)  # mixed lengths: the batch is padded
    return ids, [generated_ids(list(autoregressive(bundled.model, bundled.tokenizer, i, config))) for i in ids]


def _check_rows(bundled, ids, expected, got):
    """Equal, or first different where the target's top-2 gap is a near-tie (reported in the message)."""
    for prompt, e, g in zip(ids, expected, got):
        if e != g:
            m = first_mismatch(bundled, prompt, e, g)
            assert m is not None and m["top2_logit_gap"] < NEAR_TIE, m


def test_batched_autoregressive_gives_each_rows_own_output(bundled, reference):
    ids, expected = reference
    events = list(decode(bundled.model, bundled.tokenizer, ids, GenerationConfig(max_new_tokens=NEW)))
    _check_rows(bundled, ids, expected, row_outputs(events, len(ids)))


@pytest.mark.parametrize("kind,k", [("ngram", 4), ("model", 2), ("hybrid", 8)])
def test_batched_speculative_gives_each_rows_own_output(bundled, reference, kind, k):
    ids, expected = reference
    drafter, _, _ = make_drafter(bundled, kind, None)
    config = GenerationConfig(max_new_tokens=NEW, num_draft_tokens=k)
    with torch.inference_mode():
        events = list(decode(bundled.model, bundled.tokenizer, ids, config, drafter))
    _check_rows(bundled, ids, expected, row_outputs(events, len(ids)))
    stats = batch_stats(events)
    assert stats.accepted > 0 and stats.mean_accepted > 1.0
