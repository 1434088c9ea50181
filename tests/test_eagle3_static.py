"""An EAGLE-3 head's static KV cache and graph runner (drafters/eagle3_static.py) against its eager cache, on tiny
random heads: the same proposals token for token (greedy chains with and without the confidence stop, trees, B = 1
and 4), fixed buffer addresses over a run with rejections, rollback that writes nothing, growth past the capacity, a
greedy chain that compiles whole, and on CUDA (GRAPH_TESTS=1 in scripts/gpu_check.sh) the captured chain, catch-up and
tree level equal to the eager passes (on the CPU a tree's levels run through the same level buffers uncaptured).
Greedy and sampled decoding through the head's static path is test_static.py's (conftest's cases)."""

import pytest
import torch
from conftest import TEST_DEVICE, draft_vocab, random_head
from test_tree_engine import PROMPTS

from specdemo.config import GenerationConfig, SamplingConfig
from specdemo.drafters import eagle3_static
from specdemo.drafters.base import eos_on
from specdemo.drafters.eagle3 import Eagle3Drafter
from specdemo.drafters.eagle3_static import HeadRunner, StaticHeadKV, attach
from specdemo.engine import decode, graphs, row_outputs


@pytest.fixture(scope="module")
def head(eagle3_target):
    """A random head over 12 of the 8-layer tiny target's 16 ids (as conftest.eagle3_drafter's)."""
    return random_head(eagle3_target, 0, vocab=draft_vocab(12, 0, vocab=16))


@pytest.fixture
def static_head(head):
    """The head served by its runner (uncaptured on the CPU, captured on CUDA) for the test's duration."""
    runner = attach(head, "on")
    assert isinstance(runner, HeadRunner)
    yield runner
    graphs.detach(head)


def drafts(target, tok, head, prompts, config, min_confidence=0.0):
    """Each step's drafted tokens per row, the q of each drafted token, and the output, with a fresh drafter."""
    drafter = Eagle3Drafter(head, min_confidence=min_confidence)
    events = list(decode(target, tok, prompts, config, drafter))
    steps = [(s.drafted, s.parents) for e in events for s in e.steps]
    q = [s.draft_token_probs or [] for e in events for s in e.steps]
    return steps, q, row_outputs(events, len(prompts)), drafter


