"""What a greedy speculative step leaves outside what CUDA graphs replace (issue 49), counted on tiny models with the
static runner and the one-read path forced on, as under a captured target (specdemo.measure.glue): an EAGLE-3 head's
chain and a draft LM's are each one graph that also works out each row's length, so a step's aten calls between the
graphs do not grow with k (they did by 2-3 calls a draft step, a draft LM's by 5) and stay few."""

import statistics

import pytest
import torch
from conftest import case
from test_draft_graphs import PROMPTS

from specdemo.config import GenerationConfig
from specdemo.engine import decode, graphs, loop
from specdemo.measure.glue import Calls, Outside


def calls_a_step(tiny, tiny_tok, kind: str, rows: int, k: int, monkeypatch) -> list[int]:
    """Each speculative step's aten calls outside the captured regions, for the drafter's greedy chains at k."""
    target, drafter = case(kind).build(tiny)
    draft = drafter.head if kind == "eagle3" else drafter.model
    graphs.attach(draft, "on")
    outside, per_step, step = Outside(), [], loop._spec_step
    calls = Calls(outside)

    def counted(*args):
        before = sum(calls.ops.values())
        out = step(*args)
        per_step.append(sum(calls.ops.values()) - before)
        return out

    monkeypatch.setattr(loop, "_spec_step", counted)
    config = GenerationConfig(max_new_tokens=24, num_draft_tokens=k, tree="off")
    with outside.watching(), torch.inference_mode(), calls:
        list(decode(target, tiny_tok, PROMPTS[:rows], config, drafter))
    graphs.detach(draft)
    return per_step


@pytest.mark.parametrize("kind", ["eagle3", "model"])
@pytest.mark.parametrize("rows", [1, 4])
def test_a_greedy_step_leaves_the_same_few_calls_at_any_k(tiny, tiny_tok, kind, rows, monkeypatch):
    """The typical step's calls between the graphs at k = 2, 4 and 8 (B = 1 and 4): the same, and at most 30."""
    monkeypatch.setattr(loop, "ONE_READ", "always")
    target = tiny.eagle3_target if kind == "eagle3" else tiny.target
    graphs.attach(target, "on")
    try:
        typical = {k: statistics.median(calls_a_step(tiny, tiny_tok, kind, rows, k, monkeypatch)) for k in (2, 4, 8)}
    finally:
        graphs.detach(target)
    # before the chains were one graph: the head's 54 / 60 / 72 at B = 1 and 65 / 71 / 83 at B = 4, a draft LM's
    # 43 / 55 / 79 and 49 / 61 / 85; then 27 and 38, 28 and 34 at every k; with the inputs built in a few tensors
    # whatever the batch (kv.right_padded, the head's catch-up), 23 and 26, 24 and 24
    assert typical[2] == typical[4] == typical[8], typical
    assert typical[2] <= 30, typical
