"""Batched decoders on tiny random llamas: per-row losslessness and each row's proposals equal to its single-sequence
drafter's (an EAGLE-3 head's included), per-row KV rollback against fresh prefills, rows that finish early, auto k,
and the sampled distribution with several rows (also through an EAGLE-3 head's draft vocabulary)."""

import pytest
import torch
from conftest import case, drafter_cases, eagle3_drafter, second_token_distribution

from specdemo.config import GenerationConfig, SamplingConfig
from specdemo.drafters import ModelDrafter, NgramDrafter
from specdemo.engine import (
    GenerationError,
    autoregressive,
    decode,
    generated_ids,
    graphs,
    row_outputs,
    timing,
)
from specdemo.engine import kv as batch_kv
from specdemo.engine.kv import BatchKV, left_padded, with_cache
from specdemo.engine.verify import greedy_accept, greedy_accept_batch
from specdemo.measure.batch_sizes import AutoK
from specdemo.measure.metrics import batch_stats, best_k, expected_speedup

PROMPTS = [[3, 5, 7, 3, 5, 9, 2], [4, 4, 1], [9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 8], [2]]  # mixed lengths
NEAR_TIE = 1e-3  # top-2 logit gap below which a tiny fp32 model's batched numerics may pick the other token


def spec_batch(target, tok, drafter, prompts, config, k_policy=None):
    """engine.decode with a drafter."""
    return decode(target, tok, prompts, config, drafter, k_policy=k_policy)


def single(target, tok, prompts, config):
    return [generated_ids(list(autoregressive(target, tok, p, config))) for p in prompts]


def top2_gap(model, ids):
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids], device=model.device)).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def assert_lossless(model, prompts, expected, got):
    """Each row equals its single-sequence greedy output, or first differs where the target's top-2 gap is a tie."""
    for p, e, g in zip(prompts, expected, got):
        i = next((j for j, (x, y) in enumerate(zip(e, g)) if x != y), None)
        if i is None:
            assert len(e) == len(g), (p, e, g)
            continue
        gap = top2_gap(model, p + e[:i])
        assert gap < NEAR_TIE, f"row {p} differs at token {i} with a top-2 logit gap of {gap}"


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("case", drafter_cases(), ids=str)
def test_greedy_batch_equals_each_rows_single_sequence_output(tiny, tiny_tok, case, k):
    """Every row of a batched speculative run is that prompt's own greedy output, for every registered drafter kind
    and k."""
    target, drafter = case.build(tiny)
    config = GenerationConfig(max_new_tokens=40, num_draft_tokens=k)
    expected = single(target, tiny_tok, PROMPTS, config)
    events = list(spec_batch(target, tiny_tok, drafter, PROMPTS, config))
    assert_lossless(target, PROMPTS, expected, row_outputs(events, len(PROMPTS)))
    assert batch_stats(events).drafted > 0


@pytest.mark.parametrize("kind", ["ngram", "model", "hybrid", "eagle3", "eagle3-confident", "hybrid-eagle3"])
def test_each_row_drafts_what_its_single_sequence_drafter_drafts(tiny, tiny_tok, kind, load_time_costs):
    """Step by step, every row's proposal in the batch equals the proposal of the same drafter decoding that prompt
    alone: the batched draft state (KV slots, pending EAGLE features, the hybrid's catch-up) follows each row. (Trees
    under auto are sized by the load-time costs alone: the runs' own timings differ between B = 1 and 4.)"""
    from specdemo.engine import speculative

    target = case(kind.removesuffix("-confident")).build(tiny)[0]

    def fresh():
        d = case(kind.removesuffix("-confident")).build(tiny)[1]
        if kind.endswith("-confident"):
            d.min_confidence = 0.9  # stops early on unsure drafts, differently per row
        return d

    config = GenerationConfig(max_new_tokens=30, num_draft_tokens=4)
    alone = [[e.drafted for e in speculative(target, tiny_tok, fresh(), p, config) if e.kind == "spec"]
             for p in PROMPTS]
    together = [[] for _ in PROMPTS]
    for e in spec_batch(target, tiny_tok, fresh(), PROMPTS, config):
        for i, d in zip(e.rows, e.drafted if e.kind == "spec" else []):
            together[i].append(d)
    assert together == alone
    assert len({len(d) for row in alone for d in row}) > 1  # proposals of different lengths


def test_batched_autoregressive_equals_single_sequence(tiny_target, tiny_tok):
    config = GenerationConfig(max_new_tokens=30)
    events = list(decode(tiny_target, tiny_tok, PROMPTS, config))
    assert_lossless(tiny_target, PROMPTS, single(tiny_target, tiny_tok, PROMPTS, config),
                    row_outputs(events, len(PROMPTS)))
    assert all(len(e.tokens) == len(e.rows) and all(len(t) == 1 for t in e.tokens) for e in events)


