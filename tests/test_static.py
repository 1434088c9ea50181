"""The static KV cache and the graph runner's code on the CPU (engine.static, engine.graphs; captured on CUDA by
scripts/gpu_check.sh): the eager engine's greedy tokens for every drafter and batch size, exact sampling, fixed
cache addresses, rollback that writes nothing, rows that hold a fresh prefill, and a step function that compiles
whole."""

import contextlib

import pytest
import torch
from conftest import TEST_DEVICE, case, drafter_cases
from test_batch import assert_lossless
from test_engine import test_dynamic_k_is_lossless_and_adapts, test_sampled_distribution_matches_target

from specdemo.config import GenerationConfig
from specdemo.drafters import ModelDrafter, NgramDrafter, eagle3_device_tree
from specdemo.drafters.eagle3 import Eagle3Drafter
from specdemo.drafters.eagle3_static import StaticHeadKV
from specdemo.engine import decode, graphs, loop, row_outputs
from specdemo.engine.kv import with_cache
from specdemo.engine.static import StaticKV

PROMPTS = [[3, 5, 7, 3, 5, 9, 2], [4, 4, 1], [9, 8, 7, 6, 5, 4, 3, 2, 1, 2, 3, 4], [2]]

# the engine's own losslessness tests, run again here with the static runner on (see the `static` fixture)
__all__ = ["test_dynamic_k_is_lossless_and_adapts", "test_sampled_distribution_matches_target"]


@pytest.fixture(autouse=True)
def static(tiny):
    """The tiny targets and draft served by the static runner (uncaptured on the CPU) for the test's duration; an
    EAGLE-3 head built for the 8-layer target follows it (conftest.eagle3_drafter)."""
    for model in (tiny.target, tiny.draft, tiny.eagle3_target):
        assert graphs.attach(model, "on") is not None
    yield
    for model in (tiny.target, tiny.draft, tiny.eagle3_target):
        graphs.detach(model)


def _eager(*models_and_fn):
    """fn() with these models (and whatever drafter fn builds for them) on the eager engine."""
    *models, fn = models_and_fn
    for model in models:
        graphs.detach(model)
    try:
        return fn()
    finally:
        for model in models:
            graphs.attach(model, "on")


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("case", [None, *drafter_cases()], ids=str)
def test_static_runner_gives_the_eager_engines_greedy_tokens(tiny, tiny_tok, case, k, rows):
    """Every registered drafter kind (conftest's cases; and none: AR), at k = 1, 2, 4, 8 and B = 1 and 4: the same
    greedy tokens as the eager engine, through a StaticKV (an EAGLE-3 head's drafts through its StaticHeadKV), and
    each row the target's own greedy output of its prompt alone (test_batch.assert_lossless: bar a near-tie)."""
    prompts, config = PROMPTS[:rows], GenerationConfig(max_new_tokens=40, num_draft_tokens=k)
    target = case.build(tiny)[0] if case else tiny.target
    drafters = []

    def tokens():
        drafters.append(case.build(tiny)[1] if case else None)
        return row_outputs(list(decode(target, tiny_tok, prompts, config, drafters[-1])), rows)

    eager = _eager(target, tiny.draft, tokens)
    assert isinstance(graphs.new_kv(target, 1, 256), StaticKV)
    told: list[bool] = []  # each of the engine's passes says how many entries each row feeds, and says it right
    forward = StaticKV.forward

    def checked(self, tokens, real, keep, layers=None, tree=None, fed=None):
        told.append(fed is not None and list(fed) == real.sum(1).tolist())
        return forward(self, tokens, real, keep, layers, tree, fed)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StaticKV, "forward", checked)
        assert tokens() == eager
    assert told and all(told)
    assert_lossless(target, prompts, _eager(target, lambda: own_greedy(target, tiny_tok, rows, config)), eager)
    heads = [d for d in (drafters[-1], getattr(drafters[-1], "model", None)) if isinstance(d, Eagle3Drafter)]
    assert all(isinstance(d.kv, StaticHeadKV) for d in heads)


_OWN: dict = {}


def own_greedy(target, tok, rows: int, config: GenerationConfig) -> list[list[int]]:
    """Each of the first `rows` prompts decoded alone by the target (no drafter), once per target and length."""
    key = (id(target), config.max_new_tokens)
    if key not in _OWN:
        _OWN[key] = [row_outputs(list(decode(target, tok, [p], config)), 1)[0] for p in PROMPTS]
    return _OWN[key][:rows]


