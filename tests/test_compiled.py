"""--graphs compiled (issue 49): the static runner's passes through torch.compile (one trace with dynamic batch and
width; on a GPU inductor's fused kernels, captured as CUDA graphs) give the eager engine's greedy tokens, and a pass
that will not compile runs uncompiled with one log line. On the CPU: traced with the "aot_eager" backend (the same
graphs, no code generated), and once with inductor itself."""

import types

import pytest
import torch
from conftest import case

from specdemo.config import GenerationConfig
from specdemo.engine import decode, graphs, row_outputs

PROMPTS = [[3, 5, 7, 3, 5, 9, 2], [4, 4, 1], [9, 8, 7, 6, 5, 4, 3, 2, 1, 2, 3, 4], [2]]


@pytest.fixture
def compiled(tiny, monkeypatch):
    """The tiny target and draft with --graphs compiled for the test, dynamo's caches cleared around it."""
    torch._dynamo.reset()
    models = (tiny.target, tiny.draft, tiny.eagle3_target)
    runners = [graphs.attach(model, "compiled") for model in models]
    assert all(r is not None and r.compile for r in runners)
    yield runners
    for model in models:
        graphs.detach(model)
    torch._dynamo.reset()


def eager_tokens(tiny, tok, kind, rows, config):
    target, drafter = case(kind).build(tiny) if kind else (tiny.target, None)
    return row_outputs(list(decode(target, tok, PROMPTS[:rows], config, drafter)), rows)


@pytest.mark.parametrize("kind,rows,k", [(None, 1, 1), ("model", 4, 2), ("ngram", 1, 4), ("model", 1, 4),
                                         ("eagle3", 2, 2)])
def test_compiled_passes_give_the_eager_engines_greedy_tokens(tiny, tiny_tok, compiled, kind, rows, k, monkeypatch):
    """AR, a draft LM, prompt lookup and an EAGLE-3 head (whose target passes return features: transformers' hooks
    for them are installed before compiling, under a lock dynamo cannot trace) at B = 1, 2 and 4: the compiled
    passes (traced, not run uncompiled) decode the eager engine's tokens, and the runner says they are compiled."""
    monkeypatch.setattr(graphs, "COMPILE_BACKEND", "aot_eager")
    config = GenerationConfig(max_new_tokens=16, num_draft_tokens=k, tree="off")
    got = eager_tokens(tiny, tiny_tok, kind, rows, config)
    model = tiny.eagle3_target if kind == "eagle3" else tiny.target
    target = graphs.runner_of(model)
    assert target.compile and target.compiled is not None, target.reason
    assert graphs.describe(model).startswith("static KV cache, compiled passes")
    for model in (tiny.target, tiny.draft, tiny.eagle3_target):
        graphs.detach(model)
    assert got == eager_tokens(tiny, tiny_tok, kind, rows, config)


def test_inductor_compiles_the_pass_on_the_cpu(tiny, tiny_tok, compiled):
    """The real backend, inductor (C++ on the CPU, Triton on a GPU), compiles the static pass with dynamic shapes and
    decodes AR's tokens at B = 1 and 2 (a bool scatter in the mask once failed to compile when a pass was 1 wide)."""
    config = GenerationConfig(max_new_tokens=8)
    got = [eager_tokens(tiny, tiny_tok, None, rows, config) for rows in (1, 2)]
    assert compiled[0].compile, compiled[0].reason
    for model in (tiny.target, tiny.draft, tiny.eagle3_target):
        graphs.detach(model)
    assert got == [eager_tokens(tiny, tiny_tok, None, rows, config) for rows in (1, 2)]


def test_a_pass_that_will_not_compile_runs_uncompiled_with_one_line(tiny, tiny_tok, compiled, monkeypatch, caplog):
    """A backend that fails: one warning, the passes run uncompiled from then on, the tokens are the eager engine's,
    and the runner's description says why."""
    def failing(gm, inputs):
        raise RuntimeError("no kernels today")

    monkeypatch.setattr(graphs, "COMPILE_BACKEND", failing)
    config = GenerationConfig(max_new_tokens=12, num_draft_tokens=2)
    with caplog.at_level("WARNING", logger="specdemo.engine.graphs"):
        got = eager_tokens(tiny, tiny_tok, "model", 2, config)
    assert not compiled[0].compile and "did not compile" in graphs.describe(tiny.target)
    assert len([r for r in caplog.records if "uncompiled" in r.message and "no kernels today" in r.message]) == 2
    for model in (tiny.target, tiny.draft, tiny.eagle3_target):
        graphs.detach(model)
    assert got == eager_tokens(tiny, tiny_tok, "model", 2, config)


def test_many_pass_shapes_stay_compiled(compiled, monkeypatch):
    """Each batch and width of 1 (which dynamic shapes specialise), kept width and set of feature layers is a trace of
    its own, all of one code object (Storage.run): more than dynamo's default of 8 must not turn compiling off. A
    stand-in pass of the same signature keeps the 12 traces quick."""
    def run(storage, b, t, keep, layers, offset=0):
        out = torch.ones(b, t, 2)[:, t - keep:]  # b, t and keep as sizes, as the pass has them
        return out if layers is None else out + len(layers), None

    monkeypatch.setattr(graphs, "COMPILE_BACKEND", "aot_eager")
    monkeypatch.setattr(graphs.Storage, "run", run)
    runner = compiled[0]
    storage = types.SimpleNamespace(run=lambda *args: run(None, *args))  # what an uncompiled pass would call
    # dynamo's default, whatever ran before (its own patch: monkeypatch's undo deletes a config entry)
    with torch._dynamo.config.patch(recompile_limit=8):
        for b in (1, 2):
            for t in (1, 3):
                for keep in {1, t}:
                    for layers in (None, (0,)):
                        assert runner.run(storage, b, t, keep, layers)[0].shape == (b, keep, 2)
        assert runner.compile, runner.reason
        assert torch._dynamo.config.recompile_limit >= graphs.RECOMPILE_LIMIT
