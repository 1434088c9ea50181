"""Draft trees in the one engine, on tiny random llamas under the eager engine and the static runner (uncaptured on
the CPU): greedy output equal to the target's own for every tree drafter, budget and batch size, trees accepted off
their first branch, the caches holding exactly a fresh prefill of the committed ids after tree steps, the sampled
distribution kept, chains unchanged with --tree off and under block verification, auto falling back to the chain
where no branch pays; and the real bundled model's greedy output with trees."""

import pytest
import torch
from conftest import sampled_second_tokens, second_token_distribution

from specdemo.config import GenerationConfig, SamplingConfig, SuffixConfig
from specdemo.drafters import HybridDrafter, ModelDrafter, NgramDrafter, SuffixCache, SuffixDrafter
from specdemo.engine import decode, graphs, row_outputs
from specdemo.engine import static as static_kv
from specdemo.engine.kv import BatchKV, with_cache
from specdemo.engine.loop import tree_plan
from specdemo.measure.metrics import tree_steps, tree_summary

# contexts that often end in a token with several earlier continuations on the tiny target (found by a search)
PROMPTS = [[4, 2, 8, 7, 5, 4, 11, 1, 13, 4, 10, 3, 2, 4, 8, 7, 6, 9, 14, 3, 2, 10, 8, 3, 10, 7, 11],
           [14, 5, 3, 11, 9, 14, 11, 11, 6],
           [12, 15, 13, 6, 2, 6, 10, 2, 8, 10, 11, 6, 14, 4, 4, 1, 12, 5, 2, 12, 4, 6, 13, 3, 6, 7],
           [2, 5, 7, 14, 6, 5, 7, 2, 2, 9, 15, 8, 8, 6, 14, 13, 13, 6, 2, 8, 2, 12, 8, 7, 1, 5, 6, 12, 11]]
FLAT = {n: 1.0 + 0.01 * n for n in range(1, 17)}  # a GPU's pass costs: a wider pass costs about nothing more
STEEP = {n: 2.0**n for n in range(1, 17)}  # each node doubles a pass's cost: no branch can pay
KINDS = ["ngram", "suffix", "hybrid", "hybrid-suffix"]
SUFFIX = SuffixConfig(max_spec_factor=4)  # a match of m tokens drafts up to 4m nodes: room for branches


def make(kind: str, draft, costs=FLAT):
    """A tree drafter with these pass costs (a fresh suffix cache each: runs do not depend on test order)."""
    if kind == "ngram":
        return NgramDrafter(pass_costs=costs)
    if kind == "suffix":
        return SuffixDrafter(SuffixCache(), SUFFIX, pass_costs=costs, cost_aware=False)
    lookup = SuffixDrafter(SuffixCache(), SUFFIX, min_match=2) if kind == "hybrid-suffix" else None
    return HybridDrafter(ModelDrafter(draft), min_match=2, lookup=lookup, pass_costs=costs)


@pytest.fixture(params=["eager", "static"])
def runner(request, tiny_target, tiny_draft):
    """The eager engine, or the static runner (uncaptured on the CPU) serving the tiny target and draft."""
    if request.param == "static":
        assert graphs.attach(tiny_target, "on") is not None and graphs.attach(tiny_draft, "on") is not None
    yield request.param
    graphs.detach(tiny_target)
    graphs.detach(tiny_draft)


def spec_steps(events):
    return [s for e in events if e.kind == "spec" for s in e.steps]


