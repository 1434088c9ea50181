"""Suffix decoding: the trees' counts against brute force, the draft rule, the cache's ownership (eviction, clear,
pause) and each draft's source; the cost-aware cut (what it keeps, what it learns); losslessness on the real bundled
model, cost-aware too, built through the registry as the CLI builds it."""

import random

import pytest

from specdemo.config import VLLM_SUFFIX, GenerationConfig, SamplingConfig, SuffixConfig
from specdemo.drafters import DraftRequest, Verdict
from specdemo.drafters.base import SharedState
from specdemo.drafters.draft_value import DraftValue
from specdemo.drafters.registry import BuildOptions, get
from specdemo.drafters.suffix import (
    SuffixCache,
    SuffixDrafter,
    SuffixTree,
)
from specdemo.engine import autoregressive, encode_prompt, generated_ids, speculative
from specdemo.engine.timing import nondecreasing


def occurrences(seqs, s, depth):
    """How often s occurs in the sequences (as the tree counts: substrings of at most `depth` tokens)."""
    n = len(s)
    return sum(1 for q in seqs for i in range(len(q) - n + 1) if q[i : i + n] == s) if n <= depth else 0


def node_of(tree, s):
    node = tree.root
    for t in s:
        node = (node.children or {}).get(t)
        if node is None:
            return None
    return node


def check_counts(tree, seqs, depth, rng):
    """Every node's count is its substring's occurrences, and every order list is sorted by count, descending."""
    stack = [(tree.root, [])]
    while stack:
        node, s = stack.pop()
        if s:
            assert node.count == occurrences(seqs, s, depth), s
        if node.order is not None and node is not tree.root:
            counts = [c.count for c in node.order]
            assert counts == sorted(counts, reverse=True)
            assert {c.token for c in node.order} == set(node.children)
        stack += [(c, s + [t]) for t, c in (node.children or {}).items()]
    for _ in range(200):  # and substrings that are absent have no node
        q = rng.choice(seqs)
        i = rng.randrange(len(q))
        s = q[i : i + rng.randrange(1, depth + 3)] + [rng.randrange(4)]
        found = node_of(tree, s)
        assert (found.count if found else 0) == occurrences(seqs, s, depth)


def test_tree_counts_equal_brute_force_through_appends_and_removals():
    rng = random.Random(0)
    depth = 5
    tree = SuffixTree(depth)
    seqs = {i: [rng.randrange(4) for _ in range(rng.randrange(5, 40))] for i in range(6)}
    for i, q in seqs.items():  # appended in pieces, interleaved
        tree.extend(i, q[:3])
    for i, q in seqs.items():
        tree.extend(i, q[3:])
    check_counts(tree, list(seqs.values()), depth, rng)
    for i in (2, 0, 5):
        tree.remove(i)
        del seqs[i]
        check_counts(tree, list(seqs.values()), depth, rng)


def test_the_draft_follows_the_most_frequent_child_within_the_limits():
    """Each drafted token is a most frequent continuation; its probability is the product of count ratios; the draft
    stops at max_spec_factor x the match, at k and below min_token_prob; the best score over match lengths wins."""
    rng = random.Random(1)
    config = SuffixConfig(max_tree_depth=8, max_spec_factor=1.5, min_token_prob=0.2)
    for trial in range(40):
        seq = [rng.randrange(3) for _ in range(60)]
        tree = SuffixTree(config.max_tree_depth)
        tree.extend(0, seq)
        k = rng.randrange(1, 10)
        d = tree.speculate(seq, k, config)
        if not d.tokens:
            continue
        assert len(d.tokens) <= min(k, int(d.match_len * 1.5))
        s, prob = seq[-d.match_len :], 1.0
        for t, p in zip(d.tokens, d.probs):
            top = max(occurrences([seq], s + [c], 8) for c in range(3))
            assert occurrences([seq], s + [t], 8) == top
            prob *= top / occurrences([seq], s, 8)
            assert p == pytest.approx(prob) and p >= 0.2
            s = s + [t]
        assert d.score == pytest.approx(sum(d.probs))
        for m in range(1, len(seq[-8:])):  # no other match length scores higher
            node = node_of(tree, seq[len(seq) - m :])
            if node is None:
                break
            assert tree.speculate(seq, k, SuffixConfig(8, 0, 1.5, 0.2), min_match=m).score <= d.score + 1e-9


