"""The drafters under the graph tiny_runner, on the CPU: a greedy proposal reads the device once (a draft LM's chain, an
EAGLE-3 head's), a draft LM's greedy chains are its own greedy continuation whatever a row fed past its stop, and
the engine's warm-up captures the drafter's passes before the clock (a stand-in recorder: graphs need CUDA), and an
EAGLE-3 head's tree levels replay their graphs, a greedy tree reading the device once a step."""

import sys
from contextlib import contextmanager

import pytest
import torch
from conftest import TEST_DEVICE, case

from specdemo.config import GenerationConfig, SamplingConfig
from specdemo.drafters.eagle3_static import CATCH_UP_WIDTH, LEVEL_WIDTH
from specdemo.engine import decode, graphs, row_outputs, timing
from specdemo.engine.graphs import Captured, Runner

PROMPTS = [[3, 5, 7, 3, 5, 9, 2], [4, 4, 1], [9, 8, 7, 6, 5, 4, 3, 2, 1, 2, 3, 4], [2]]
READS = ("tolist", "item", "__bool__", "__int__", "__float__")  # what brings a tensor's values to Python
# reads of the drafter's own host tensors, never on the device: the EAGLE-3 catch-up's `real` mask (built from lists)
HOST_READS = {("eagle3_static.py", "run")}
EOS = 13  # an id the tiny draft often proposes mid-chain, and the tiny target ends one row with


@contextmanager
def counted_reads():
    """Every read of a tensor's values inside the block, as (caller's file, caller's function)."""
    reads, saved = [], {name: getattr(torch.Tensor, name) for name in READS}

    def reader(name):
        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_code
            reads.append((caller.co_filename, caller.co_name))
            return saved[name](self, *args, **kwargs)
        return read

    with pytest.MonkeyPatch.context() as mp:
        for name in READS:
            mp.setattr(torch.Tensor, name, reader(name))
        yield reads


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("kind", ["model", "eagle3"])
def test_a_greedy_proposal_reads_the_device_once(tiny, tiny_tok, tiny_runner, kind, rows, monkeypatch):
    """Every greedy proposal of a k = 4 decode (rejections, rows leaving, smaller k near the end) reads the device
    once in the drafter's code: its tokens and q together. Under the static runner nothing else reads at all; under
    the eager engine a B = 4 batch's ragged mask is also checked by transformers' sdpa mask builder (not ours). An
    EAGLE-3 head's greedy chain reads once on its static cache only (the eager one reads every step)."""
    if kind == "eagle3" and tiny_runner == "eager":
        pytest.skip("the head's eager cache reads every draft step")
    target, drafter = case(kind).build(tiny)
    per_proposal, propose = [], type(drafter).propose

    def counting(self, request):
        with counted_reads() as reads:
            out = propose(self, request)
        per_proposal.append([r for r in reads if (r[0].rsplit("/", 1)[-1], r[1]) not in HOST_READS])
        return out

    monkeypatch.setattr(type(drafter), "propose", counting)
    config = GenerationConfig(max_new_tokens=16, num_draft_tokens=4, tree="off")
    list(decode(target, tiny_tok, PROMPTS[:rows], config, drafter))
    assert len(per_proposal) >= 3
    for reads in per_proposal:
        ours = [r for r in reads if "/specdemo/" in r[0]]
        assert ours == [(ours[0][0], "_greedy" if kind == "model" else "_fixed_chains")]
        others = [r for r in reads if r not in ours]
        assert not others if tiny_runner == "static" or rows == 1 else all("masking_utils" in r[0] for r in others)


def own_continuation(model, ids: list[int], k: int, eos: frozenset[int]) -> tuple[list[int], list[float]]:
    """The model's greedy continuation of ids from fresh full forwards (no cache): up to k tokens, ending after an
    EOS, and the softmax probability of each."""
    tokens, q = [], []
    with torch.inference_mode():
        while len(tokens) < k and not (tokens and tokens[-1] in eos):
            logits = model(input_ids=torch.tensor([ids + tokens], device=model.device)).logits[0, -1].float()
            tokens.append(int(logits.argmax()))
            q.append(float(torch.softmax(logits, -1)[tokens[-1]]))
    return tokens, q


