"""EAGLE-3 heads (specdemo.models.eagle3) on a tiny random llama: the checkpoint format (config keys, detection),
save/load and export -> load with identical proposals, greedy losslessness at k = 1, 3, 5, exactness (q zero outside
the draft vocabulary, sampling through d2t), heads for another target and unsupported variants refused by name, hub
ids cached and uncached, export's files and refusals, the drafter's KV rollback, the hybrid keeping skipped features,
the training-time unroll against drafting, q of its drafts and the confidence gate; and, slow, the bundled target
lossless with a head at k = 1 and 4 and the shipped head over 1.6 tokens per pass."""

import copy
import json
import shlex

import pytest
import torch
from conftest import draft_vocab, random_head, sampled_second_tokens, tiny_llama, tiny_tokenizer

from specdemo.config import GenerationConfig, Runtime, SamplingConfig
from specdemo.drafters import DraftRequest
from specdemo.drafters.eagle3 import Eagle3Drafter
from specdemo.engine import autoregressive, encode_prompt, generated_ids, speculative
from specdemo.engine.kv import target_features
from specdemo.models.eagle3 import (
    Eagle3Config,
    Eagle3FormatError,
    build_head,
    is_eagle3,
    load_head,
    save_eagle3,
)

VOCAB = 100
LAYERS = 8  # the default aux ids (2, L // 2, L - 3) = (2, 4, 5) are distinct
PROMPT = [3, 5, 7, 3, 5, 9, 2, 11, 40, 41]


@pytest.fixture(scope="module")
def tok100():
    return tiny_tokenizer([f"w{i}" for i in range(1, VOCAB)])


@pytest.fixture(scope="module")
def target8():
    return tiny_llama(VOCAB, seed=4, sharpness=8.0, layers=LAYERS)


GREEDY, SAMPLED = SamplingConfig(temperature=0.0), SamplingConfig(temperature=1.0)


def proposals(drafter, target, ids, k=4, sampling=GREEDY, seed=0):
    """Begin on `ids` with the target's features and propose once."""
    with torch.inference_mode():
        feats = target_features(target, drafter.target_layers, input_ids=torch.tensor([ids[:-1]], device=target.device))[1][0]
    drafter.begin([ids[:-1]], [feats])
    gen = torch.Generator(device=target.device).manual_seed(seed)
    return propose_one(drafter, ids, k, sampling, gen)


def propose_one(drafter, ids, k, sampling=GREEDY, gen=None, eos=frozenset()):
    """One row's proposal."""
    return drafter.propose(DraftRequest([list(ids)], [k], sampling, [gen], eos))[0]