def _buffers(kv: StaticKV) -> list[torch.Tensor]:
    return [t for layer in kv.storage.cache.layers for t in (layer.keys, layer.values)]


def test_cache_keeps_its_addresses_and_rollback_writes_nothing(tiny_target, tiny_draft, tiny_tok, monkeypatch):
    """A 64-token run with rejections: the target's and the draft's cache buffers never move, and a rollback leaves
    every buffer bit for bit as it was (it moves a row's length only)."""
    made, rollbacks = [], []
    new_kv, keep = graphs.new_kv, StaticKV.keep

    def recording_new_kv(*args, **kwargs):
        made.append(new_kv(*args, **kwargs))
        return made[-1]

    def checked_keep(self, counts):
        before = [t.clone() for t in _buffers(self)]
        moved = counts != self.counts
        keep(self, counts)
        assert all(torch.equal(a, b) for a, b in zip(before, _buffers(self)))
        rollbacks.append(moved and self.counts == list(counts))

    monkeypatch.setattr(graphs, "new_kv", recording_new_kv)
    monkeypatch.setattr(StaticKV, "keep", checked_keep)
    config = GenerationConfig(max_new_tokens=64, num_draft_tokens=4)
    addresses = None
    rejections = generated = 0
    for event in decode(tiny_target, tiny_tok, PROMPTS[:1], config, ModelDrafter(tiny_draft)):
        if event.kind == "spec":  # from the first draft on, both caches are allocated
            now = [t.data_ptr() for kv in made for t in _buffers(kv)]
            addresses = addresses or now
            assert now == addresses
        rejections += sum(s.num_accepted < len(s.drafted) for s in event.steps)
        generated = event.num_generated
    assert generated == 64 and addresses
    assert rejections > 0 and any(rollbacks)
    assert len(made) == 2 and all(isinstance(kv, StaticKV) for kv in made)  # the target's and the draft's


def test_every_layers_cache_is_one_block_moved_in_one_op(tiny_target, tiny_tok, monkeypatch):
    """A storage's layers hold their keys and values as views of one block (layers, 2, rows, H, capacity, D), so rows
    leaving (select) and a tree's accepted path copied down (keep_entries) are one op for every layer, not one per
    buffer; each moves what the per-layer code moves."""
    kv = graphs.new_kv(tiny_target, 4, 256)
    with torch.inference_mode():
        kv.prefill(PROMPTS)
    block = kv.storage.whole()
    assert block is not None and block.shape[:3] == (len(kv.storage.cache.layers), 2, kv.storage.rows)
    assert all(layer.keys.data_ptr() == block[i, 0].data_ptr() and layer.values.data_ptr() == block[i, 1].data_ptr()
               for i, layer in enumerate(kv.storage.cache.layers))
    block.copy_(torch.randn_like(block))
    per_layer = [b.clone() for b in _buffers(kv)]
    for buf in per_layer:  # what the per-layer code does: rows 2 and 0, in that order, to the front
        buf[:2] = buf.index_select(0, torch.tensor([2, 0]))
    ops = []
    index_select = torch.Tensor.index_select
    monkeypatch.setattr(torch.Tensor, "index_select", lambda *a: ops.append(1) or index_select(*a))
    kv.select([2, 0])
    assert len(ops) == 1 and all(torch.equal(a[:2], b[:2]) for a, b in zip(per_layer, _buffers(kv)))
    kv.start = list(kv.counts)  # as after a forward of 4 entries a row: row 0 keeps entries 0, 2 and 3
    kv.counts = [c + 4 for c in kv.counts]
    expected = [b[:2].clone() for b in _buffers(kv)]
    for buf in expected:
        s0 = kv.start[0]
        buf[0, :, s0 + 1 : s0 + 3] = buf[0, :, [s0 + 2, s0 + 3]].clone()
    kv.keep_entries([[0, 2, 3], [0, 1]])
    assert all(torch.equal(a, b[:2]) for a, b in zip(expected, _buffers(kv)))
    assert kv.counts == [kv.start[0] + 3, kv.start[1] + 2]
    kv.release()


def _fresh(model, ids):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids], device=model.device), **with_cache(model, cache), use_cache=True)
    return cache


