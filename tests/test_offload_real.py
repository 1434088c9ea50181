"""The real bundled SmolLM2-135M with part of it forced to disk by accelerate's device map (issue 31): greedy output
identical to the fully loaded target for prompt lookup and the trained draft, through rejections and KV rollback."""

import pytest

from specdemo.config import GenerationConfig, placement_from
from specdemo.engine import autoregressive, encode_prompt, generated_ids, speculative
from specdemo.measure.compare import load_pair

pytestmark = pytest.mark.slow

PROMPT = "Rewrite more formally: gonna be late, traffic is bad, the meeting is moved, the meeting is moved."
NEW = 24


@pytest.mark.parametrize("kind, k", [("ngram", 4), ("model", 2)])
def test_offloaded_target_is_lossless_with_rollback(bundled, tmp_path, kind, k):
    """Embeddings, head and the first layers on the CPU, the rest on disk: the speculative run equals the in-memory
    target's greedy tokens, rejections happen, and after each step (but a last one cut at EOS) the KV cache holds the
    committed tokens but one."""
    config = GenerationConfig(max_new_tokens=NEW, num_draft_tokens=k)
    ids = encode_prompt(bundled.tokenizer, PROMPT)
    reference = generated_ids(list(autoregressive(bundled.model, bundled.tokenizer, ids, config)))
    pair = load_pair("smollm2-135m", kind, placement=placement_from("auto", "cpu=150MiB", str(tmp_path)))
    where = pair.target.where()
    assert "disk" in where["parts"] and "model.embed_tokens" in where["parts"]["cpu"]
    events = list(speculative(pair.target.model, pair.target.tokenizer, pair.drafter, ids, config))
    assert generated_ids(events) == reference
    spec = [e for e in events if e.kind == "spec"]
    assert any(e.num_accepted < len(e.drafted) for e in spec), "no rejection: rollback untested"
    assert all(e.target_cache_length == len(ids) + e.num_generated - 1 for e in spec[:-1])  # the last may stop early
