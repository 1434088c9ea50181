"""An EAGLE-3 head's greedy tree grown on the device (drafters/eagle3_device_tree.py), on the CPU with
DEVICE_TREES = "always" over the head's static cache: under a node budget its proposals are eagle3_tree's node for
node (B = 1 and 4, k = 1 to 4, with and without the confidence stop), under --tree auto the output is the target's
own greedy output, and the whole tree comes back in one read a step; verified on the device (engine.device_step,
loop.ONE_READ = "always"), the same, the tree and the verdict read together. On CUDA (GRAPH_TESTS=1 in
scripts/gpu_check.sh) the same, with the head's passes captured."""

import dataclasses
from collections import Counter

import pytest
import torch
from conftest import TEST_DEVICE, draft_vocab, random_head
from test_draft_graphs import HOST_READS, counted_reads
from test_tree_engine import PROMPTS

from specdemo.config import GenerationConfig, SamplingConfig
from specdemo.drafters import eagle3_device_tree
from specdemo.drafters.base import FIELDS, DeviceTrees, DraftRequest
from specdemo.drafters.eagle3 import Eagle3Drafter
from specdemo.drafters.eagle3_static import attach
from specdemo.engine import decode, graphs, loop, row_outputs
from specdemo.engine.timing import StepCosts


@pytest.fixture(scope="module")
def head(eagle3_target):
    """A random head over 12 of the 8-layer tiny target's 16 ids (as test_eagle3_static's)."""
    return random_head(eagle3_target, 0, vocab=draft_vocab(12, 0, vocab=16))


def run(target, tok, head, prompts, config, device_trees: str, min_confidence: float = 0.0, pass_costs=None,
        one_read: str = "never", capture: bool = True):
    """(each row's steps' drafted tokens and parents, their q, the outputs, how many steps drafted) with a fresh
    drafter over the head's static cache, its greedy trees grown as `device_trees` says; with one_read "always" the
    engine verifies them on the device too (engine.device_step). capture=False: the head's static code uncaptured
    on CUDA too (for a test that reads the device inside a step, which no capture allows)."""
    drafter = Eagle3Drafter(head, min_confidence=min_confidence)
    drafter.pass_costs = pass_costs
    saved = eagle3_device_tree.DEVICE_TREES, loop.ONE_READ
    eagle3_device_tree.DEVICE_TREES, loop.ONE_READ = device_trees, one_read
    runner = attach(head, "on")
    if not capture:
        runner.capture, runner.reason = False, "the test reads the device inside its steps"
    try:
        events = list(decode(target, tok, prompts, config, drafter))
    finally:
        eagle3_device_tree.DEVICE_TREES, loop.ONE_READ = saved
        graphs.detach(head)
    steps = [(s.drafted, s.parents) for e in events for s in e.steps if e.kind == "spec"]
    q = [s.draft_token_probs for e in events for s in e.steps if e.kind == "spec"]
    return steps, q, row_outputs(events, len(prompts)), sum(e.kind == "spec" and e.k > 0 for e in events), events


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("k,nodes", [(1, 3), (2, 4), (3, 8), (4, 8), (4, 16)])
@pytest.mark.parametrize("min_confidence", [0.0, 0.3])
@pytest.mark.parametrize("one_read", ["never", "always"])
def test_device_trees_are_the_hosts(eagle3_target, eagle3_runner, tiny_tok, head, rows, k, nodes, min_confidence,
                                    one_read):
    """Under a node budget the device's tree is eagle3_tree's: the same nodes, parents and q at every step of a whole
    run (rejections, rows finishing), and the same output; read back alone, or verified on the device and read with
    the verdict (one_read), over the target's eager or static cache."""
    if TEST_DEVICE.type == "cuda" and ((k, nodes) != (4, 8) or rows == 1 or eagle3_runner == "eager"):
        pytest.skip("on CUDA one case a path: each run captures its graphs anew")
    config = GenerationConfig(max_new_tokens=32, num_draft_tokens=k, tree=str(nodes))
    host = run(eagle3_target, tiny_tok, head, PROMPTS[:rows], config, "never", min_confidence)
    device = run(eagle3_target, tiny_tok, head, PROMPTS[:rows], config, "always", min_confidence, one_read=one_read)
    assert device[0] == host[0] and device[2] == host[2]
    flat = [[p for step in q if step for p in step] for q in (device[1], host[1])]
    assert flat[0] == pytest.approx(flat[1], abs=1e-6)
    assert any(p is not None and p != list(range(-1, len(p) - 1)) for _, p in device[0])  # trees that branch


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("slope", [0.02, 0.15])
@pytest.mark.parametrize("one_read", ["never", "always"])
def test_device_trees_under_auto_cut_as_the_host_and_are_lossless(eagle3_target, tiny_tok, head, rows, slope,
                                                                  one_read, load_time_costs, monkeypatch):
    """Under --tree auto (every depth feeds FRONTIER nodes) the device's cut of each step's tree (drafters.trees'
    tree_budget on the device, by the step costs and the run's extra scale) is the host's cut of the same tree, and
    the output is the target's own greedy output; a gentle and a steep cost slope keep more and fewer nodes. The check
    reads the device inside each step, which no capture allows: on CUDA too the head's static code runs uncaptured."""
    if TEST_DEVICE.type == "cuda" and (rows == 1 or slope > 0.1):
        pytest.skip("on CUDA one case a path: each run captures its graphs anew")
    plain = row_outputs(list(decode(eagle3_target, tiny_tok, PROMPTS[:rows], GenerationConfig(max_new_tokens=32))),
                        rows)
    cut, sizes = eagle3_device_tree._cut, []

    def checked(pool, limits, n, cut_inputs):
        kept = cut(pool, limits, n, cut_inputs)
        costs, scale = eagle3_device_tree.cut_costs(cut_inputs)
        assert costs is not None and scale == 0.6
        fields = torch.stack([kept[f].double() for f in FIELDS], -1)
        assert eagle3_device_tree._read(fields) == eagle3_device_tree.host_cut(pool, limits.tolist(), costs, scale)
        sizes.extend(int(n) for n in kept["keep"].sum(1).tolist())
        return kept

    monkeypatch.setattr(eagle3_device_tree, "_cut", checked)
    monkeypatch.setattr(StepCosts, "extra_scale", lambda self: 0.6)  # the branches' values weighed, as a run learns
    config = GenerationConfig(max_new_tokens=32, num_draft_tokens=4, tree="auto")
    costs = {n: 1.0 + slope * n for n in range(1, 17)}
    assert run(eagle3_target, tiny_tok, head, PROMPTS[:rows], config, "always", pass_costs=costs,
               one_read=one_read, capture=False)[2] == plain
    assert len(set(sizes)) > 1  # the cut acted, not the same on every step