def is_path(parents: list[int], path: list[int]) -> bool:
    """path runs from a child of the root down, each node a child of the one before."""
    return all(parents[j] == (path[i - 1] if i else -1) for i, j in enumerate(path))


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("tree", ["2", "8", "auto"])
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_trees_are_the_targets_own_tokens(runner, tiny_target, tiny_draft, tiny_tok, kind, tree, rows):
    """Every tree drafter at budgets 2, 8 and auto (flat costs), B = 1 and 4, eager and static: the target's own
    greedy tokens; each tree within its budget and k, its accepted path a path of it whose tokens were committed."""
    prompts = PROMPTS[:rows]
    config = GenerationConfig(max_new_tokens=40, num_draft_tokens=4, tree=tree)
    events = list(decode(tiny_target, tiny_tok, prompts, config, make(kind, tiny_draft)))
    assert row_outputs(events, rows) == row_outputs(list(decode(tiny_target, tiny_tok, prompts, config)), rows)
    trees = [s for s in spec_steps(events) if s.parents is not None]
    budget = 16 if tree == "auto" else int(tree)
    for s in trees:
        assert len(s.drafted) <= budget and max(len(_ancestry(s.parents, j)) for j in range(len(s.parents))) <= 4
        assert is_path(s.parents, s.accepted_path) and s.num_accepted == len(s.accepted_path)
        assert s.tokens[: s.num_accepted] == s.accepted[: len(s.tokens)]
        assert len(s.rejected) == len(s.drafted) - s.num_accepted
    if tree != "2":
        assert trees


def _ancestry(parents: list[int], j: int) -> list[int]:
    out = []
    while j >= 0:
        out.append(j)
        j = parents[j]
    return out


def test_a_tree_is_accepted_off_its_first_branch(runner, tiny_target, tiny_draft, tiny_tok):
    """Prompt lookup's trees at B = 4: some steps keep a branch other than the chain's (where the chain alone would
    have kept nothing there), and the output is still the target's own."""
    config = GenerationConfig(max_new_tokens=40, num_draft_tokens=4, tree="8")
    events = list(decode(tiny_target, tiny_tok, PROMPTS, config, make("ngram", tiny_draft)))
    assert row_outputs(events, 4) == row_outputs(list(decode(tiny_target, tiny_tok, PROMPTS, config)), 4)
    off_first = [s for s in spec_steps(events) if s.accepted_path and s.accepted_path[0] != s.parents.index(-1)]
    assert off_first


def _fresh(model, ids):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids], device=model.device), **with_cache(model, cache), use_cache=True)
    return cache


def _row_layers(kv, r: int, n: int):
    """Row r's first n positions, (keys, values) (H, n, D) per layer: a BatchKV's valid slots in storage order, a
    StaticKV's first n slots."""
    if isinstance(kv, BatchKV):
        valid = kv.slots.valid[r]
        return [(layer.keys[r][:, valid], layer.values[r][:, valid]) for layer in kv.cache.layers]
    return [(layer.keys[r, :, :n], layer.values[r, :, :n]) for layer in kv.storage.cache.layers]


@pytest.mark.parametrize("kind", ["ngram", "hybrid"])
def test_caches_hold_a_fresh_prefill_after_tree_steps(runner, tiny_target, tiny_draft, tiny_tok, monkeypatch, kind):
    """Four rows of trees: after each step each row of the target's cache holds exactly a fresh single-sequence
    prefill of its committed ids (the pending token aside), dropped nodes gone (holes or overwritten); the hybrid's
    draft holds a prefix of them, whichever branch was taken."""
    made = []
    new_kv = graphs.new_kv
    monkeypatch.setattr(graphs, "new_kv", lambda *a, **kw: made.append(new_kv(*a, **kw)) or made[-1])
    config = GenerationConfig(max_new_tokens=24, num_draft_tokens=4, tree="8")
    ids = {i: list(p) for i, p in enumerate(PROMPTS)}
    trees = 0
    for event in decode(tiny_target, tiny_tok, PROMPTS, config, make(kind, tiny_draft)):
        for i, t in zip(event.rows, event.tokens):
            ids[i] += t
        if event.kind != "spec" or event.finished:
            continue
        trees += sum(s.parents is not None for s in event.steps)
        caches = [(made[0], tiny_target, lambda r, i: len(ids[i]) - 1)]
        if kind == "hybrid":
            caches.append((made[1], tiny_draft, lambda r, i: made[1].counts[r]))
        for kv, model, upto in caches:
            for r, i in enumerate(event.rows):
                n = upto(r, i)
                assert kv.counts[r] == n <= len(ids[i]) - 1
                for (keys, values), ref in zip(_row_layers(kv, r, n), _fresh(model, ids[i][:n]).layers):
                    assert torch.allclose(keys, ref.keys[0], atol=1e-5)
                    assert torch.allclose(values, ref.values[0], atol=1e-5)
    assert trees > 0