@pytest.mark.parametrize("kind", ["model", "hybrid"])
def test_greedy_chains_are_the_drafts_own_continuation(tiny, tiny_tok, tiny_runner, kind):
    """B = 4, k = 4, with an EOS id the draft often proposes mid-chain (chains stop early, a row finishes) and rows
    near max_new_tokens (a smaller k): every chain the draft LM proposed is its own greedy continuation of the row's
    ids (fresh forwards, no cache), cut at the row's k and after an EOS, with its q. So each row's cache holds its
    committed ids whatever its chain fed past its stop; a hybrid row its lookup served (nothing asked of the draft
    that step) keeps none of what the draft fed."""
    target, drafter = case(kind).build(tiny)
    config = GenerationConfig(max_new_tokens=30, num_draft_tokens=4, tree="off")
    old, target.generation_config.eos_token_id = target.generation_config.eos_token_id, EOS
    try:
        events = list(decode(target, tiny_tok, PROMPTS, config, drafter))
    finally:
        target.generation_config.eos_token_id = old
    eos = frozenset({EOS, tiny_tok.eos_token_id})
    ids = {i: list(p) for i, p in enumerate(PROMPTS)}
    checked, cut, sources = 0, 0, set()
    for event in events:
        for i, step in zip(event.rows, event.steps):
            sources.add(step.draft_source)
            if event.kind == "spec" and step.drafted and step.draft_source in (None, "model"):
                expected, q = own_continuation(tiny.draft, ids[i], step.k, eos)
                assert step.drafted == expected
                assert step.draft_token_probs == pytest.approx(q, abs=1e-5)
                checked += 1
                cut += len(expected) < step.k
            ids[i] += step.tokens
    assert checked > 20 and cut > 5
    assert any(step.finish_reason == "eos" for e in events for step in e.steps)
    assert kind == "model" or {"model", "lookup"} <= sources


class _Replayed:
    """A stand-in for a captured CUDA graph on the CPU: a replay runs the recorded pass again into its outputs."""

    def __init__(self, fn, outputs):
        self.fn, self.outputs = fn, outputs

    def replay(self) -> None:
        for mine, new in zip(self.outputs, self.fn()):
            if mine is not None:
                mine.copy_(new)


def recorder(order: list[str]):
    """Runner.record's stand-in: notes each capture in `order` and returns a _Replayed graph."""
    def record(self, device, fn, what):
        order.append(f"capture {what}")
        self.graphs += 1
        outputs = fn()
        return Captured(_Replayed(fn, outputs), outputs)
    return record


@pytest.mark.skipif(TEST_DEVICE.type == "cuda", reason="a CPU stand-in for capture; on CUDA the runners capture")
@pytest.mark.parametrize("kind", ["model", "eagle3"])
def test_the_drafters_passes_are_captured_before_the_clock(tiny, tiny_tok, kind, monkeypatch):
    """The engine warms the drafter before the prefill starts the clock. Uncaptured (the CPU) that does nothing: no
    cache taken, nothing recorded. Where its runner captures (a stand-in recorder here, no CUDA), the drafter's
    passes are recorded then, over the storage its begin takes next, and no proposal of a B = 1 decode records
    anything: a draft LM's catch-up widths 1 and 2 (the first catch-up, its prompt, runs once, uncaptured) and its
    greedy chains of 4 tokens down to 1, an EAGLE-3 head's greedy chains of 4 tokens down to 1, its catch-up widths 1 to
    CATCH_UP_WIDTH and its tree levels' 1 to LEVEL_WIDTH. The tokens are the uncaptured run's."""
    for model in (tiny.target, tiny.draft, tiny.eagle3_target):
        graphs.attach(model, "on")
    try:
        target, drafter = case(kind).build(tiny)
        model = drafter.model if kind == "model" else drafter.head
        order = []
        for name in ("warm", "begin", "propose"):
            method = getattr(type(drafter), name)
            monkeypatch.setattr(type(drafter), name,
                                lambda self, *a, _m=method, _n=name: order.append(_n) or _m(self, *a))
        start = timing.Clock.start
        monkeypatch.setattr(timing.Clock, "start", lambda self: order.append("clock") or start(self))

        monkeypatch.setattr(Runner, "record", recorder(order))
        config = GenerationConfig(max_new_tokens=24, num_draft_tokens=4, tree="off")
        plain = row_outputs(list(decode(target, tiny_tok, PROMPTS[:1], config, drafter)), 1)
        assert order[:3] == ["warm", "clock", "begin"] and not [o for o in order if o.startswith("capture")]
        graphs.runner_of(model).capture = True
        order.clear()
        assert row_outputs(list(decode(target, tiny_tok, PROMPTS[:1], config, drafter)), 1) == plain
        captured = order[1 : order.index("clock")]
        assert order[0] == "warm" and order.count("begin") == 1 and order.index("begin") > order.index("clock")
        assert captured == (["capture a 1 x 2 pass", "capture a 1 x 1 pass"]
                            + [f"capture a draft LM's 1-row chain of {k}" for k in range(4, 0, -1)] if kind == "model"
                            else [f"capture the head's 1-row chain of {k}" for k in range(4, 0, -1)]
                            + [f"capture the head's 1 x {t} catch-up" for t in range(CATCH_UP_WIDTH, 0, -1)]
                            + [f"capture the head's 1 x {t} tree level" for t in range(LEVEL_WIDTH, 0, -1)])
        assert len([o for o in order if o.startswith("capture")]) == len(captured)  # none while proposing
        assert len(drafter.kv.storage.graphs) == len(captured)  # held by the storage begin took
    finally:
        for model in (tiny.target, tiny.draft, tiny.eagle3_target):
            graphs.detach(model)