def test_ties_go_to_the_child_that_drew_level_last_as_in_arctic():
    """x A x A x B x B x: A and B both follow x twice; B drew level last, so it leads (arctic's sibling order)."""
    x, a, b = 1, 2, 3
    tree = SuffixTree(4)
    tree.extend(0, [x, a, x, a, x, b, x, b, x])
    assert tree.speculate([x], 4, SuffixConfig(), min_match=1).tokens == []  # m < len(context): never the whole context
    assert tree.speculate([7, x], 1, SuffixConfig()).tokens == [b]


def request(ids, k=8, eos=frozenset()):
    return DraftRequest([ids], [k], SamplingConfig(), [None], eos)


def test_each_draft_says_where_it_came_from():
    """'prompt' when the drafted text last occurred in the prompt, 'answer' in this answer, 'earlier' from an earlier
    answer in the cache, which a second drafter on the same cache sees and a drafter on another cache does not."""
    cache = SuffixCache()
    drafter = SuffixDrafter(cache, VLLM_SUFFIX)  # vLLM's defaults: a match of m tokens drafts at most m
    prompt = [20, 21, 1, 2, 3, 4, 5, 6, 22]
    drafter.begin([prompt])
    first = drafter.propose(request(prompt + [1, 2, 3]))[0]
    assert (first.tokens, first.source) == ([4, 5, 6], "prompt")
    answer = [1, 2, 3, 4, 5, 6, 30, 31, 32, 33, 40, 30, 31, 32]
    drafter.update([Verdict(3, prompt + answer)])
    own = drafter.propose(request(prompt + answer))[0]
    assert (own.tokens, own.source) == ([33, 40, 30], "answer")
    assert len(cache) == 1

    other = SuffixDrafter(SuffixCache(), VLLM_SUFFIX)  # another owner: another visitor's cache
    later = SuffixDrafter(cache, VLLM_SUFFIX)
    for d in (other, later):
        d.begin([[50, 51]])  # publishes the first answer into `cache`
    ids = [50, 51, 31, 32, 33]
    assert other.propose(request(ids))[0].tokens == []
    seen = later.propose(request(ids))[0]
    assert (seen.tokens, seen.source) == ([40, 30, 31], "earlier")

    cache.clear()
    assert len(cache) == 0 and later.propose(request(ids))[0].tokens == []


def test_the_cache_evicts_the_oldest_answer_first():
    """As arctic counts them: the request being served holds one of the max_cached_requests places."""
    cache = SuffixCache(max_tree_depth=8, max_cached_requests=3)
    drafter = SuffixDrafter(cache, SuffixConfig(8, 3))
    for answer in ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]):
        drafter.begin([[0]])
        drafter.update([Verdict(0, [0] + answer)])
    drafter.begin([[0]])  # the third answer is published; two earlier ones and this one are kept
    assert len(cache) == 3
    assert drafter.propose(request([0, 1, 2]))[0].tokens == []  # the first: evicted
    assert drafter.propose(request([0, 5, 6]))[0].tokens == [7, 8]
    assert drafter.propose(request([0, 9, 10]))[0].tokens == [11, 12]


def test_a_paused_drafter_keeps_no_answer_and_none_is_kept_past_an_eos():
    """Drafter.paused: requests inside leave no answer in the shared cache; forget() empties it; no answer goes
    past an EOS."""
    shared = SharedState()
    cache = SuffixCache.of(shared, VLLM_SUFFIX)
    drafter = SuffixDrafter(cache, VLLM_SUFFIX)
    with drafter.paused():
        drafter.begin([[0]])
        drafter.update([Verdict(0, [0, 1, 2, 3])])
    drafter.begin([[0]])
    assert len(cache) == 1 and shared.find("suffix") is cache and len(shared) == 1  # the request just begun
    assert SuffixCache.of(shared, VLLM_SUFFIX) is cache and SuffixCache.of(None, VLLM_SUFFIX) is None
    drafter.propose(request([0, 5], eos=frozenset([9])))
    drafter.update([Verdict(0, [0, 5, 6, 9, 7, 8])])  # tokens after the EOS are no part of the answer
    drafter.begin([[0]])
    assert drafter.propose(request([0, 5, 6, 9], eos=frozenset([9])))[0].tokens == []
    assert drafter.propose(request([0, 5], eos=frozenset([9])))[0].tokens == [6]  # max_spec_factor 1: 1 per match
    assert drafter.propose(request([4, 5, 6], eos=frozenset([9])))[0].tokens == [9]  # a draft ends at an EOS
    drafter.forget()  # a cold start: no earlier answer left to draft from
    drafter.begin([[0]])
    assert len(cache) == 1 and drafter.propose(request([0, 5], eos=frozenset([9])))[0].tokens == []