@pytest.mark.parametrize("one_read,tree", [("never", "8"), ("always", "8"), ("always", "auto")])
def test_a_device_tree_is_read_once(eagle3_target, tiny_tok, head, one_read, tree, load_time_costs, monkeypatch):
    """Under the static runner, however deep, a step's tree comes back in one read (_read's), and the verdict in
    another; verified on the device (one_read), the tree and the verdict come back together: the step's one read of
    the device, under --tree auto too (its pass sized by the trees read before: loop.auto_width)."""
    graphs.attach(eagle3_target, "on")
    per_step, step = [], loop._spec_step

    def counting(*args):
        with counted_reads() as reads:
            out = step(*args)
        per_step.append([f for path, f in reads if (path.rsplit("/", 1)[-1], f) not in HOST_READS])
        return out

    monkeypatch.setattr(loop, "_spec_step", counting)
    config = GenerationConfig(max_new_tokens=24, num_draft_tokens=4, tree=tree)
    costs = {n: 1.0 + 0.02 * n for n in range(1, 17)}
    try:
        drafting = run(eagle3_target, tiny_tok, head, PROMPTS[:2], config, "always", one_read=one_read,
                       pass_costs=costs)[3]
    finally:
        graphs.detach(eagle3_target)
    drafted = per_step[:drafting]  # the last step may have nothing to draft: its verdicts alone
    assert drafting > 5 and all(len(r) == 1 for r in per_step[drafting:])
    if one_read == "always":
        assert all(r == ["verify_trees_on_device"] for r in drafted), per_step
    else:
        assert all(r == ["_read", "greedy_tree_accept_batch"] for r in drafted), per_step


def test_auto_sizes_each_pass_by_the_trees_it_last_read(eagle3_target, tiny_tok, head, load_time_costs):
    """Verified on the device under --tree auto, a step's pass is sized before its tree is read: the budget at
    first, then what the previous step's widest tree kept, or twice the width after a tree that filled it
    (loop.auto_width); every tree fits its pass, and the output is the target's own greedy output."""
    assert (loop.auto_width(16, 3, 16), loop.auto_width(3, 3, 16), loop.auto_width(12, 12, 16),
            loop.auto_width(4, 0, 16)) == (3, 6, 16, 1)
    config = GenerationConfig(max_new_tokens=40, num_draft_tokens=4, tree="auto")
    plain = row_outputs(list(decode(eagle3_target, tiny_tok, PROMPTS[:2], GenerationConfig(max_new_tokens=40))), 2)
    costs = {n: 1.0 + 0.1 * n for n in range(1, 17)}
    *_, outputs, _, events = run(eagle3_target, tiny_tok, head, PROMPTS[:2], config, "always", pass_costs=costs,
                                 one_read="always")
    assert outputs == plain
    steps = [(e.width - 1, max(len(s.drafted) for s in e.steps)) for e in events if e.kind == "spec" and e.k > 0]
    assert steps[0][0] == 16 and all(kept <= nodes for nodes, kept in steps)
    assert all(after == loop.auto_width(nodes, kept, 16) for (nodes, kept), (after, _) in zip(steps, steps[1:]))
    widths = [nodes for nodes, _ in steps]
    assert min(widths) < 16 and any(b > a for a, b in zip(widths, widths[1:]))  # it narrows, and widens again


