"""EAGLE-3 heads (specdemo.eagle3) on a tiny random llama: the checkpoint format, save/load, losslessness, exactness."""

import json

import pytest
import torch

from specdemo.config import GenerationConfig, SamplingConfig
from specdemo.drafters import DraftRequest
from specdemo.eagle3 import (Eagle3Config, Eagle3Drafter, Eagle3FormatError, build_head, is_eagle3, load_head,
                             save_eagle3)
from specdemo.engine import autoregressive, generated_ids, speculative, target_features

from conftest import tiny_llama, tiny_tokenizer

VOCAB = 100
LAYERS = 8  # the default aux ids (2, L // 2, L - 3) = (2, 4, 5) are distinct
PROMPT = [3, 5, 7, 3, 5, 9, 2, 11, 40, 41]


@pytest.fixture(scope="module")
def tok100():
    return tiny_tokenizer([f"w{i}" for i in range(1, VOCAB)])


@pytest.fixture(scope="module")
def target8():
    return tiny_llama(VOCAB, seed=4, sharpness=8.0, layers=LAYERS)


def draft_vocab(size: int = 60, seed: int = 0) -> torch.Tensor:
    """EOS (id 0) and a shuffled part of the rest, in draft-id order (so d2t is not monotone)."""
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.tensor([0]), 1 + torch.randperm(VOCAB - 1, generator=g)[: size - 1]])


def random_head(target, seed: int = 0, size: int = 60, aux=None):
    torch.manual_seed(seed)
    head = build_head(target, draft_vocab(size, seed), aux)
    with torch.no_grad():  # larger weights than the default init, so drafts vary with their input
        for name, p in head.named_parameters():
            if p.dim() == 2 and name != "lm_head.weight":
                p.normal_(0.0, 2.0 * p.shape[1] ** -0.5)
    return head.eval()


def proposals(drafter, target, ids, k=4, sampling=SamplingConfig(temperature=0.0), seed=0):
    """Begin on `ids` with the target's features and propose once."""
    with torch.inference_mode():
        feats = target_features(target, drafter.target_layers, input_ids=torch.tensor([ids[:-1]]))[1][0]
    drafter.begin(ids[:-1], feats)
    gen = torch.Generator().manual_seed(seed)
    return drafter.propose(DraftRequest(ids, k, sampling, gen))


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
    sampled = SamplingConfig(temperature=1.0)
    for sampling in (SamplingConfig(temperature=0.0), sampled):
        a = proposals(Eagle3Drafter(head), target8, ids, sampling=sampling)
        b = proposals(Eagle3Drafter(loaded), target8, ids, sampling=sampling)
        assert a.tokens == b.tokens and len(a.tokens) == 4
        if a.probs is not None:
            assert torch.allclose(a.probs, b.probs, atol=1e-5)


def test_q_is_zero_outside_the_draft_vocabulary(target8):
    """Sampled proposals carry q over the target vocabulary, nonzero only at d2t's target ids."""
    head = random_head(target8)
    p = proposals(Eagle3Drafter(head), target8, PROMPT, k=3, sampling=SamplingConfig(temperature=1.0))
    allowed = torch.zeros(VOCAB, dtype=torch.bool)
    allowed[draft_vocab()] = True
    assert p.probs.shape == (3, VOCAB) and float(p.probs[:, ~allowed].abs().sum()) == 0.0
    assert torch.allclose(p.probs.sum(-1), torch.ones(3)) and all(allowed[t] for t in p.tokens)


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