def test_options_are_checked_with_vllms_names():
    with pytest.raises(ValueError, match="suffix_decoding_min_token_prob=2"):
        SuffixDrafter(config=SuffixConfig(min_token_prob=2))
    assert VLLM_SUFFIX.vllm_options() == {  # vLLM's defaults; ours differ where measured (config.DRAFTER_DEFAULTS)
        "suffix_decoding_max_tree_depth": 24, "suffix_decoding_max_cached_requests": 10000,
        "suffix_decoding_max_spec_factor": 1.0, "suffix_decoding_min_token_prob": 0.1}
    assert SuffixConfig().as_dict() == {**VLLM_SUFFIX.vllm_options(), "suffix_decoding_max_spec_factor": 2.0,
                                        "cost_aware": True}


def test_the_cost_aware_cut_keeps_the_length_its_estimated_acceptance_pays_for():
    """Expected tokens per unit of pass cost decide the length: with no evidence a token's estimate is its frequency
    ratio; evidence of rejections moves it down, and then nothing is worth a wider pass."""
    costs = {1: 1.1, 2: 1.2, 3: 1.3, 4: 2.5}
    value = DraftValue()
    kinds = DraftValue.kinds("earlier", 3, [1.0, 1.0, 1.0, 1.0])
    assert value.length(kinds, [1.0] * 4, costs) == 3  # (1 + 3) / 1.3 beats 2 / 1.1, 3 / 1.2 and 5 / 2.5
    assert value.length(kinds[:1], [0.05], costs) == 0  # (1 + 0.05) / 1.1 < 1: a 1-token pass is worth more
    for _ in range(40):  # the first token of such drafts is always rejected
        value.record(kinds, 0)
    assert value.counts[kinds[0]] == [0, 40] and kinds[1] not in value.counts  # only the first was tried
    assert value.length(kinds, [1.0] * 4, costs) == 0  # estimate (0 + 4) / 44 for the first token
    value.record(kinds, 2)  # two accepted, the third rejected, the fourth never tried
    assert value.counts[kinds[0]] == [1, 41] and value.counts[kinds[1]] == [1, 1] and value.counts[kinds[2]] == [0, 1]


def test_pass_costs_are_made_nondecreasing_by_pooling_the_dips():
    assert nondecreasing([1.0, 1.2, 1.1, 1.3]) == pytest.approx([1.0, 1.15, 1.15, 1.3])
    assert nondecreasing([1.3, 1.1, 1.0, 1.6]) == pytest.approx([3.4 / 3] * 3 + [1.6])
    assert nondecreasing([1.0, 1.1]) == [1.0, 1.1]