def test_device_trees_grow_nothing_after_an_end_of_sequence(eagle3_target, tiny_tok, head, monkeypatch):
    """With the head's favourite token made the end of sequence, the device's trees are still eagle3_tree's: a node
    that ends the sequence is not fed, so it has no children."""
    config = GenerationConfig(max_new_tokens=32, num_draft_tokens=4, tree="8")
    drafted = Counter(t for d, _ in run(eagle3_target, tiny_tok, head, PROMPTS, config, "never")[0] for t in d)
    eos = drafted.most_common(1)[0][0]
    monkeypatch.setattr(eagle3_target.generation_config, "eos_token_id", eos)
    host = run(eagle3_target, tiny_tok, head, PROMPTS, config, "never")
    device = run(eagle3_target, tiny_tok, head, PROMPTS, config, "always")
    assert device[0] == host[0] and device[2] == host[2]
    assert sum(eos in d[:-1] for d, _ in host[0]) > 3  # drafted before other nodes: leaves of its own


@pytest.mark.parametrize("costs", [None, {n: 1.0 + 0.05 * n for n in range(1, 17)}])
def test_the_growth_cut_and_layout_compile_whole(head, costs):
    """torch.compile(fullgraph=True) traces a 3-deep tree's growth, its cut (a node budget, and --tree auto's cost
    cut) and its layout for the target's pass (eagle3_device_tree.grow, what one CUDA graph holds) over the head's
    static buffers without a graph break, so none of it reads the device; compiled, it gives the eager tensors."""
    from test_eagle3_static import _one_step_ready

    attach(head, "on")
    torch._dynamo.reset()
    try:
        with torch.inference_mode():
            kv = _one_step_ready(head)
            request = DraftRequest([[1, 2, 3]] * 2, [3, 2], SamplingConfig(), [None, None], frozenset({5}), [8, 6],
                                   costs, 0.7)
            inputs = eagle3_device_tree.tree_inputs(request, kv.storage.feature[:2].clone())
            kv.reserve(2 * eagle3_device_tree.FRONTIER)
            eager = eagle3_device_tree.grow(head, kv.storage, inputs, 3, 0.3)
            compiled = torch.compile(lambda: eagle3_device_tree.grow(head, kv.storage, inputs, 3, 0.3),
                                     fullgraph=True, backend="aot_eager")()
        kv.release()
    finally:
        torch._dynamo.reset()
        graphs.detach(head)
    assert len(eager) == len(eagle3_device_tree.OUT)
    for a, b in zip(compiled, eager):
        assert a.shape == b.shape and torch.allclose(a.double(), b.double(), atol=1e-6)
    kept = eager[2].sum(1).tolist()
    assert 1 <= kept[0] <= 8 and 1 <= kept[1] <= 6  # each row's budget


@pytest.mark.parametrize("rows", [1, 4])
def test_trees_without_a_layout_are_verified_the_same(eagle3_target, tiny_tok, head, rows, monkeypatch):
    """A drafter's DeviceTrees may bring only tokens, parents, q, values and keep (`batch` and `fields` are optional
    in the seam): verified on the device, the engine then builds the layout and the read table itself
    (device_step.verify_trees_on_device), and the run is the one with them, step for step: the same trees, q and
    output, the target's own greedy output."""
    config = GenerationConfig(max_new_tokens=32, num_draft_tokens=3, tree="8")
    full = run(eagle3_target, tiny_tok, head, PROMPTS[:rows], config, "always", one_read="always")
    propose, stripped = Eagle3Drafter.propose_on_device, []

    def bare(self, request):
        out = propose(self, request)
        if isinstance(out, DeviceTrees):
            stripped.append(out.batch is not None and out.fields is not None)
            out = dataclasses.replace(out, batch=None, fields=None)
        return out

    monkeypatch.setattr(Eagle3Drafter, "propose_on_device", bare)
    fallback = run(eagle3_target, tiny_tok, head, PROMPTS[:rows], config, "always", one_read="always")
    assert len(stripped) > 5 and all(stripped)
    assert fallback[0] == full[0] and fallback[2] == full[2]
    flat = [[p for step in q if step for p in step] for q in (fallback[1], full[1])]
    assert flat[0] and flat[0] == pytest.approx(flat[1], abs=1e-6)
    plain = row_outputs(list(decode(eagle3_target, tiny_tok, PROMPTS[:rows], GenerationConfig(max_new_tokens=32))),
                        rows)
    assert fallback[2] == plain
    assert any(p != list(range(-1, len(p) - 1)) for _, p in fallback[0])  # trees that branch