def _fresh_kv(model, ids):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids], device=model.device), **with_cache(model, cache), use_cache=True)
    return cache


def _assert_rows_match_fresh_prefill(kv: BatchKV, model, sequences):
    """At its valid slots, each row's cache equals a fresh single-sequence prefill of its ids, position by position."""
    for r, ids in enumerate(sequences):
        assert kv.counts[r] == len(ids)
        fresh = _fresh_kv(model, ids)
        valid = kv.slots.valid[r]
        for layer in range(len(fresh.layers)):
            entry = kv.cache.layers[layer]
            keys, values = entry.keys[r][:, valid], entry.values[r][:, valid]
            assert torch.allclose(keys, fresh.layers[layer].keys[0], atol=1e-5)
            assert torch.allclose(values, fresh.layers[layer].values[0], atol=1e-5)


@pytest.mark.parametrize("room", [0, 1], ids=["dynamic", "preallocated"])  # 1: the buffers grow every few steps
@pytest.mark.parametrize("slack", [32, 0])  # 0: compaction after every step that leaves a hole
def test_ragged_rollback_leaves_each_row_a_fresh_prefill(tiny_target, tiny_draft, tiny_tok, monkeypatch, slack, room):
    """Rows accept different lengths in one step; after each rollback the target's and the draft's caches hold, at
    each row's valid positions, exactly a fresh prefill of that row's committed ids: in transformers' DynamicCache
    layers with sdpa, and in preallocated ones (rolled back, selected, compacted and grown in their buffers) with
    grouped one-token attention alike."""
    monkeypatch.setattr(batch_kv, "ROOM", room)
    monkeypatch.setattr(batch_kv, "PREALLOCATE_ROWS", 1)
    monkeypatch.setattr(batch_kv, "GROUPED_ROWS", 1 if room else 0)  # and one-token passes with grouped attention
    monkeypatch.setattr(batch_kv, "COMPACT_SLACK", slack)
    monkeypatch.setattr(batch_kv, "COMPACT_FRACTION", 0.5 if slack else 0.0)
    config = GenerationConfig(max_new_tokens=24, num_draft_tokens=4)
    drafter = ModelDrafter(tiny_draft)
    made = []  # the caches the run asks for: the target's first
    new_kv = graphs.new_kv
    monkeypatch.setattr(graphs, "new_kv", lambda *a, **kw: made.append(new_kv(*a, **kw)) or made[-1])
    ids = {i: list(p) for i, p in enumerate(PROMPTS)}
    ragged = holes = 0
    for event in spec_batch(tiny_target, tiny_tok, drafter, PROMPTS, config):
        for i, t in zip(event.rows, event.tokens):
            ids[i] += t
        if event.kind != "spec":
            continue
        ragged += len(set(event.num_accepted)) > 1
        kv = made[0]
        assert hasattr(kv.cache.layers[0], "hold") == bool(room)  # the kind of layer the case is about
        holes += kv.slots.length > max(kv.counts)  # a column that the longest row does not hold
        _assert_rows_match_fresh_prefill(kv, tiny_target, [ids[i][:-1] for i in event.rows])  # last one pending
        if not event.finished:  # the draft holds committed ids only, up to where the target agreed
            _assert_rows_match_fresh_prefill(drafter.kv, tiny_draft,
                                             [ids[i][: drafter.kv.counts[r]] for r, i in enumerate(event.rows)])
    assert ragged > 0
    if slack:
        assert holes > 0  # rejected drafts left holes between rows' valid slots, and the check read around them
    else:
        assert holes == 0  # compacted after every step, and still exact


def _single_reasons(target, tok, prompts, config):
    return [list(autoregressive(target, tok, p, config))[-1].finish_reason for p in prompts]


