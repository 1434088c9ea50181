"""Both decoders on one prompt: the order of events (the runs take turns by their own clocks), the JSON result, and
the hybrid's calibration in it."""

import torch

from specdemo.config import GenerationConfig
from specdemo.drafters import HybridDrafter, ModelDrafter, NgramDrafter
from specdemo.drafters.hybrid import HybridCalibration
from specdemo.measure.compare import Pair, compare, iter_compare, result_dict
from specdemo.models.loading import LoadedModel

PROMPT = [3, 5, 7, 3, 5, 9, 2]


def tiny_pair(model, tok, drafter, kind, calibration=None) -> Pair:
    return Pair(LoadedModel("tiny", model, tok, torch.device("cpu"), torch.float32, "folder"), drafter, kind, None,
                calibration)


def test_iter_compare_takes_turns_by_the_runs_own_clocks_then_reports(tiny_target, tiny_tok):
    """The runs take turns, never overlapping: each step is the one of the run whose own clock was behind (the AR run
    on a tie), so both advance side by side; the result comes last."""
    pair = tiny_pair(tiny_target, tiny_tok, NgramDrafter(), "ngram")
    config = GenerationConfig(max_new_tokens=12, num_draft_tokens=3)
    items = list(iter_compare(pair, PROMPT, config))
    kinds = [which for which, _ in items]
    assert kinds[-1] == "result" and kinds.count("result") == 1
    assert kinds[:2] == ["ar", "sd"]  # both prefills first: each clock starts at 0, the AR run wins the tie
    clocks = {"ar": 0.0, "sd": 0.0}
    done = set()
    for which, event in items[:-1]:
        other = "sd" if which == "ar" else "ar"
        assert other in done or clocks[which] <= clocks[other] or (which, clocks[which]) == ("ar", clocks[other])
        clocks[which] = event.elapsed
        if event.finish_reason:
            done.add(which)
    result = items[-1][1]
    ar = [e for w, e in items if w == "ar"]
    sd = [e for w, e in items if w == "sd"]
    assert result == result_dict(pair, config, ar, sd, PROMPT) | {"ar": result["ar"], "sd": result["sd"],
                                                                   "speedup": result["speedup"]}
    assert result["identical"] and result["ar"]["tokens"] == 12 and result["sd"]["tokens"] == 12
    assert "hybrid_model_k" not in result


def test_closing_iter_compare_stops_the_run(tiny_target, tiny_tok):
    """A Stop in the app closes the generator: no further events, no result."""
    pair = tiny_pair(tiny_target, tiny_tok, NgramDrafter(), "ngram")
    gen = iter_compare(pair, PROMPT, GenerationConfig(max_new_tokens=30), do_warmup=False)
    assert next(gen)[0] == "ar"
    gen.close()
    assert list(gen) == []


def test_result_carries_the_hybrid_calibration(tiny_target, tiny_draft, tiny_tok):
    cal = HybridCalibration(1, {1: 1.0, 2: 1.05, 3: 1.4}, 0.07)
    pair = tiny_pair(tiny_target, tiny_tok, HybridDrafter(ModelDrafter(tiny_draft), min_match=2, model_k=1), "hybrid",
                     cal)
    result = compare(pair, "w3 w5 w7 w3 w5", GenerationConfig(max_new_tokens=8, use_chat_template=False),
                     do_warmup=False)
    assert result["hybrid_model_k"] == 1 and result["hybrid_draft_cost"] == 0.07
    assert result["hybrid_verify_costs"] == {"1": 1.0, "2": 1.05, "3": 1.4}
    assert result["identical"]