def test_rows_hold_a_fresh_prefill_after_every_rollback(tiny_target, tiny_draft, tiny_tok, monkeypatch):
    """Four rows accepting different lengths: after each step each row's first counts[r] positions equal a fresh
    single-sequence prefill of its committed ids (the pending token aside), in the target's cache and the draft's."""
    made = []
    new_kv = graphs.new_kv
    monkeypatch.setattr(graphs, "new_kv", lambda *a, **kw: made.append(new_kv(*a, **kw)) or made[-1])
    config = GenerationConfig(max_new_tokens=24, num_draft_tokens=4)
    ids = {i: list(p) for i, p in enumerate(PROMPTS)}
    ragged = 0
    for event in decode(tiny_target, tiny_tok, PROMPTS, config, ModelDrafter(tiny_draft)):
        for i, t in zip(event.rows, event.tokens):
            ids[i] += t
        if event.kind != "spec" or event.finished:
            continue
        ragged += len(set(event.num_accepted)) > 1
        for kv, model, upto in ((made[0], tiny_target, lambda r, i: len(ids[i]) - 1),
                                (made[1], tiny_draft, lambda r, i: made[1].counts[r])):
            for r, i in enumerate(event.rows):
                n = upto(r, i)
                assert kv.counts[r] == n
                fresh = _fresh(model, ids[i][:n])
                for mine, ref in zip(kv.storage.cache.layers, fresh.layers):
                    assert torch.allclose(mine.keys[r, :, :n], ref.keys[0], atol=1e-5)
                    assert torch.allclose(mine.values[r, :, :n], ref.values[0], atol=1e-5)
    assert ragged > 0


def test_the_step_function_compiles_whole(tiny_target):
    """torch.compile(fullgraph=True) traces a verify-shaped pass over the static buffers without a graph break, and
    the compiled pass gives the eager pass's logits."""
    torch._dynamo.reset()
    with torch.inference_mode():
        kv = graphs.new_kv(tiny_target, 2, 256)
        kv.prefill([[3, 4, 5], [6, 7]])
        storage = kv.storage
        storage.input_view(2, 3).copy_(torch.tensor([[1, 2, 3], [4, 5, 6]]))
        eager = storage.run(2, 3, 3, None)[0]
        compiled = torch.compile(storage.run, fullgraph=True)(2, 3, 3, None)[0]
    torch._dynamo.reset()
    assert torch.allclose(compiled, eager, atol=1e-5)


@pytest.mark.skipif(TEST_DEVICE.type == "cuda", reason="on CUDA the forward captures")
def test_a_forward_that_will_not_capture_falls_back_with_one_line(tiny_target, tiny_tok, caplog):
    """A runner asked to capture a forward that cannot be captured (here: no CUDA at all) says why once, runs the
    same static code eagerly from then on, and decodes the eager engine's tokens."""
    config = GenerationConfig(max_new_tokens=12, num_draft_tokens=2)
    eager = _eager(tiny_target, tiny_target, lambda: row_outputs(list(decode(tiny_target, tiny_tok, PROMPTS[:2],
                                                                             config, NgramDrafter())), 2))
    runner = graphs.runner_of(tiny_target)
    runner.capture = True
    with caplog.at_level("WARNING", logger="specdemo.engine.graphs"):
        got = row_outputs(list(decode(tiny_target, tiny_tok, PROMPTS[:2], config, NgramDrafter())), 2)
    assert got == eager
    assert not runner.capture and "did not capture" in runner.reason
    assert len([r for r in caplog.records if "eagerly" in r.message]) == 1
    assert graphs.describe(tiny_target).startswith("static KV cache, no graphs (its forward did not capture")


def test_graphs_setting_chooses_the_runner(tiny_target):
    """auto: eager on a CPU, saying why; on: the static runner; off: eager; the same mode again keeps the runner
    (and its graphs); an unknown mode is refused; SPECDEMO_GRAPHS and --graphs set it."""
    import argparse

    from specdemo.cliargs import add_runtime_args, runtime_args

    assert graphs.attach(tiny_target, "auto") is None
    assert "computes on cpu" in graphs.describe(tiny_target)
    runner = graphs.attach(tiny_target, "on")
    assert runner is not None and graphs.attach(tiny_target, "on") is runner
    assert graphs.attach(tiny_target, "off") is None and graphs.describe(tiny_target) == "eager (--graphs off)"
    with pytest.raises(ValueError, match="--graphs must be one of auto, on, off"):
        graphs.attach(tiny_target, "sometimes")
    p = argparse.ArgumentParser()
    add_runtime_args(p)
    assert runtime_args(p.parse_args([]), {}).graphs == "auto"
    assert runtime_args(p.parse_args([]), {"SPECDEMO_GRAPHS": "Off"}).graphs == "off"
    assert runtime_args(p.parse_args(["--graphs", "on"]), {"SPECDEMO_GRAPHS": "off"}).graphs == "on"