def _gate(q: list[list[float]]) -> float:
    """A confidence stop near the median q of the tokens after each step's first, midway between two observed values
    at least 1e-3 apart (a gate at an observed q would decide on float noise)."""
    later = sorted(p for step in q for p in step[1:])
    pairs = [(a, b) for a, b in zip(later, later[1:]) if b - a > 1e-3]
    a, b = min(pairs, key=lambda p: abs(later.index(p[0]) - len(later) // 2), default=(0.5, 0.5))
    return (a + b) / 2


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("gate", ["off", "median"])
def test_static_chains_are_the_eager_chains(eagle3_target, tiny_tok, head, gate, k, rows):
    """Greedy chains at k = 1, 2, 4, 8, B = 1 and 4, without a confidence stop and with one near the median q of the
    tokens after the first (_gate): the static cache's proposals (all k steps run, one read at the end) are the eager
    cache's, token for token, with the same q, over a whole run (rejections, rows leaving); the output is the same."""
    config = GenerationConfig(max_new_tokens=32, num_draft_tokens=k)
    eager = drafts(eagle3_target, tiny_tok, head, PROMPTS[:rows], config)
    if gate == "median":
        eager = drafts(eagle3_target, tiny_tok, head, PROMPTS[:rows], config, _gate(eager[1]))
    attach(head, "on")
    try:
        static = drafts(eagle3_target, tiny_tok, head, PROMPTS[:rows], config, eager[3].min_confidence)
    finally:
        graphs.detach(head)
    assert isinstance(static[3].kv, StaticHeadKV) and not isinstance(eager[3].kv, StaticHeadKV)
    assert static[0] == eager[0] and static[2] == eager[2]
    assert sum(static[1], []) == pytest.approx(sum(eager[1], []), abs=1e-5)
    lengths = {len(d) for d, _ in eager[0] if d}
    assert max(lengths) == k and (gate == "off" or k == 1 or len(lengths) > 1)  # the stop acted, not on all


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_static_trees_are_the_eager_trees(eagle3_target, tiny_tok, head, temperature, rows):
    """Dynamic trees (up to 4 deep, 8 nodes), greedy and sampled (the same seeds): the static cache's trees (each
    level a pass with explicit positions and an ancestry mask over the fixed buffers) are the eager cache's, node for
    node, and so is the output."""
    config = GenerationConfig(max_new_tokens=32, num_draft_tokens=4, tree="8",
                              sampling=SamplingConfig(temperature=temperature), seed=2)
    eager = drafts(eagle3_target, tiny_tok, head, PROMPTS[:rows], config)
    attach(head, "on")
    try:
        static = drafts(eagle3_target, tiny_tok, head, PROMPTS[:rows], config)
    finally:
        graphs.detach(head)
    assert static[0] == eager[0] and static[2] == eager[2]
    trees = [p for _, p in static[0] if p is not None]
    assert trees and (temperature or any(p != list(range(-1, len(p) - 1)) for p in trees))  # greedy: branching


def test_a_loaded_head_takes_the_targets_graphs_setting(eagle3_target, tiny_tok, tmp_path):
    """The draft kind's factory loads a head under the runtime's --graphs: `on` gives it a runner (the static cache),
    `auto` on a CPU and `off` the eager cache, and the result's runner line names how its draft steps run."""
    from conftest import loaded

    from specdemo.config import Runtime
    from specdemo.drafters.registry import BuildOptions, get
    from specdemo.measure.compare import Pair, runner_info
    from specdemo.models.eagle3 import save_eagle3

    save_eagle3(random_head(eagle3_target, 0, vocab=draft_vocab(12, 0, vocab=16)), tmp_path, dtype=torch.float32)
    heads = {}
    for mode in ("on", "auto", "off"):
        options = BuildOptions(runtime=Runtime(graphs=mode))
        heads[mode] = get("model").factory(loaded(eagle3_target, tiny_tok), str(tmp_path), options)[0]
    cuda = TEST_DEVICE.type == "cuda"
    assert isinstance(graphs.runner_of(heads["on"].head), HeadRunner) and graphs.runner_of(heads["off"].head) is None
    assert (graphs.runner_of(heads["auto"].head) is not None) == cuda

    def line(mode):
        return runner_info(Pair(loaded(eagle3_target, tiny_tok), heads[mode], "model", "head"))["draft"]

    assert line("on").startswith("CUDA graphs" if cuda else "static KV cache, no graphs")
    assert line("off") == "eager (--graphs off)" and (cuda or "computes on cpu" in line("auto"))
    # a bench row says it too, beside the target's
    from specdemo.config import GenerationConfig
    from specdemo.engine.timing import ForwardTimer
    from specdemo.measure.bench.run import bench_prompt
    from specdemo.measure.bench.timing import target_modules
    from specdemo.prompts import PromptItem

    pair = Pair(loaded(eagle3_target, tiny_tok), heads["on"], "model", "head")
    timers = (ForwardTimer(target_modules(eagle3_target)), None)
    try:
        row, = bench_prompt(pair, PromptItem("a", "chat", "w1 w2 w3 w4"), [1, 2, 3, 4], [2],
                            GenerationConfig(max_new_tokens=6, tree="off"), timers, False, {})
    finally:
        timers[0].remove()
    assert row["draft_runner"] == line("on") and "runner" in row


def _buffers(kv: StaticHeadKV) -> list[torch.Tensor]:
    return kv.storage.buffers()


def test_buffers_keep_their_addresses_and_rollback_writes_nothing(eagle3_target, tiny_tok, head, static_head,
                                                                  monkeypatch):
    """A 64-token run with rejections, B = 2: the head's key and value buffers never move, and every rollback (the
    drafted entries cut at a verdict) leaves them bit for bit as they were: it moves lengths only."""
    rollbacks = []
    keep = StaticHeadKV.keep

    def checked_keep(self, counts):
        before = [t.clone() for t in _buffers(self)]
        moved = list(counts) != self.counts
        keep(self, counts)
        assert all(torch.equal(a, b) for a, b in zip(before, _buffers(self)))
        rollbacks.append(moved and self.counts == list(counts))

    monkeypatch.setattr(StaticHeadKV, "keep", checked_keep)
    drafter = Eagle3Drafter(head)
    config = GenerationConfig(max_new_tokens=64, num_draft_tokens=4)
    addresses, rejections = None, 0
    for event in decode(eagle3_target, tiny_tok, PROMPTS[:2], config, drafter):
        if event.kind == "spec":
            now = [t.data_ptr() for t in _buffers(drafter.kv)] + [drafter.kv.storage.lengths.data_ptr()]
            addresses = addresses or now
            assert now == addresses
            rejections += sum(s.num_accepted < len(s.drafted) for s in event.steps)
    assert addresses and rejections > 0 and any(rollbacks)


def test_a_row_that_outruns_the_capacity_grows_by_one_copy(eagle3_target, tiny_tok, head, static_head,
                                                           monkeypatch):
    """A cache made with room for 16 positions grows once, into a larger storage, copying the rows it holds; the
    proposals stay the eager cache's."""
    config = GenerationConfig(max_new_tokens=40, num_draft_tokens=4)
    graphs.detach(head)
    eager = drafts(eagle3_target, tiny_tok, head, PROMPTS[:2], config)
    attach(head, "on")
    monkeypatch.setattr(eagle3_static, "rounded_capacity", lambda positions: 16)
    grown = []
    grow = StaticHeadKV._grow
    monkeypatch.setattr(StaticHeadKV, "_grow", lambda self, need: grown.append(need) or grow(self, need))
    static = drafts(eagle3_target, tiny_tok, head, PROMPTS[:2], config)
    assert len(grown) == 1 and static[3].kv.storage.capacity > 16
    assert static[0] == eager[0] and static[2] == eager[2]


def _one_step_ready(head, rows: int = 2):
    """A static head cache with a short catch-up fed to each row, and a chain's input in its feature buffer."""
    kv = eagle3_static.new_head_kv(head, [[1, 2, 3]] * rows)
    torch.manual_seed(3)
    c, device = head.c, kv.device
    hidden = torch.randn(rows, 3, c.hidden_size, dtype=head.norm.weight.dtype, device=device)
    tokens = torch.randint(1, 16, (rows, 3), device=device)
    kv.run(hidden, tokens, torch.tensor([[True, True, r % 2 == 0] for r in range(rows)]))
    kv.storage.feature[:rows].copy_(hidden[:, -1])
    return kv


def test_the_greedy_chain_compiles_whole(head, static_head):
    """torch.compile(fullgraph=True) traces the head's greedy chain (3 tokens: its first and two draft steps, then
    each row's length under a confidence stop and an end of sequence id) over the static buffers without a graph
    break, and the compiled chain gives the eager chain's tokens, q and lengths."""
    torch._dynamo.reset()
    with torch.inference_mode():
        kv = _one_step_ready(head)
        kv.storage.set_ks([3, 2])
        eos = eos_on(frozenset({5}), kv.device)
        eager = kv.storage.chain(2, 3, 0.3, eos)
        compiled = torch.compile(kv.storage.chain, fullgraph=True)(2, 3, 0.3, eos)
    torch._dynamo.reset()
    assert eager[0].shape == (2, 3) and torch.equal(compiled[0], eager[0])
    assert torch.allclose(compiled[1], eager[1], atol=1e-6) and torch.equal(compiled[2], eager[2])
    assert eager[2][1] <= 2  # row 1 asked for 2
    kv.release()


@pytest.mark.skipif(TEST_DEVICE.type == "cuda", reason="on CUDA the step captures")
def test_a_step_that_will_not_capture_falls_back_with_one_line(eagle3_target, tiny_tok, head, static_head, caplog):
    """A head runner asked to capture a step that cannot be captured (here: no CUDA at all) says why once, runs the
    same static code eagerly from then on, and drafts the eager cache's chains."""
    config = GenerationConfig(max_new_tokens=24, num_draft_tokens=3)
    static_head.capture = True
    with caplog.at_level("WARNING", logger="specdemo.engine.graphs"):
        fallen = drafts(eagle3_target, tiny_tok, head, PROMPTS[:2], config)
    graphs.detach(head)
    eager = drafts(eagle3_target, tiny_tok, head, PROMPTS[:2], config)
    assert fallen[0] == eager[0] and fallen[2] == eager[2]
    assert not static_head.capture and "did not capture" in static_head.reason
    assert len([r for r in caplog.records if "Eagle3Head eagerly" in r.message]) == 1


@pytest.mark.skipif(TEST_DEVICE.type != "cuda", reason="CUDA graphs: scripts/gpu_check.sh runs this (GRAPH_TESTS=1)")
def test_the_captured_chain_is_the_eager_chain(head, static_head):
    """On CUDA the runner captures the greedy chain per padded batch size and k (3 rows run as 4, 3 tokens, one row
    asking for 2): a replay gives the eager chain's tokens, q and lengths, again on a second replay, and the runner
    says it captured."""
    assert static_head.capture
    with torch.inference_mode():
        kv = _one_step_ready(head, 3)
        feature = kv.storage.feature[:3].clone()
        kv.storage.set_ks([3, 3, 2])
        eager = kv.storage.chain(3, 3, 0.0, eos_on(frozenset({5}), kv.device))
        replayed = static_head.chain(kv.storage, feature, [3, 3, 2], 0.0, frozenset({5}))
        again = static_head.chain(kv.storage, feature, [3, 3, 2], 0.0, frozenset({5}))
    assert static_head.graphs >= 1 and graphs.describe(head).startswith("CUDA graphs")
    assert torch.equal(replayed[0], eager[0]) and torch.allclose(replayed[1].float(), eager[1].float(), atol=1e-4)
    assert torch.equal(replayed[2], eager[2])
    assert all(torch.equal(a, b) for a, b in zip(again, replayed))
    kv.release()


@pytest.mark.skipif(TEST_DEVICE.type != "cuda", reason="CUDA graphs: scripts/gpu_check.sh runs this (GRAPH_TESTS=1)")
def test_the_captured_catch_up_is_the_eager_pass(head, static_head):
    """On CUDA the catch-up after a verdict (3 rows of 2 entries, run as 4) replays as a graph: the eager pass's
    outputs, the same lengths after it."""
    with torch.inference_mode():
        kv = _one_step_ready(head, 3)
        hidden = torch.randn(3, 2, head.c.hidden_size, dtype=kv.storage.hidden.dtype, device=kv.device)
        tokens = torch.randint(0, 16, (3, 2), device=kv.device)
        eager = kv.storage.run(hidden, tokens)
        before = static_head.graphs
        replayed = static_head.catch_up(kv.storage, hidden, tokens)
    assert static_head.graphs == before + 1
    assert torch.allclose(replayed.float(), eager.float(), atol=1e-4)
    kv.release()


@pytest.mark.skipif(TEST_DEVICE.type != "cuda", reason="CUDA graphs: scripts/gpu_check.sh runs this (GRAPH_TESTS=1)")
def test_the_captured_tree_level_is_the_eager_pass(head, static_head):
    """On CUDA a draft tree's level pass (3 rows of 2 entries, run as 4: explicit positions and an ancestry mask)
    replays as a graph: the eager pass's outputs."""
    with torch.inference_mode():
        kv = _one_step_ready(head, 3)
        storage = kv.storage
        hidden = torch.randn(3, 2, head.c.hidden_size, dtype=storage.hidden.dtype, device=kv.device)
        tokens = torch.randint(0, 16, (3, 2), device=kv.device)
        lengths = storage.lengths[:3, None]
        positions = lengths.expand(3, 2).clone()  # two siblings at the row's next position
        mask = storage.slots[None, None, :] < lengths[:, :, None]  # the row's entries...
        mask = mask | (storage.slots[None, None, :] == lengths[:, :, None] + torch.arange(2, device=kv.device)[:, None])
        mask = mask[:, None]  # ...and itself: (3, 1, 2, capacity)
        eager = storage.run(hidden, tokens, positions, mask)
        before = static_head.graphs
        replayed = static_head.tree_level(storage, hidden, tokens, positions, mask)
    assert static_head.graphs == before + 1
    assert torch.allclose(replayed.float(), eager.float(), atol=1e-4)
    kv.release()