def test_rows_finish_independently_and_leave_the_batch(tiny_target, tiny_tok):
    """Rows end at an EOS, a stop string or the length bound, each where its single-sequence run ends and for the
    same reason, and a finished row is in no later pass."""
    config = GenerationConfig(max_new_tokens=20, num_draft_tokens=3, stop_strings=("w12",))
    old = tiny_target.generation_config.eos_token_id
    tiny_target.generation_config.eos_token_id = [0, 5]  # row 3 says w5 at its 7th token, before any w12
    try:
        reasons = _single_reasons(tiny_target, tiny_tok, PROMPTS, config)
        assert reasons == ["length", "stop", "length", "eos"]  # what the tiny target's own runs do
        expected = single(tiny_target, tiny_tok, PROMPTS, config)
        runs = [list(spec_batch(tiny_target, tiny_tok, NgramDrafter(), PROMPTS, config)),
                list(decode(tiny_target, tiny_tok, PROMPTS, config))]
    finally:
        tiny_target.generation_config.eos_token_id = old
    for run in runs:
        assert_lossless(tiny_target, PROMPTS, expected, row_outputs(run, len(PROMPTS)))
        finished = {i: r for e in run for i, r in e.finished.items()}
        assert [finished[i] for i in range(len(PROMPTS))] == reasons
        for n, e in enumerate(run):
            assert not {i for later in run[n + 1:] for i in later.rows} & set(e.finished)
        assert min(len(e.rows) for e in run) < len(PROMPTS)


def test_max_new_tokens_is_respected_per_row(tiny_target, tiny_draft, tiny_tok):
    for limit in (1, 2, 7):
        config = GenerationConfig(max_new_tokens=limit, num_draft_tokens=4)
        events = list(spec_batch(tiny_target, tiny_tok, ModelDrafter(tiny_draft), PROMPTS,
                                        config))
        assert [len(o) for o in row_outputs(events, len(PROMPTS))] == [limit] * len(PROMPTS)


def test_greedy_accept_batch_equals_greedy_accept_per_row():
    torch.manual_seed(0)
    logits = torch.randn(5, 4, 7)
    choice = logits.argmax(-1)
    drafted = choice[:, :3].clone()
    drafted[1, 0] += 1  # row 1 rejects its first draft
    drafted[2, 2] = (drafted[2, 2] + 1) % 7  # row 2 its third
    lengths = torch.tensor([3, 3, 3, 2, 0])
    accepted, nxt = greedy_accept_batch(drafted, lengths, logits)
    for r in range(5):
        n = int(lengths[r])
        assert (accepted[r], nxt[r]) == greedy_accept(drafted[r, :n], logits[r, : n + 1])
    assert accepted == [3, 0, 2, 2, 0]


def test_best_k_from_zero_returns_zero_where_verify_passes_cost_too_much():
    """Auto k's choice (metrics.best_k with min_k = 0): k = 0 where speculation cannot pay."""
    cheap = {k: 1.0 for k in range(1, 9)}
    dear = {k: 1.0 + 0.8 * k for k in range(1, 9)}  # a compute-bound pass: each token costs most of a pass
    k = best_k(0.7, 0.05, 8, cheap, min_k=0)
    s = expected_speedup(0.7, 0.05, k, cheap[k])
    assert k >= 3 and s > 1.5
    assert best_k(0.7, 0.05, 8, dear, min_k=0) == 0
    assert best_k(0.0, 0.0, 8, cheap, min_k=0) == 0


def test_auto_k_follows_the_shrinking_batch_and_stays_lossless(tiny_target, tiny_tok):
    """A policy that speculates only at batch sizes below 3: k changes as rows finish; outputs stay exact."""
    policy = AutoK({1: 4, 3: 0})
    assert [policy(b) for b in (1, 2, 3, 4, 16)] == [4, 4, 0, 0, 0]
    config = GenerationConfig(max_new_tokens=30, num_draft_tokens=4)
    old = tiny_target.generation_config.eos_token_id
    free = single(tiny_target, tiny_tok, PROMPTS, config)
    tiny_target.generation_config.eos_token_id = [0, free[2][4]]  # row 2 (and maybe others) finish early
    try:
        expected = single(tiny_target, tiny_tok, PROMPTS, config)
        events = list(spec_batch(tiny_target, tiny_tok, NgramDrafter(), PROMPTS, config,
                                        k_policy=policy))
    finally:
        tiny_target.generation_config.eos_token_id = old
    assert_lossless(tiny_target, PROMPTS, expected, row_outputs(events, len(PROMPTS)))
    spec = [e for e in events if e.kind == "spec"]
    assert all(e.k == 0 and e.width == 1 for e in spec if len(e.rows) >= 3)
    assert any(e.k > 0 for e in spec if len(e.rows) < 3)


def test_batch_forward_seconds_measures_every_width(tiny_target):
    seconds = timing.forward_seconds(tiny_target, PROMPTS, [2, 5], repeats=1)
    assert sorted(seconds) == [1, 2, 5] and all(0 < s < float("inf") for s in seconds.values())
    costs = timing.verify_costs({1: 1.0, 2: 1.2, 5: 2.0}, 4)
    assert costs[1] == pytest.approx(1.2) and costs[4] == pytest.approx(2.0)
    assert costs[2] == pytest.approx(1.2 + 0.8 / 3)