def test_baseline_check_takes_the_faster_transformers_decoding():
    """On a GPU the bench also times generate() with a static compiled cache; the baseline check compares our AR
    with whichever of the two ran faster, and names it."""
    from specdemo.measure.bench.outputs import baseline_warning
    from specdemo.measure.bench.report import anchors_summary

    row = {"ar_tokens": 100, "ar_seconds": 1.0, "hf_generate_tokens": 100, "hf_generate_seconds": 1.25,
           "hf_generate_identical": True}
    plain = anchors_summary([row])
    assert plain["baseline"] == "generate" and plain["ar_vs_hf_generate"] == pytest.approx(1.25)
    fast = anchors_summary([{**row, "hf_static_tokens": 100, "hf_static_seconds": 0.5}])
    assert fast["baseline"] == "generate, static cache, compiled"
    assert fast["ar_vs_hf_generate"] == pytest.approx(0.5) and fast["hf_static_tokens_per_s"] == pytest.approx(200)
    assert "static cache, compiled" in baseline_warning(fast) and baseline_warning(plain) == ""


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("kind,k,tree,device", [(None, 1, "off", False), ("ngram", 6, "off", False),
                                                 ("model", 2, "off", False), ("eagle3", 3, "8", True),
                                                 ("eagle3", 3, "6", False), ("suffix", 4, "auto", False)])
def test_passes_padded_to_a_captured_width_give_the_same_tokens(tiny, tiny_tok, kind, k, tree, device, rows,
                                                               monkeypatch, load_time_costs):
    """Passes padded up to the next captured width (graphs.WIDTH_BUCKETS, as under capture; here buckets of 1, 4,
    8, 16 and 33 so that most passes pad): chains, a draft LM's own padded steps, the head's trees verified on the
    device or from the host, suffix decoding's trees: the same greedy tokens as unpadded passes. The real entries
    never see the padding (an entry sees only earlier ones: Storage.set_layout); plain decoding's one-token passes
    never pad."""
    config = GenerationConfig(max_new_tokens=32, num_draft_tokens=k, tree=tree)
    prompts = PROMPTS[:rows]
    if device:
        monkeypatch.setattr(loop, "ONE_READ", "always")
        monkeypatch.setattr(eagle3_device_tree, "DEVICE_TREES", "always")

    def tokens():
        target, drafter = case(kind).build(tiny) if kind else (tiny.target, None)
        if drafter is not None:
            drafter.pass_costs = {n: 1.0 + 0.01 * n for n in range(1, 17)}
        return row_outputs(list(decode(target, tiny_tok, prompts, config, drafter)), rows)

    unpadded = tokens()
    padded, replay = [], graphs.Runner.replay

    def watched(self, storage, tokens, keep, layers, graph=True):
        padded.append(self.width(tokens.shape[1], keep, graph) > tokens.shape[1])
        return replay(self, storage, tokens, keep, layers, graph)

    monkeypatch.setattr(graphs, "PAD_WIDTHS", "always")
    monkeypatch.setattr(graphs, "WIDTH_BUCKETS", (1, 4, 8, 16, 33))
    monkeypatch.setattr(graphs.Runner, "replay", watched)
    assert tokens() == unpadded
    assert sum(padded) > 5 if kind else not any(padded)  # an autoregressive pass keeps one logit: never padded


class _FailingCapture:
    """torch.cuda.graph whose capture_end raises, as a capture invalidated by a host synchronisation does; like
    torch's, it leaves its capture stream current then."""

    def __init__(self, graph, pool=None):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        raise RuntimeError("operation not permitted when stream is capturing")