def test_a_cost_aware_drafter_cuts_drafts_its_cache_learned_are_rejected():
    """The drafter records each draft's outcome in its cache's DraftValue and drafts less once its drafts of a kind
    keep failing; what it keeps is a prefix of what vLLM's rule drafts."""
    prompt = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2]
    costs = {n: 1.0 + 0.1 * n for n in range(1, 9)}
    cache = SuffixCache()
    drafter = SuffixDrafter(cache, SuffixConfig(max_spec_factor=2.0), pass_costs=costs)
    plain = SuffixDrafter(SuffixCache(), SuffixConfig(max_spec_factor=2.0))
    request = DraftRequest([prompt], [8], SamplingConfig(), [None], frozenset())
    drafter.begin([prompt])
    plain.begin([prompt])
    first, full = drafter.propose(request)[0].tokens, plain.propose(request)[0].tokens
    assert full[:3] == [3, 4, 5] and first and full[: len(first)] == first
    drafts = []
    for _ in range(3 * DraftValue.EXPLORE):  # the target rejects every draft, committing its own token 9 instead
        drafter.update([Verdict(0, list(prompt))])
        drafts.append(drafter.propose(request)[0].tokens)
    tried = sum(t for _, t in cache.value.counts.values())
    assert all(a == 0 for a, _ in cache.value.counts.values())
    # it stopped drafting on the way, and tries its first token again every EXPLORE-th time the cut stops before it
    assert drafts[-DraftValue.EXPLORE:].count([]) == DraftValue.EXPLORE - 1 and tried < 20
    assert all(d == full[:1] for d in drafts[DraftValue.EXPLORE:] if d)
    cache.clear()
    assert cache.value.counts == {} and cache.value.cut == {}


def test_a_kind_the_cut_stopped_is_tried_again_and_kept_once_the_target_takes_it():
    """Every EXPLORE-th time the cut stops before a kind, it keeps that token too; once the target accepts such
    tokens, their estimate rises and the cut keeps them without exploring."""
    costs = {1: 1.1, 2: 1.2}
    value = DraftValue()
    kinds = DraftValue.kinds("earlier", 3, [1.0])
    for _ in range(40):
        value.record(kinds, 0)
    lengths = [value.length(kinds, [1.0], costs) for _ in range(2 * DraftValue.EXPLORE)]
    assert lengths.count(1) == 2 and lengths[DraftValue.EXPLORE - 1] == lengths[-1] == 1
    for _ in range(60):  # the workload changed: the target takes them now
        value.record(kinds, 1)
    assert [value.length(kinds, [1.0], costs) for _ in range(5)] == [1] * 5


REQUESTS = ("Convert to JSON: name=Ann, age=31, city=Oslo.", "Convert to JSON: name=Bob, age=45, city=Rome.")


@pytest.fixture(scope="module")
def related(bundled):
    """Two related requests on the bundled model: each one's ids and the target's own 40 greedy tokens."""
    config = GenerationConfig(max_new_tokens=40)
    out = []
    for prompt in REQUESTS:
        ids = encode_prompt(bundled.tokenizer, prompt)
        out.append((ids, generated_ids(list(autoregressive(bundled.model, bundled.tokenizer, ids, config)))))
    return out


def suffix_steps(bundled, drafter, related, k: int) -> list:
    """The requests decoded in order by one drafter (its cache carried across them); asserts each output is the
    target's own; the spec steps."""
    config = GenerationConfig(max_new_tokens=40, num_draft_tokens=k)
    steps = []
    for ids, ar in related:
        events = list(speculative(bundled.model, bundled.tokenizer, drafter, ids, config))
        assert generated_ids(events) == ar
        steps += [e for e in events if e.kind == "spec"]
    return steps


@pytest.mark.slow
def test_suffix_is_lossless_on_the_bundled_model_with_a_warm_cache(bundled, related):
    """Greedy suffix decoding is the target's output on the real model; the second request drafts from the first."""
    sources = {e.draft_source for e in suffix_steps(bundled, SuffixDrafter(), related, 8) if e.drafted}
    assert "earlier" in sources and sources <= {"prompt", "answer", "earlier"}


@pytest.mark.slow
def test_cost_aware_suffix_from_the_registry_is_lossless_on_the_bundled_model(bundled, related):
    """--drafter suffix --suffix-cost-aware as the CLI builds it: pass costs timed on the target at load (a wider
    pass costs at least a little more), then greedy output equal to the target's own, with drafts of several
    lengths."""
    options = BuildOptions(drafter_options={"suffix": SuffixConfig(cost_aware=True)})
    drafter, _, _ = get("suffix").factory(bundled, None, options)
    costs = drafter.pass_costs
    assert set(costs) == set(range(1, 17)) and all(costs[n] <= costs[n + 1] for n in range(1, 16))
    lengths = {len(e.drafted) for e in suffix_steps(bundled, drafter, related, 16)}
    assert len(lengths) > 1 and sum(t for _, t in drafter.cache.value.counts.values()) > 0
