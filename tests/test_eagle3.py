"""Drafting with EAGLE-3 heads (specdemo.drafters.eagle3, specdemo.models.eagle3_head) on a tiny random llama:
greedy losslessness at k = 1, 3, 5, exactness (q zero outside the draft vocabulary, sampling through d2t), the
drafter's KV rollback, the hybrid keeping skipped features, the training-time unroll against drafting, q of its
drafts and the confidence gate; and, slow, the bundled target lossless with a head at k = 1 and 4 and the shipped
head over 1.6 tokens per pass. The checkpoint files, loading and export: test_eagle3_files.py."""

import copy

import pytest
import torch
from conftest import draft_vocab, random_head, sampled_second_tokens, second_token_distribution

from specdemo.config import GenerationConfig, SamplingConfig
from specdemo.drafters import DraftRequest
from specdemo.drafters.eagle3 import Eagle3Drafter
from specdemo.engine import autoregressive, encode_prompt, generated_ids, speculative
from specdemo.engine.kv import target_features
from specdemo.models.eagle3 import save_eagle3
from specdemo.models.eagle3_head import build_head

VOCAB, LAYERS = 100, 8  # target8's (conftest)
PROMPT = [3, 5, 7, 3, 5, 9, 2, 11, 40, 41]
GREEDY, SAMPLED = SamplingConfig(temperature=0.0), SamplingConfig(temperature=1.0)


def proposals(drafter, target, ids, k=4, sampling=GREEDY, seed=0):
    """Begin on `ids` with the target's features and propose once."""
    with torch.inference_mode():
        context = torch.tensor([ids[:-1]], device=target.device)
        feats = target_features(target, drafter.target_layers, input_ids=context)[1][0]
    drafter.begin([ids[:-1]], [feats])
    gen = torch.Generator(device=target.device).manual_seed(seed)
    return propose_one(drafter, ids, k, sampling, gen)


def propose_one(drafter, ids, k, sampling=GREEDY, gen=None, eos=frozenset()):
    """One row's proposal."""
    return drafter.propose(DraftRequest([list(ids)], [k], sampling, [gen], eos))[0]


def test_q_is_zero_outside_the_draft_vocabulary(target8):
    """Sampled proposals carry q over the target vocabulary, nonzero only at d2t's target ids."""
    head = random_head(target8)
    p = proposals(Eagle3Drafter(head), target8, PROMPT, k=3, sampling=SAMPLED)
    allowed = torch.zeros(VOCAB, dtype=torch.bool)
    allowed[draft_vocab()] = True
    probs = p.probs.cpu()
    assert probs.shape == (3, VOCAB) and float(probs[:, ~allowed].abs().sum()) == 0.0
    assert torch.allclose(probs.sum(-1), torch.ones(3)) and all(allowed[t] for t in p.tokens)
    assert all(float(probs[i, t]) > 0 for i, t in enumerate(p.tokens))  # the draws are where q has mass
    assert p.token_probs == pytest.approx([float(probs[i, t]) for i, t in enumerate(p.tokens)])


def test_greedy_proposal_reports_q_of_each_token(target8):
    """Greedy drafting fills token_probs with the draft's softmax at each drafted token (its peak), for the
    inspector."""
    drafter = Eagle3Drafter(random_head(target8, seed=4))
    p = proposals(drafter, target8, PROMPT, k=3)
    assert p.probs is None and len(p.token_probs) == len(p.tokens) > 0
    assert p.token_probs == drafter.confidences[0] and all(0 < q <= 1 for q in p.token_probs)


def hidden(target, ids, layers):
    """The engine's features for `ids`: the final hidden state, then the `layers`' states (T, H * (1 + n))."""
    with torch.inference_mode():
        return target_features(target, layers, input_ids=torch.tensor([ids], device=target.device))[1][0]


def test_rollback_keeps_only_true_feature_entries(target8, tok100):
    """After each verdict the draft cache holds exactly the entries from true features, and the next proposal equals
    that of a fresh drafter begun on the whole committed sequence (so the aux states travel with the verdicts)."""
    config = GenerationConfig(max_new_tokens=30, num_draft_tokens=4)
    drafter = Eagle3Drafter(random_head(target8, seed=1))
    ids, rejections = list(PROMPT), 0
    for event in speculative(target8, tok100, drafter, PROMPT, config):
        ids += event.tokens
        if event.kind != "spec" or event.finish_reason:
            continue
        rejections += event.num_accepted < len(event.drafted)
        # the last num_accepted + 1 features are pending; everything before them is cached, nothing more
        assert drafter.cache_length == drafter.kv.counts[0] == len(ids) - 2 - event.num_accepted
        with torch.inference_mode():
            again = propose_one(copy.deepcopy(drafter), ids, 4, eos=frozenset([0])).tokens
            fresh = Eagle3Drafter(random_head(target8, seed=1))
            fresh.begin([ids[:-1]], [hidden(target8, ids[:-1], fresh.target_layers)])
            assert propose_one(fresh, ids, 4, eos=frozenset([0])).tokens == again
    assert rejections > 0