@pytest.mark.parametrize("kind", ["ngram", "suffix", "hybrid"])
def test_sampled_trees_keep_the_targets_distribution(runner, tiny_target, tiny_draft, tiny_tok, kind):
    """Sampling over trees (recursive rejection sampling; the hybrid's mixes the draft's q rows with one-hot lookup
    branches) draws the second token from the target's distribution (TV < 0.06 over 2,000 seeded rows, as the chain
    test), and the first speculative steps did verify trees. Every token follows the prompt twice, each time by
    another, so every context has branches."""
    prompt = list(range(1, 16)) + list(range(15, 0, -1))
    expected = second_token_distribution(tiny_target, prompt)
    config = GenerationConfig(max_new_tokens=3, num_draft_tokens=2, sampling=SamplingConfig(1.0), tree="8")
    trials = 2000
    counts, proposals = sampled_second_tokens(tiny_target, tiny_tok, lambda: make(kind, tiny_draft), prompt, config,
                                              trials)
    empirical = counts / counts.sum()
    assert counts.sum() > 0.9 * trials and proposals > trials // 4
    assert 0.5 * float((empirical - expected).abs().sum()) < 0.06
    events = list(decode(tiny_target, tiny_tok, [prompt] * 40, config, make(kind, tiny_draft)))
    assert tree_steps([s for e in events for s in e.steps])[0] > 10


