"""The hybrid's calibration: the model cap from measured pass costs, measured once per target and draft."""

import json

import pytest
import torch
from conftest import WORDS, tiny_llama

from specdemo.config import GenerationConfig
from specdemo.drafters import ModelDrafter
from specdemo.drafters.hybrid import calibrate, calibrated_hybrid, hybrid_model_k
from specdemo.engine import autoregressive, encode_prompt, generated_ids, speculative
from specdemo.models.loading import LoadedModel

PROMPT = [3, 5, 7, 3, 5, 9, 2]


def test_hybrid_model_k_follows_the_verify_costs():
    """1 where a 3-token verify pass costs much more than a 2-token one (the 2-core CPU), k where it hardly does."""
    assert hybrid_model_k({1: 1.0, 2: 1.07, 3: 1.30}) == 1  # this CPU, measured
    assert hybrid_model_k({1: 1.0, 2: 1.01, 3: 1.02}) is None  # a GPU: a few more tokens are about free
    # the break-even 3-token cost is 1.22 for the shipped draft's held-out chain (0.53, 0.30); below it the second
    # token pays, unless the draft's second token is rarely accepted
    assert hybrid_model_k({1: 1.0, 2: 1.07, 3: 1.20}) is None
    assert hybrid_model_k({1: 1.0, 2: 1.07, 3: 1.20}, chain=(0.4, 0.1)) == 1
    # a draft that costs a third of a target pass per token: its second token does not pay even where passes are free
    assert hybrid_model_k({1: 1.0, 2: 1.01, 3: 1.02}, c=0.35) == 1


@pytest.mark.timed  # asserts on a timed cost ratio
def test_calibration_records_the_costs_it_chose_from(tiny_draft, tiny_tok):
    """The cap comes from verify passes timed at load; the costs it used are kept for the benchmark report."""
    # an 8-layer target, so that its passes cost more than a 1-layer draft's by compute, not only by overhead
    deep = tiny_llama(len(WORDS) + 1, seed=1, sharpness=8.0, layers=8)
    target = LoadedModel("tiny", deep, tiny_tok, torch.device("cpu"), torch.float32, "folder")
    hybrid, cal = calibrated_hybrid(ModelDrafter(tiny_draft), target, speculative, "tiny-draft", PROMPT)
    assert hybrid.model_k == cal.model_k
    assert set(cal.verify_costs) == {1, 2, 3} and cal.verify_costs[1] == 1.0
    assert all(v > 0 for v in cal.verify_costs.values())
    # the draft's own cost per token, timed in a short run: a 1-layer draft against an 8-layer target costs less
    # than a target pass, and more than nothing
    assert 0.0 < cal.draft_cost < 1.0
    assert cal.model_k == hybrid_model_k(cal.verify_costs, c=cal.draft_cost)
    # measured once per target and draft: a second hybrid reuses the costs rather than timing again
    again = calibrate(ModelDrafter(tiny_draft), target, speculative, "tiny-draft", PROMPT)
    assert again.verify_costs is cal.verify_costs and again.draft_cost == cal.draft_cost
    # the report's keys, as the JSON result and bench.json carry them
    assert cal.as_dict() == {"hybrid_model_k": cal.model_k, "hybrid_draft_cost": cal.draft_cost,
                             "hybrid_verify_costs": {str(w): v for w, v in cal.verify_costs.items()},
                             "hybrid_cap": cal.describe()}
    assert cal.describe().startswith("the draft model proposes")


@pytest.mark.slow
@pytest.mark.timed  # asserts on the draft's timed cost
def test_shipped_draft_with_prompt_lookup_is_lossless(bundled):
    """The hybrid (lookup where the text repeats, the trained draft elsewhere) on the real pair: the target's output."""
    from specdemo.drafters.resolve import DRAFTS
    from specdemo.measure.compare import make_drafter

    hybrid, _, cal = make_drafter(bundled, "hybrid", None)  # the shipped draft, capped as this machine's costs say
    chain = json.loads((DRAFTS / "smollm2-135m-draft" / "specdemo.json").read_text())["metrics"]["chain"]
    # the cap weighs the draft's own held-out acceptance
    assert hybrid.model.name == "eagle3" and hybrid.model.held_out_chain == tuple(chain)
    assert 0.0 < cal.draft_cost < 0.5  # measured at load; 0.07 in the benchmark on this CPU
    assert hybrid.model_k == hybrid_model_k(cal.verify_costs, hybrid.model.held_out_chain, cal.draft_cost)
    cap = hybrid.model_k or 3
    config = GenerationConfig(max_new_tokens=48, num_draft_tokens=3)
    # a copying answer: the lookup drafts the repeats (9 of 16 steps with the shipped EAGLE-3 head), the head the rest
    prompt = ("Repeat this list exactly, one item per line: red apple, green pear, yellow banana, red apple, "
              "green pear, yellow banana.")
    ids = encode_prompt(bundled.tokenizer, prompt)
    ar = generated_ids(list(autoregressive(bundled.model, bundled.tokenizer, ids, config)))
    sources = []
    events = []
    for event in speculative(bundled.model, bundled.tokenizer, hybrid, ids, config):
        events.append(event)
        sources.append(event.draft_source if event.kind == "spec" else None)
        if sources[-1] == "model":  # the draft's chain: a tree's first nodes (lookup branches may follow)
            parents = event.parents or list(range(-1, len(event.drafted) - 1))
            assert next((i for i, a in enumerate(parents) if a != i - 1), len(parents)) <= cap
    assert generated_ids(events) == ar
    assert {"lookup", "model"} <= set(sources)