def test_unrolled_training_matches_drafting(target8):
    """The training-time unroll (all chains at once, masked) computes the same outputs as step-by-step drafting."""
    head = random_head(target8, seed=2)
    ids = PROMPT + [12, 13, 14, 15]
    feats = hidden(target8, ids, head.target_layers)  # (T, H * 4): the final state, then the aux layers'
    depth, t = 3, len(ids) - 3
    tokens = torch.tensor([ids + [0] * (depth + 3)])
    with torch.inference_mode():
        outs = head.unrolled(feats[None, :t, 32:], tokens[:, : t + depth], depth)
        for start in (0, 2, t - 1):  # a chain whose last true state is at `start`
            f, k, v = head(head.prepare(feats[None, : start + 1]), tokens[:, 1 : start + 2], torch.arange(start + 1))
            f = f[:, -1:]
            assert torch.allclose(f[0, 0], outs[0][0, start], atol=1e-5)
            for d in range(2, depth + 1):
                pos = torch.tensor([start + d - 1])
                f, k2, v2 = head(f, tokens[:, start + d : start + d + 1], pos, k, v)
                k, v = torch.cat([k, k2], 2), torch.cat([v, v2], 2)
                assert torch.allclose(f[0, 0], outs[d - 1][0, start], atol=1e-5)


@pytest.mark.parametrize("k", [2, 4])
def test_hybrid_with_eagle3_is_lossless_and_keeps_skipped_features(target8, tok100, k):
    """Prompt lookup takes some steps and the EAGLE-3 head the others: output stays the target's, and after every
    verdict the head's next proposal equals a fresh head's on the whole committed sequence (no feature lost)."""
    from specdemo.drafters import HybridDrafter

    prompt = PROMPT * 3  # repeats, so the lookup finds matches of 3+ tokens
    config = GenerationConfig(max_new_tokens=40, num_draft_tokens=k)
    ar = generated_ids(list(autoregressive(target8, tok100, prompt, config)))
    hybrid = HybridDrafter(Eagle3Drafter(random_head(target8, seed=4)))
    ids, sources = list(prompt), []
    for event in speculative(target8, tok100, hybrid, prompt, config):
        ids += event.tokens
        if event.kind != "spec" or event.finish_reason:
            continue
        sources.append(event.draft_source)
        with torch.inference_mode():
            again = propose_one(copy.deepcopy(hybrid.model), ids, k, eos=frozenset([0])).tokens
            fresh = Eagle3Drafter(random_head(target8, seed=4))
            fresh.begin([ids[:-1]], [hidden(target8, ids[:-1], fresh.target_layers)])
            assert propose_one(fresh, ids, k, eos=frozenset([0])).tokens == again
    assert ids[len(prompt):] == ar
    assert {"lookup", "model"} <= set(sources)