class Asked(NgramDrafter):
    """Prompt lookup that records each request's node budgets."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.asked = []

    def propose(self, request):
        self.asked.append((list(request.tree_nodes), request.tree_costs))
        return super().propose(request)


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(1.0, verification="block")],
                         ids=["off", "block"])
def test_tree_off_and_block_verification_draft_todays_chains(runner, tiny_target, tiny_draft, tiny_tok, monkeypatch,
                                                             sampling):
    """--tree off (and block verification, which judges chains only, under any --tree): every request asks for
    chains, every step drafts NgramDrafter.lookup's chain for its context, no step is a tree, and the static cache
    copies nothing; with trees on it copies accepted paths down."""
    moves = []
    move = static_kv._move_slots
    monkeypatch.setattr(static_kv, "_move_slots", lambda *a: moves.append(1) or move(*a))
    tree = "off" if sampling.greedy else "8"
    config = GenerationConfig(max_new_tokens=40, num_draft_tokens=4, sampling=sampling, tree=tree)
    drafter = Asked(pass_costs=FLAT)
    ids = {i: list(p) for i, p in enumerate(PROMPTS)}
    chains = 0
    for event in decode(tiny_target, tiny_tok, PROMPTS, config, drafter):
        for i, s in zip(event.rows, event.steps):
            if event.kind == "spec":
                assert s.parents is None and s.drafted == NgramDrafter().lookup(ids[i], s.k, frozenset({0}))
                chains += bool(s.drafted)
            ids[i] += s.tokens
    assert chains and all(not any(n) and costs is None for n, costs in drafter.asked) and not moves
    if runner == "static" and sampling.greedy:
        list(decode(tiny_target, tiny_tok, PROMPTS, GenerationConfig(max_new_tokens=40, tree="8"), Asked()))
        assert moves


def test_auto_adds_branches_only_where_they_pay(runner, tiny_target, tiny_draft, tiny_tok, load_time_costs):
    """--tree auto: with a GPU's flat pass costs prompt lookup verifies trees; where every node costs a whole pass it
    drafts the chain alone (the drafts of --tree off, step for step) and the result says auto fell back to chains.
    (The load-time costs alone: the run's own steps would correct them, test_step_costs.)"""
    config = GenerationConfig(max_new_tokens=40, num_draft_tokens=4)
    off = list(decode(tiny_target, tiny_tok, PROMPTS, GenerationConfig(max_new_tokens=40, tree="off"),
                      make("ngram", tiny_draft)))
    runs = {}
    for name, costs in (("flat", FLAT), ("steep", STEEP)):
        drafter = make("ngram", tiny_draft, costs)
        events = list(decode(tiny_target, tiny_tok, PROMPTS, config, drafter))
        assert row_outputs(events, 4) == row_outputs(off, 4)
        steps = tree_steps([s for e in events for s in e.steps])
        runs[name] = (events, tree_summary(tree_plan(config, drafter), *steps, costs, 4))
    assert runs["flat"][1]["tree_steps"] > 0 and runs["flat"][1]["by_cost"]
    steep, summary = runs["steep"]
    assert summary["tree_steps"] == 0 and summary["note"].startswith("auto fell back to chains")
    assert "a 6-token pass costs 32.00x" in summary["note"]
    assert [s.drafted for s in spec_steps(steep)] == [s.drafted for s in spec_steps(off)]


@pytest.mark.parametrize("static", [False, True], ids=["eager-engine", "static"])
def test_trees_under_eager_attention(tiny_tok, static):
    """A target that attends with transformers' eager attention (an additive float mask, not sdpa's bool one): its
    greedy tokens with prompt lookup's trees at B = 4, under both caches."""
    from conftest import WORDS, tiny_llama

    model = tiny_llama(len(WORDS) + 1, seed=1, sharpness=8.0)
    model.set_attn_implementation("eager")
    if static:
        assert graphs.attach(model, "on") is not None
    config = GenerationConfig(max_new_tokens=32, num_draft_tokens=4, tree="8")
    events = list(decode(model, tiny_tok, PROMPTS, config, NgramDrafter()))
    assert row_outputs(events, 4) == row_outputs(list(decode(model, tiny_tok, PROMPTS, config)), 4)
    assert tree_steps([s for e in events for s in e.steps])[0] > 0


def test_drafters_without_trees_and_plans_say_why(tiny_draft):
    """The plan in words: a chain drafter, --tree off, block verification and auto without pass costs give chains;
    --tree N its budget; auto the costs' widest pass (at most 32 nodes)."""
    greedy = GenerationConfig()
    assert tree_plan(greedy, ModelDrafter(tiny_draft)).nodes == 0
    assert tree_plan(GenerationConfig(tree="off"), NgramDrafter(pass_costs=FLAT)).why == "chains (--tree off)"
    block = GenerationConfig(sampling=SamplingConfig(1.0, verification="block"))
    assert "block verification" in tree_plan(block, NgramDrafter(pass_costs=FLAT)).why
    assert "no pass costs" in tree_plan(greedy, NgramDrafter()).why
    assert tree_plan(GenerationConfig(tree="5"), NgramDrafter()).nodes == 5
    plan = tree_plan(greedy, NgramDrafter(pass_costs={1: 1.0, 2: 1.0, 3: 1.1}))
    assert (plan.nodes, plan.by_cost) == (3, True)
    assert tree_plan(greedy, NgramDrafter(pass_costs={n: 1.0 for n in range(1, 65)})).nodes == 32
    with pytest.raises(ValueError, match="--tree"):
        GenerationConfig(tree="wide").validate()


def test_auto_considers_wider_trees_on_a_gpu(monkeypatch):
    """A target's pass costs are timed at load up to the widest tree --tree auto considers on its device (16 nodes on
    a CPU, 32 on a GPU, where wide passes cost about what narrow ones do), and auto's plan follows them."""
    from types import SimpleNamespace

    from specdemo.config import auto_tree_nodes
    from specdemo.drafters import registry
    from specdemo.engine import timing

    assert auto_tree_nodes("cpu") == 16 and auto_tree_nodes(torch.device("cuda", 0)) == auto_tree_nodes("cuda:1") == 32
    asked = []

    def timed(model, probe, k_max):
        asked.append(k_max)
        return {n: 1.0 + 0.01 * n for n in range(1, k_max + 1)}

    monkeypatch.setattr(timing, "load_time_verify_costs", timed)
    for device in ("cpu", "cuda"):
        target = SimpleNamespace(model=None, tokenizer=lambda text: {"input_ids": [1, 2]}, device=torch.device(device))
        plan = tree_plan(GenerationConfig(), NgramDrafter(pass_costs=registry.tree_pass_costs(target)))
        assert (plan.nodes, plan.by_cost) == (auto_tree_nodes(device), True)
    assert asked == [16, 32]


REAL_PROMPTS = ["List the colors red, green, blue, red, green, blue, and then list them again twice.",
                "Copy this line exactly three times: the cat sat on the mat, the dog sat on the log."]


@pytest.fixture(scope="module")
def real_ar(bundled):
    """The bundled target's own greedy output for each of REAL_PROMPTS: (prompt ids, output ids)."""
    from specdemo.engine import autoregressive, encode_prompt, generated_ids

    out = []
    for text in REAL_PROMPTS:
        ids = encode_prompt(bundled.tokenizer, text)
        out.append((ids, generated_ids(list(autoregressive(bundled.model, bundled.tokenizer, ids,
                                                           GenerationConfig(max_new_tokens=48))))))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ngram", "suffix", "hybrid", "model"])
def test_trees_keep_the_bundled_models_greedy_output(bundled, real_ar, kind):
    """The real SmolLM2-135M with its drafters as the CLI builds them (pass costs timed at load; the trained EAGLE-3
    draft alone, its dynamic trees, and in the hybrid), --tree 8 on one prompt and auto on the other: every output
    token for token the target's own, and trees verified."""
    from specdemo.drafters.registry import BuildOptions, get
    from specdemo.engine import generated_ids, speculative

    drafter = get(kind).factory(bundled, None, BuildOptions(speculative=speculative))[0]
    trees = 0
    for (ids, ar), tree in zip(real_ar, ("8", "auto")):
        config = GenerationConfig(max_new_tokens=48, num_draft_tokens=4, tree=tree)
        events = list(speculative(bundled.model, bundled.tokenizer, drafter, ids, config, inspect=False))
        assert generated_ids(events) == ar
        trees += tree_steps(events)[0]
    assert trees > 0


def test_a_trimmed_tree_keeps_each_kept_nodes_own_q():
    """A tree cut by depth keeps a non-prefix set of nodes; the q the inspector shows for each, and the value the
    engine weighs its branches by, is that node's own."""
    from specdemo.drafters.base import Proposal
    from specdemo.engine.loop import _as_verified

    p = Proposal([5, 6, 7, 8], parents=[-1, 0, -1, 2], token_probs=[0.9, 0.8, 0.7, 0.6], values=[0.9, 0.7, 0.5, 0.3])
    tree, tokens, probs, q, values = _as_verified(p, k=1, nodes=4)  # depth 1 only: nodes 0 and 2
    assert tokens == [5, 7] and q == [0.9, 0.7] and probs is None and values == [0.9, 0.5]
    assert _as_verified(Proposal([5, 6, 7], token_probs=[0.9, 0.8, 0.7]), k=2, nodes=0)[3] == [0.9, 0.8]


def test_one_rows_path_moves_as_a_batchs_rows_do():
    """move_slots' one-row copy (index_select then index_copy_) moves what gather and scatter move for each row of a
    batch, reading before it writes (a slot both read and written)."""
    from specdemo.engine.kv import move_slots, path_moves

    buf = torch.randn(2, 3, 12, 4)
    src, dst = path_moves([5, 5], [[0, 2, 3], [0, 3, 1]], torch.device("cpu"))
    batch = buf.clone()
    move_slots(batch, src, dst)
    for r in range(2):
        row = buf[r : r + 1].clone()
        move_slots(row, src[r : r + 1], dst[r : r + 1])
        assert torch.equal(row[0], batch[r])
    assert torch.equal(batch[1, :, 6], buf[1, :, 8]) and torch.equal(batch[1, :, 7], buf[1, :, 6])
