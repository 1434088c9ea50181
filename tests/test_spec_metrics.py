"""speculative_decoding: vLLM's per-request metrics and per-position counters from hand-made step events; and, with
the real vLLM (slow), our function on vLLM's own per-step arrays gives every field of its dict and its counter, and
with vLLM's lookup rule the outputs are identical and the per-step arrays equal vLLM's up to our end-of-run cap."""

from __future__ import annotations

import os

import pytest
from test_vllm import NEEDS_VLLM

from specdemo.engine import BatchEvent, StepEvent
from specdemo.measure.bench.vllm import VLLM_PYTHON_ENV
from specdemo.measure.spec_metrics import pool, rows_of, speculative_decoding, steps_of


def spec(drafted: int, accepted: int, k: int = 4) -> StepEvent:
    return StepEvent("spec", [1] * (accepted + 1), "", 0.0, 0, drafted=list(range(10, 10 + drafted)),
                     num_accepted=accepted, k=k)


EVENTS = [StepEvent("prefill", [1], "", 0.0, 1), spec(4, 2), spec(0, 0), spec(4, 4), spec(4, 0), spec(2, 1, k=2)]


def test_counts_follow_vllms_definitions_bonus_included_and_no_draft_steps_left_out():
    """A pass with no drafts is no spec step; mean length is 1 + accepted / steps; the rate is draft-only; the
    histogram is dense over 0..k; per-position counts are what SpecDecodingStats.observe_draft adds."""
    m = speculative_decoding(steps_of(EVENTS), num_spec_tokens=4)
    assert m["num_spec_steps"] == 4 and m["num_draft_tokens"] == 14 and m["num_accepted_draft_tokens"] == 7
    assert m["mean_acceptance_length"] == 1 + 7 / 4 and m["draft_acceptance_rate"] == 7 / 14
    assert m["acceptance_histogram"] == [1, 1, 1, 0, 1] and m["num_spec_tokens"] == 4
    assert m["acceptance_histogram_by_draft_length"] == {"2": [0, 1, 0], "4": [1, 0, 1, 0, 1]}
    assert m["num_accepted_tokens_per_pos"] == [3, 2, 1, 1]
    assert m["num_draft_tokens_per_pos"] == [4, 4, 3, 3]
    assert m["per_step_accepted"] == [2, 4, 0, 1] and m["per_step_drafted"] == [4, 4, 4, 2]


def test_no_spec_steps_give_vllms_empty_values():
    """No drafting step: mean length 1.0 and rate 0.0, as vLLM's to_dict returns them."""
    m = speculative_decoding([], num_spec_tokens=2)
    assert (m["mean_acceptance_length"], m["draft_acceptance_rate"], m["acceptance_histogram"]) == (1.0, 0.0, [0, 0, 0])


def test_a_step_accepting_more_than_it_drafted_is_refused():
    with pytest.raises(ValueError):
        speculative_decoding([(2, 3)])


def test_batch_rows_and_pooling_match_the_single_sequence_figures():
    """A batched run's rows give each prompt's own steps; pooling the per-prompt dicts equals one dict over all steps
    (what vLLM's counters sum), without the per-step arrays."""
    def step(kind, tokens, drafted=(), accepted=0):
        return StepEvent(kind, tokens, "", 0.0, 0, drafted=list(drafted), num_accepted=accepted, k=3)

    batch = [BatchEvent("prefill", [0, 1], [step("prefill", [1]), step("prefill", [1])], 0.0, 2),
             BatchEvent("spec", [0, 1], [step("spec", [1, 1, 1], [5, 6, 7], 2), step("spec", [1], [5, 6, 7], 0)],
                        0.0, 6, k=3),
             BatchEvent("spec", [1], [step("spec", [1, 1], [5], 1)], 0.0, 8, k=3)]
    rows = rows_of(batch)
    assert rows == {0: [(3, 2)], 1: [(3, 0), (1, 1)]}
    pooled = pool([speculative_decoding(steps, 3) for steps in rows.values()])
    whole = speculative_decoding([s for steps in rows.values() for s in steps], 3, detailed=False)
    assert pooled == {**whole, "requests": 2}