@pytest.mark.skipif(TEST_DEVICE.type == "cuda", reason="a CPU stand-in for capture; on CUDA the runners capture")
@pytest.mark.parametrize("kind", ["model", "eagle3"])
def test_a_batch_whose_rows_finish_captures_nothing_while_timed(tiny, tiny_tok, kind, monkeypatch):
    """B = 4 with rows finishing one by one (the batch runs as 4, then 2 or 1 on the ladder): the warm-up
    captures the target's and the drafter's passes at every rung below the batch's (graphs.rungs), so nothing is
    captured once the clock runs; the tokens are the uncaptured run's."""
    models = (tiny.target, tiny.draft, tiny.eagle3_target)
    for model in models:
        graphs.attach(model, "on")
    try:
        target, drafter = case(kind).build(tiny)
        config = GenerationConfig(max_new_tokens=24, num_draft_tokens=4, tree="off")
        plain = list(decode(target, tiny_tok, PROMPTS, config, drafter))
        order = []
        start = timing.Clock.start
        monkeypatch.setattr(timing.Clock, "start", lambda self: order.append("clock") or start(self))

        monkeypatch.setattr(Runner, "record", recorder(order))
        for model in models:
            graphs.runner_of(model).capture = True
        events = list(decode(target, tiny_tok, PROMPTS, config, drafter))
        assert row_outputs(events, 4) == row_outputs(plain, 4)
        assert len({graphs.padded_batch(len(e.rows)) for e in events}) > 1  # the batch shrank across rungs
        first = order.index("clock")
        assert any(o.startswith("capture") for o in order[:first])
        assert [o for o in order[first:] if o.startswith("capture")] == []
        assert graphs.rungs(4) == [4, 2, 1] and graphs.rungs(3) == [4, 2, 1] and graphs.rungs(1) == [1]
    finally:
        for model in models:
            graphs.detach(model)


@pytest.mark.skipif(TEST_DEVICE.type == "cuda", reason="a CPU stand-in for capture; on CUDA the runners capture")
@pytest.mark.parametrize("temperature,rows", [(0.0, 1), (0.0, 4), (1.0, 4)])  # sampled, B = 1 drafts no tree here
def test_a_heads_trees_replay_their_graphs(tiny, tiny_tok, rows, temperature, monkeypatch):
    """EAGLE-3 trees (8 nodes, 4 deep) under a captured head (the stand-in recorder), every tree and token the
    uncaptured run's and nothing captured while timed: a sampled tree's level passes replay graphs captured in the
    warm-up; a greedy tree grows in one graph (eagle3_device_tree, HeadRunner.tree; captured in the warm-up at each
    k up to 4) and is cut on the device, verified on the device with the captured target (engine.device_step) and
    read once a step with its verdict, where the uncaptured run grew it on the host a level at a time."""
    models = (tiny.eagle3_target,)
    graphs.attach(tiny.eagle3_target, "on")
    try:
        target, drafter = case("eagle3").build(tiny)
        graphs.attach(drafter.head, "on")
        config = GenerationConfig(max_new_tokens=24, num_draft_tokens=4, tree="8", seed=3,
                                  sampling=SamplingConfig(temperature=temperature))
        plain = list(decode(target, tiny_tok, PROMPTS[:rows], config, drafter))
        order, levels = [], []
        start = timing.Clock.start
        monkeypatch.setattr(timing.Clock, "start", lambda self: order.append("clock") or start(self))
        monkeypatch.setattr(Runner, "record", recorder(order))
        replay = _Replayed.replay
        monkeypatch.setattr(_Replayed, "replay", lambda self: levels.append(self) or replay(self))
        for model in models + (drafter.head,):
            graphs.runner_of(model).capture = True
        with counted_reads() as reads:
            events = list(decode(target, tiny_tok, PROMPTS[:rows], config, drafter))
        assert row_outputs(events, rows) == row_outputs(plain, rows)
        assert [(s.drafted, s.parents) for e in events for s in e.steps] == [(s.drafted, s.parents) for e in plain
                                                                          for s in e.steps]
        assert any(p is not None for e in events for s in e.steps for p in [s.parents])  # trees were drafted
        first = order.index("clock")
        assert [o for o in order[first:] if o.startswith("capture")] == []
        # a level's key (b, t, "level"); a whole tree's (b, k, E, min_confidence)
        used = {id(g.graph) for key, g in drafter.kv.storage.graphs.items()
                if (key[2:] == ("level",) if temperature else len(key) == 4)}
        assert used and sum(id(g) in used for g in levels) > 0
        if not temperature:
            trees = sorted((key[0], key[1]) for key in drafter.kv.storage.graphs if len(key) == 4)
            assert trees == sorted((b, k) for b in graphs.rungs(rows) for k in range(1, 5))
            drafting = sum(e.kind == "spec" and e.k > 0 for e in events)
            assert not [r for r in reads if r[0].endswith(("eagle3_tree.py", "eagle3_device_tree.py"))]
            assert len([r for r in reads if r[0].endswith("device_step.py")]) == drafting
    finally:
        for model in models + (drafter.head,):
            graphs.detach(model)