def test_config_json_has_the_engines_keys(target8):
    """config.json names the EAGLE-3 architecture, both vocab sizes, the target's hidden size and eagle_config;
    default aux ids are left out (vLLM and SGLang read explicit ids differently, the default the same)."""
    c = Eagle3Config.for_target(target8.config, 60)
    d = c.to_json()
    assert d["architectures"] == ["LlamaForCausalLMEagle3"] and d["num_hidden_layers"] == 1
    assert (d["vocab_size"], d["draft_vocab_size"], d["target_hidden_size"]) == (VOCAB, 60, 32)
    assert d["eagle_config"] == {"use_aux_hidden_state": True} and d["tie_word_embeddings"] is False
    assert c.resolve_aux(LAYERS) == (2, 4, 5)
    explicit = Eagle3Config.for_target(target8.config, 60, (1, 3, 6)).to_json()
    assert explicit["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]
    assert Eagle3Config.from_json(d) == c and is_eagle3(d) and not is_eagle3(target8.config.to_dict())


def test_save_load_round_trip_gives_identical_proposals(target8, tmp_path):
    """A saved head loads back (parameter names = checkpoint names) and proposes the same tokens and q."""
    head = random_head(target8)
    save_eagle3(head, tmp_path, dtype=torch.float32)
    from safetensors.torch import load_file

    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
            "midlayer.self_attn.q_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
    assert "embed_tokens.weight" not in names  # borrowed from the target
    assert load_file(str(tmp_path / "model.safetensors"))["midlayer.self_attn.q_proj.weight"].shape[1] == 64  # 2H
    loaded, _ = load_head(tmp_path, target8)
    ids = PROMPT + [12, 13]
    for sampling in (GREEDY, SAMPLED):
        a = proposals(Eagle3Drafter(head), target8, ids, sampling=sampling)
        b = proposals(Eagle3Drafter(loaded), target8, ids, sampling=sampling)
        assert a.tokens == b.tokens and len(a.tokens) == 4
        if a.probs is not None:
            assert torch.allclose(a.probs, b.probs, atol=1e-5)


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
    """Greedy drafting fills token_probs with the draft's softmax at each drafted token (its peak), for the inspector."""
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
        assert drafter.cache_length == drafter.slots.counts[0] == len(ids) - 2 - event.num_accepted
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


def test_a_head_for_another_target_is_refused(target8, tmp_path):
    """Loading a head on a target with another vocabulary, width or too few layers says why."""
    save_eagle3(random_head(target8), tmp_path)
    with pytest.raises(Eagle3FormatError, match="for another target.*vocab_size 100"):
        load_head(tmp_path, tiny_llama(VOCAB + 5, seed=1, layers=LAYERS))
    with pytest.raises(Eagle3FormatError, match="2 layers"):
        load_head(tmp_path, tiny_llama(VOCAB, seed=1, layers=2))


def test_unsupported_variants_are_refused():
    """A multi-layer head or a norm_before_fc head is refused by name, not run wrongly."""
    base = Eagle3Config.for_target(tiny_llama(VOCAB, seed=1, layers=LAYERS).config, 60).to_json()
    with pytest.raises(Eagle3FormatError, match="num_hidden_layers 2"):
        Eagle3Config.from_json({**base, "num_hidden_layers": 2})
    with pytest.raises(Eagle3FormatError, match="norm_before_fc"):
        Eagle3Config.from_json({**base, "norm_before_fc": True})
    with pytest.raises(Eagle3FormatError, match="not an EAGLE-3 head"):
        Eagle3Config.from_json({**base, "architectures": ["LlamaForCausalLM"]})
    assert json.loads(json.dumps(base))  # plain JSON


def loaded_target(model, tok):
    from specdemo.models.loading import LoadedModel

    return LoadedModel("tiny-target", model, tok, model.device, model.dtype, "folder")


def test_make_drafter_detects_an_eagle3_folder_from_its_config(target8, tok100, tmp_path):
    """compare.make_drafter (the CLI's --draft, the bench, the app) turns a folder whose config.json is an EAGLE-3
    head into an Eagle3Drafter, alone or inside the hybrid, with the head's recorded k; the folder's name is not read."""
    from specdemo.drafters import HybridDrafter
    from specdemo.measure.compare import drafter_k, make_drafter

    folder = tmp_path / "any-name"
    save_eagle3(random_head(target8), folder, meta={"num_speculative_tokens": 3})
    target = loaded_target(target8, tok100)
    drafter, name, _ = make_drafter(target, "model", str(folder))
    assert isinstance(drafter, Eagle3Drafter) and name == str(folder) and drafter_k(drafter) == 3
    assert drafter.target_layers == (2, 4, 5)
    hybrid, _, calibration = make_drafter(target, "hybrid", str(folder))
    assert isinstance(hybrid, HybridDrafter) and isinstance(hybrid.model, Eagle3Drafter) and calibration is not None
    config = GenerationConfig(max_new_tokens=30, num_draft_tokens=3)
    ar = generated_ids(list(autoregressive(target8, tok100, PROMPT * 2, config)))
    assert generated_ids(list(speculative(target8, tok100, hybrid, PROMPT * 2, config))) == ar


def test_make_drafter_says_a_folder_without_a_config_is_no_draft(target8, tok100, tmp_path):
    """A folder that is neither an EAGLE-3 head nor a causal LM (no config.json) is refused by name, before any
    loader guesses at it."""
    from specdemo.measure.compare import make_drafter
    from specdemo.models.loading import ModelLoadError

    (tmp_path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="is not an EAGLE-3 head .*LlamaForCausalLMEagle3.* nor a causal LM"):
        make_drafter(loaded_target(target8, tok100), "model", str(tmp_path))


def test_hub_ids_detected_from_the_cached_config_and_offline_fails_clearly(target8, tok100, tmp_path, monkeypatch):
    """A hub id whose cached config.json is an EAGLE-3 head loads from the hub cache offline; an uncached hub id
    offline fails with the loader's usual clear message."""
    from huggingface_hub import constants

    from specdemo.measure.compare import make_drafter
    from specdemo.models.loading import ModelLoadError

    snapshot = tmp_path / "hub" / "models--someone--tiny-eagle3" / "snapshots" / ("0" * 40)
    save_eagle3(random_head(target8), snapshot)
    (tmp_path / "hub" / "models--someone--tiny-eagle3" / "refs").mkdir()
    (tmp_path / "hub" / "models--someone--tiny-eagle3" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    offline = Runtime(hub_offline=True)
    drafter, _, _ = make_drafter(loaded_target(target8, tok100), "model", "someone/tiny-eagle3", runtime=offline)
    assert isinstance(drafter, Eagle3Drafter)
    with pytest.raises(ModelLoadError, match="unreachable"):
        make_drafter(loaded_target(target8, tok100), "model", "someone/not-cached-eagle3", runtime=offline)


def test_export_cli_writes_checkpoint_and_flags_and_round_trips(target8, tmp_path, capsys):
    """`export` writes config.json, model.safetensors, speculative_config.json and sglang.txt with the engines' keys;
    the exported head, loaded back by the EAGLE-3 loader, proposes exactly what the original head proposes."""
    from specdemo.__main__ import main as cli_main

    head = random_head(target8, seed=2)
    save_eagle3(head, tmp_path / "trained")
    out = tmp_path / "exported"
    assert cli_main(["export", "--draft", str(tmp_path / "trained"), "--out", str(out), "--k", "3"]) == 0
    assert "vllm serve" in capsys.readouterr().out
    assert {"config.json", "model.safetensors", "speculative_config.json", "sglang.txt"} <= {p.name for p in out.iterdir()}
    spec = json.loads((out / "speculative_config.json").read_text())
    assert spec == {"method": "eagle3", "model": str(out.resolve()), "num_speculative_tokens": 3}
    flags = shlex.split((out / "sglang.txt").read_text().splitlines()[-1])
    assert flags[flags.index("--speculative-algorithm") + 1] == "EAGLE3"
    assert flags[flags.index("--speculative-draft-model-path") + 1] == str(out.resolve())
    assert [flags[flags.index(f) + 1] for f in ("--speculative-num-steps", "--speculative-eagle-topk",
                                                 "--speculative-num-draft-tokens")] == ["3", "1", "4"]
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    back, _ = load_head(out, target8)
    original, _ = load_head(tmp_path / "trained", target8)  # the same fp16 weights the export started from
    for sampling in (GREEDY, SAMPLED):
        a = proposals(Eagle3Drafter(original), target8, PROMPT + [12], k=5, sampling=sampling, seed=3)
        b = proposals(Eagle3Drafter(back), target8, PROMPT + [12], k=5, sampling=sampling, seed=3)
        assert a.tokens == b.tokens
    from specdemo.measure.compare import drafter_k, make_drafter

    drafter, _, _ = make_drafter(loaded_target(target8, None), "model", str(out))
    assert drafter_k(drafter) == 3  # export's k is the exported head's recorded k
    assert drafter.min_confidence == 0.0
    gated = tmp_path / "gated"
    assert cli_main(["export", "--draft", str(out), "--out", str(gated), "--min-confidence", "0.8"]) == 0
    assert make_drafter(loaded_target(target8, None), "model", str(gated))[0].min_confidence == 0.8
    assert cli_main(["export", "--draft", str(gated), "--out", str(tmp_path / "ungated"), "--min-confidence", "0"]) == 0
    assert make_drafter(loaded_target(target8, None), "model", str(tmp_path / "ungated"))[0].min_confidence == 0.0
    capsys.readouterr()
    assert cli_main(["export", "--draft", str(out), "--out", str(tmp_path / "bad"), "--min-confidence", "1.5"]) != 0
    assert "min_confidence must be in [0, 1), got 1.5" in capsys.readouterr().err


def test_export_refuses_what_is_not_an_eagle3_head(target8, tmp_path):
    """A folder without a config.json is no draft at all, and export says so; a plain draft LM is pointed to
    serve-config."""
    from specdemo.serve.export import export_eagle3

    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "weights.safetensors").write_bytes(b"")
    with pytest.raises(Eagle3FormatError, match="not an EAGLE-3 head .*LlamaForCausalLMEagle3.* nor a causal LM"):
        export_eagle3(str(tmp_path / "other"), tmp_path / "out")
    target8.config.save_pretrained(tmp_path / "lm")
    with pytest.raises(Eagle3FormatError, match="not an EAGLE-3 head.*serve-config"):
        export_eagle3(str(tmp_path / "lm"), tmp_path / "out")


def second_token_distribution(model, prompt, eos=0):
    """Exact P(second new token | first is not EOS) under the target alone."""
    with torch.inference_mode():
        x = torch.tensor([prompt], device=model.device)
        p1 = torch.softmax(model(input_ids=x).logits[0, -1], -1).cpu()
        seqs = torch.tensor([prompt + [t] for t in range(VOCAB)], device=model.device)
        p2 = torch.softmax(model(input_ids=seqs).logits[:, -1], -1).cpu()
    p1 = p1.clone()
    p1[eos] = 0.0
    return (p1[:, None] * p2).sum(0) / p1.sum()


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
    binned = lambda d: torch.cat([d[top], d[rest_in].sum()[None], d[rest_out].sum()[None]])
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


def test_serve_hint_after_tune_k_names_k_and_the_commands(target8, tmp_path):
    """After Tune k the app shows how to serve an EAGLE-3 draft at the tuned k (export, vllm serve, SGLang) and
    nothing for other drafts."""
    from specdemo.serve.export import serve_hint

    save_eagle3(random_head(target8), tmp_path / "head")
    hint = serve_hint("smollm2-135m", str(tmp_path / "head"), 3)
    assert "k = 3 in vLLM" in hint and "python -m specdemo export" in hint and "vllm serve" in hint
    assert '"num_speculative_tokens":3' in hint and "--speculative-algorithm EAGLE3" in hint
    target8.config.save_pretrained(tmp_path / "lm")
    assert serve_hint("smollm2-135m", str(tmp_path / "lm"), 3) is None


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