def test_left_padding_puts_each_row_last_token_in_the_last_column():
    tokens, real = left_padded([[1, 2, 3], [4], []], torch.device("cpu"))
    assert tokens[:, -1].tolist() == [3, 4, batch_kv.PAD]
    assert real.tolist() == [[True] * 3, [False, False, True], [False] * 3]


def test_bad_batches_are_refused(tiny_target, tiny_tok):
    with pytest.raises(GenerationError, match="empty"):
        list(decode(tiny_target, tiny_tok, [], GenerationConfig()))
    with pytest.raises(GenerationError, match="empty"):
        list(decode(tiny_target, tiny_tok, [[1, 2], []], GenerationConfig()))
    with pytest.raises(GenerationError, match="between 1 and"):
        list(spec_batch(tiny_target, tiny_tok, NgramDrafter(), PROMPTS,
                               GenerationConfig(num_draft_tokens=10_000)))


def test_sampled_distribution_matches_target_in_every_row(tiny_target, tiny_draft, tiny_tok):
    """With 40 rows of two prompts of different lengths, each prompt's second sampled token follows the target's
    distribution (seeded trials, a total-variation bound), far from the draft model's. 100 runs of 40 rows give the
    same 2,000 samples per prompt as 500 runs of 8, in 5x fewer batched passes (each row has its own seed)."""
    prompts = [list(range(1, 16)) + [3], [5, 9, 2]]
    rows = [prompts[i % 2] for i in range(40)]
    expected = [second_token_distribution(tiny_target, p) for p in prompts]
    drafts = [second_token_distribution(tiny_draft, p) for p in prompts]
    counts = [torch.zeros_like(e) for e in expected]
    runs, drafted = 100, 0
    for seed in range(runs):
        config = GenerationConfig(max_new_tokens=3, num_draft_tokens=1, sampling=SamplingConfig(1.0),
                                  seed=seed * len(rows))
        events = list(spec_batch(tiny_target, tiny_tok, ModelDrafter(tiny_draft), rows,
                                        config))
        drafted += batch_stats(events).drafted
        for r, ids in enumerate(row_outputs(events, len(rows))):
            if len(ids) >= 2:
                counts[r % 2][ids[1]] += 1
    assert drafted > runs * len(rows) // 4
    for c, e, d in zip(counts, expected, drafts):
        assert c.sum() > 0.9 * runs * len(rows) / 2
        empirical = c / c.sum()
        assert 0.5 * float((empirical - e).abs().sum()) < 0.06
        assert 0.5 * float((d - e).abs().sum()) > 0.2
        assert 0.5 * float((empirical - d).abs().sum()) > 0.15


def test_sampled_distribution_is_exact_in_every_row_through_an_eagle3_heads_draft_vocabulary(eagle3_target,
                                                                                             tiny_tok):
    """Batched EAGLE-3 drafts come from 12 of the 16 ids (q zero elsewhere, mapped through d2t); each row's second
    sampled token still follows the target's distribution, ids outside the draft vocabulary included. 80 runs of 40
    rows give the same 1,600 samples per prompt as 400 runs of 8, in 5x fewer batched passes."""
    prompts = [list(range(1, 16)) + [3], [5, 9, 2]]
    rows = [prompts[i % 2] for i in range(40)]
    expected = [second_token_distribution(eagle3_target, p) for p in prompts]
    outside = torch.ones(16, dtype=torch.bool)
    outside[eagle3_drafter(eagle3_target).head.subset] = False
    counts = [torch.zeros_like(e) for e in expected]
    runs, drafted = 80, 0
    for seed in range(runs):
        config = GenerationConfig(max_new_tokens=3, num_draft_tokens=2, sampling=SamplingConfig(1.0),
                                  seed=seed * len(rows))
        drafter = eagle3_drafter(eagle3_target)
        events = list(spec_batch(eagle3_target, tiny_tok, drafter, rows, config))
        drafted += batch_stats(events).drafted
        for r, ids in enumerate(row_outputs(events, len(rows))):
            if len(ids) >= 2:
                counts[r % 2][ids[1]] += 1
    assert drafted > runs * len(rows) // 4
    for c, e in zip(counts, expected):
        empirical = c / c.sum()
        assert 0.5 * float((empirical - e).abs().sum()) < 0.06
        assert float(e[outside].sum()) > 0.1  # the target puts real mass where the head cannot draft ...
        assert abs(float(empirical[outside].sum() - e[outside].sum())) < 0.04  # ... and the samples follow it