def test_confidence_gate_shortens_proposals_and_stays_lossless(target8, tok100):
    """min_confidence stops drafting before unsure tokens (never before the first); outputs stay the target's."""
    config = GenerationConfig(max_new_tokens=40, num_draft_tokens=4)
    ar = generated_ids(list(autoregressive(target8, tok100, PROMPT, config)))
    lengths, seen = {}, []
    median = None
    for gate in ("off", "median", "above all"):
        drafter = Eagle3Drafter(random_head(target8, seed=5))
        drafter.min_confidence = {"off": 0.0, "median": median, "above all": 1.01}[gate]
        events = []
        for event in speculative(target8, tok100, drafter, PROMPT, config):
            events.append(event)
            if event.kind == "spec" and event.drafted:
                confidences = drafter.confidences[0]
                assert len(confidences) == len(event.drafted)
                assert all(c >= drafter.min_confidence for c in confidences[1:])
                seen += confidences[1:] if gate == "off" else []
        assert generated_ids(events) == ar
        spec = [e for e in events if e.kind == "spec" and e.drafted]
        lengths[gate] = sum(len(e.drafted) for e in spec) / len(spec)
        median = median or sorted(seen)[len(seen) // 2]
    assert lengths["off"] > lengths["median"] > lengths["above all"] == 1.0


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculative_equals_autoregressive(target8, tok100, k):
    """Greedy speculative output with an EAGLE-3 head is the target's own greedy output."""
    config = GenerationConfig(max_new_tokens=40, num_draft_tokens=k)
    ar = generated_ids(list(autoregressive(target8, tok100, PROMPT, config)))
    events = list(speculative(target8, tok100, Eagle3Drafter(random_head(target8)), PROMPT, config))
    assert generated_ids(events) == ar
    assert any(e.kind == "spec" and e.drafted for e in events)


def test_sampled_distribution_is_exact_through_d2t(target8, tok100):
    """Speculative sampling with an EAGLE-3 head over 30 of the 100 ids draws the second token from the target's
    distribution, including the mass outside the draft vocabulary, which the head alone can never propose. The 2,000
    trials run as 50 batches of 40 rows, each row with its own seed (sampled_second_tokens)."""
    expected = second_token_distribution(target8, PROMPT)
    ranked = expected.argsort(descending=True).tolist()
    vocab = torch.tensor([0] + [t for t in ranked[2:] if t != 0][:29])  # the target's top two are not draftable
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[vocab] = False
    assert float(expected[outside].sum()) > 0.3
    torch.manual_seed(5)
    drafter = Eagle3Drafter(build_head(target8, vocab).eval())
    trials = 2000
    config = GenerationConfig(max_new_tokens=3, num_draft_tokens=1, sampling=SAMPLED)
    counts, drafted = sampled_second_tokens(target8, tok100, lambda: drafter, PROMPT, config, trials)
    empirical = counts / counts.sum()
    assert counts.sum() > 0.9 * trials and drafted > trials // 2
    # total variation over the target's 8 likeliest tokens, the rest of the draft vocabulary, and the rest outside it
    # (100 single bins would carry ~0.08 of sampling noise at 2000 trials; these 10 carry ~0.03)
    top, rest_in = ranked[:8], ~outside
    rest_in[top] = False
    rest_out = outside.clone()
    rest_out[top] = False

    def binned(d):
        return torch.cat([d[top], d[rest_in].sum()[None], d[rest_out].sum()[None]])

    assert 0.5 * float((binned(empirical) - binned(expected)).abs().sum()) < 0.05
    assert abs(float(empirical[outside].sum()) - float(expected[outside].sum())) < 0.04  # the head's own q has 0 there


@pytest.mark.slow
def test_bundled_target_with_an_eagle3_head_is_lossless_end_to_end(bundled, tmp_path):
    """The real bundled target with a random EAGLE-3 head (saved, then loaded by the CLI's path): greedy speculative
    output equals the target's greedy output, for several k."""
    from specdemo.measure.compare import make_drafter

    torch.manual_seed(0)
    head = build_head(bundled.model, torch.arange(8192))  # the 8192 first ids, as a draft vocabulary
    assert head.aux_layer_ids == (2, 15, 27)  # vLLM's default for a 30-layer target
    save_eagle3(head, tmp_path / "head")
    drafter, _, _ = make_drafter(bundled, "model", str(tmp_path / "head"))
    assert isinstance(drafter, Eagle3Drafter)
    for k, prompt in ((1, "Write a haiku about autumn leaves."), (4, "What is the capital of Japan? Answer briefly.")):
        config = GenerationConfig(max_new_tokens=32, num_draft_tokens=k)
        ids = encode_prompt(bundled.tokenizer, prompt)
        ar = generated_ids(list(autoregressive(bundled.model, bundled.tokenizer, ids, config)))
        events = list(speculative(bundled.model, bundled.tokenizer, drafter, ids, config))
        assert generated_ids(events) == ar
        assert any(e.kind == "spec" and e.drafted for e in events)


@pytest.mark.slow
def test_shipped_draft_is_lossless_and_accepts(bundled):
    """The shipped head (an EAGLE-3 head since 2026-12-02, loaded through the path every drafter takes) with the
    bundled target: greedy speculative == autoregressive, with real acceptance."""
    from specdemo.measure.compare import make_drafter

    drafter, name, _ = make_drafter(bundled, "model", None)
    assert name == "smollm2-135m-draft" and isinstance(drafter, Eagle3Drafter) and drafter.min_confidence == 0.8
    config = GenerationConfig(max_new_tokens=48, num_draft_tokens=4)
    prompts = ["Write a haiku about autumn leaves.", "What is the capital of Japan? Answer briefly.",
               "Write a Python function that adds two numbers."]
    committed = steps = 0
    for prompt in prompts:
        ids = encode_prompt(bundled.tokenizer, prompt)
        ar = generated_ids(list(autoregressive(bundled.model, bundled.tokenizer, ids, config)))
        events = list(speculative(bundled.model, bundled.tokenizer, drafter, ids, config))
        assert generated_ids(events) == ar
        spec = [e for e in events if e.kind == "spec"]
        committed += sum(len(e.tokens) for e in spec)
        steps += len(spec)
    # mean accepted length per target pass, bonus included (1.84 for the EAGLE-style head shipped before, with the
    # gate at 0.8, which stops drafting before unsure tokens and so trades accepted length for cheaper verify passes)
    assert committed / steps > 1.6