@pytest.mark.skipif(TEST_DEVICE.type == "cuda", reason="stands in for torch.cuda's calls")
def test_a_capture_that_breaks_restores_the_stream_and_stops_every_runner(tiny_target, monkeypatch, caplog):
    """A capture that fails after it began (torch 2.11 may then leave its allocator capturing) puts the stream back,
    says why once, and no runner in the process tries to capture again; they run eagerly and say why. torch.cuda's
    calls are stand-ins here: this machine has no CUDA (scripts/gpu_check.sh runs the real ones)."""
    class Stream:
        def wait_stream(self, other):
            pass

    current, set_to = Stream(), []
    cuda = torch.cuda
    monkeypatch.setattr(graphs, "_broken", [])
    for name, value in {"graph_pool_handle": lambda: object(), "Stream": lambda device=None: Stream(),
                        "stream": lambda s: contextlib.nullcontext(),
                        "current_stream": lambda device=None: current, "CUDAGraph": object,
                        "graph": _FailingCapture, "set_stream": set_to.append,
                        "synchronize": lambda device=None: None}.items():
        monkeypatch.setattr(cuda, name, value)
    runner, other = graphs.runner_of(tiny_target), graphs.Runner(object(), capture=True)
    runs = []
    with caplog.at_level("WARNING", logger="specdemo.engine.graphs"):
        with pytest.raises(graphs.CaptureBroken, match="capturing a 1 x 2 pass failed .RuntimeError"):
            runner.record(torch.device("cuda"), lambda: runs.append(1), "a 1 x 2 pass")
        assert set_to == [current] and len(runs) == 3  # two warm-up runs, then the one under capture
        storage = type("S", (), {"graphs": {}, "device": torch.device("cuda")})()
        assert other.call(storage, ("k",), 1, lambda: (torch.ones(2, 1),), "a head step")[0].shape == (1, 1)
    assert len(runs) == 3  # the other runner did not try
    assert not other.capture and graphs.capture_broken() == other.reason
    assert len([r for r in caplog.records if "failed" in r.message]) == 1


def test_a_decode_takes_the_storage_released_last(tiny_target):
    """A warm-up captures its graphs on a storage and releases it; the timed decode after it must get that storage
    (with its graphs), not an older free one that also fits."""
    runner = graphs.runner_of(tiny_target)
    first, second = runner.acquire(1, 64), runner.acquire(1, 64)
    runner.release(second)
    runner.release(first)
    assert runner.acquire(1, 64) is first
    runner.release(first)
    assert runner.acquire(1, 64) is first


def _production_forward_tokens(tiny_tok, dtype, capture: bool, monkeypatch) -> tuple[list, graphs.Runner]:
    """Greedy tokens of a fresh tiny llama with the kernels a real model gets at load on its device (merged q/k/v and
    gate/up products, the joint RoPE, and on CUDA the fused RMSNorm and attention without cuDNN), under the static
    runner, captured or not, every pass width padded alike; and the runner."""
    from conftest import WORDS, tiny_llama

    from specdemo.config import Runtime
    from specdemo.models import kernels
    from specdemo.models.loading import _fast_kernels

    monkeypatch.setattr(graphs, "PAD_WIDTHS", "always")
    model = tiny_llama(len(WORDS) + 1, seed=1, sharpness=8.0).to(dtype)
    _fast_kernels(model, TEST_DEVICE, dtype, Runtime(merge_projections="on"))
    try:
        runner = graphs.attach(model, "on")
        runner.capture = capture and runner.capture
        config = GenerationConfig(max_new_tokens=24, num_draft_tokens=3, tree="off")
        return row_outputs(list(decode(model, tiny_tok, PROMPTS[:2], config, NgramDrafter())), 2), runner
    finally:
        graphs.detach(model)
        kernels.unfuse_rope()


@pytest.mark.skipif(TEST_DEVICE.type != "cuda", reason="CUDA graphs: scripts/gpu_check.sh runs this (GRAPH_TESTS=1)")
def test_the_forward_a_real_model_runs_captures(tiny_tok, monkeypatch):
    """The tiny tests' models are float32 and built directly; a real model on a GPU is bfloat16 with load's kernels.
    That forward captures, and its replays decode the tokens of the same code uncaptured."""
    plain, _ = _production_forward_tokens(tiny_tok, torch.bfloat16, False, monkeypatch)
    captured, runner = _production_forward_tokens(tiny_tok, torch.bfloat16, True, monkeypatch)
    assert runner.capture and runner.graphs > 0, runner.reason
    assert captured == plain