# --- against the real vLLM (its own venv; skipped without it) ------------------------------------------------------

@pytest.mark.slow
@NEEDS_VLLM
def test_ours_equal_vllms_own_per_request_metrics_on_the_same_drafts(tmp_path):
    """Prompt lookup at k = 4, greedy, 48 tokens, three extractive dev prompts. Our lookup with vLLM's rule
    (full_ngram=1: a match of any length proposes k tokens) and vLLM's ngram with the same window (its
    --per-request-spec-decode-metrics detailed, and its per-position Prometheus counter):
    - our function on vLLM's own per-step arrays gives every field of vLLM's own dict and its counter;
    - the outputs are identical, and both engines draft and accept the same per step, up to where our engine caps k
      to leave the last token to the target; past it vLLM still drafts k and counts drafts the length limit drops
      (on 2026-12-03: 3 of 3 prompts, 21/19/14 of our steps against vLLM's 22/20/14, equal before the cap)."""
    from specdemo.config import GenerationConfig
    from specdemo.drafters import NgramDrafter
    from specdemo.engine import encode_prompt, eos_ids, speculative
    from specdemo.measure.bench.vllm import (
        VllmOptions,
        build_request,
        driver_env,
        model_source,
        require_python,
        run_driver,
    )
    from specdemo.models.loading import load_model
    from specdemo.prompts import DEFAULT_PROMPTS, read_prompts
    from specdemo.serve.serve_config import Lookup, vllm_speculative_config

    k, max_new = 4, 48
    target = load_model("smollm2-135m", device="cpu", dtype="fp32")
    items = [p for p in read_prompts(DEFAULT_PROMPTS) if p.category == "extractive"][:3]
    prompts = [(p.id, encode_prompt(target.tokenizer, p.prompt)) for p in items]
    config = GenerationConfig(max_new_tokens=max_new, num_draft_tokens=k)
    drafter = NgramDrafter(full_ngram=1)
    ours = {pid: list(speculative(target.model, target.tokenizer, drafter, ids, config)) for pid, ids in prompts}
    method = {"name": "ngram", "k": k,
              "speculative_config": vllm_speculative_config("ngram", k, lookup=Lookup.of(drafter))}
    eos = sorted(eos_ids(target.model, target.tokenizer))
    request = build_request(model_source(target), prompts, eos, max_new, [method])
    result = run_driver(require_python(os.environ.get(VLLM_PYTHON_ENV)), request, tmp_path,
                        driver_env(VllmOptions(), os.environ), 1800)
    (run,) = result["methods"]
    assert "error" not in run, run
    accepted = 0
    for entry in run["prompts"]:
        events, theirs = ours[entry["id"]], entry["request_metrics"]
        their_steps = list(zip(theirs["per_step_drafted"], theirs["per_step_accepted"]))
        again = speculative_decoding(their_steps, k)
        assert {key: again[key] for key in theirs} == theirs, entry["id"]
        assert again["num_accepted_tokens_per_pos"] == entry["counters"]["accepted_per_pos"], entry["id"]
        assert entry["token_ids"] == [t for e in events for t in e.tokens], entry["id"]
        uncapped = next((i for i, e in enumerate(events) if e.kind == "spec" and e.k < k), len(events))
        mine = steps_of(events[:uncapped])
        mine = [s for s in mine if s[0]]  # vLLM's steps are drafting steps only
        assert mine == their_steps[: len(mine)] and len(mine) >= len(their_steps) - 3, (entry["id"], mine, their_steps)
        assert speculative_decoding(mine, k) == speculative_decoding(their_steps[: len(mine)], k)
        accepted += sum(a for _, a in mine)
    assert accepted > 0
