"""distill.features on a tiny random llama: the recorded labels are the target's greedy tokens, caches with inner
layers' states are sliced or rebuilt as their layers require, and an EAGLE-3 head trains on them."""

import torch
from conftest import tiny_llama

from specdemo.train import cli, features, heads, training

VOCAB = 40
AUX = (1,)  # the tiny 2-layer target's inner state an EAGLE-3 head reads here (the default ids need 6+ layers)


def eagle3_trainee(target, subset, data, layers=AUX):
    """A fresh EAGLE-3 head reading `layers` over `subset`, as distill builds it (heads.build: the trainee with the
    per-channel scale of `data`'s aux states)."""
    config = cli.parse_config(["--target", "x", "--out", "x", "--fuse-layers", ",".join(map(str, layers))])
    return heads.build(config, target, subset, data)[0]


def greedy_samples(target, n: int, length: int) -> list[dict]:
    """Sequences whose answers are the target's own greedy continuations of random prompts (as build_data makes)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        prompt = (1 + torch.randint(VOCAB - 1, (6,), generator=g)).tolist()
        ids = list(prompt)
        with torch.inference_mode():
            for _ in range(length):
                ids.append(int(target(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        out.append({"ids": ids, "prompt_len": len(prompt), "stage": "test"})
    return out


def test_fused_features_cache_and_training(tmp_path):
    """With inner layers the cache holds wider features (final state first, same labels), is rebuilt when the layers
    change, and an EAGLE-3 head reading them trains under bf16 autocast: held-out agreement rises, fc moves off its
    start, and the weights stay fp32."""
    target = tiny_llama(VOCAB, seed=5, sharpness=6.0)
    samples = greedy_samples(target, n=24, length=12)
    plain = features.build_features(target, samples, tmp_path)
    fused = features.build_features(target, samples, tmp_path, layers=(1,))
    assert fused["layers"] == (1,) and plain["layers"] == ()
    h = plain["features"][0].shape[-1]
    assert fused["features"][0].shape[-1] == 2 * h
    assert torch.equal(fused["features"][0][:, :h], plain["features"][0])
    assert all(torch.equal(a, b) for a, b in zip(fused["top1"], plain["top1"]))
    assert not torch.equal(fused["features"][0][:, h:], plain["features"][0])  # a different layer's state

    subset = features.choose_subset(samples, fused["top1"], 24, VOCAB, [0])
    config = cli.parse_config(["--target", "x", "--out", str(tmp_path), "--steps", "60", "--batch-size", "8",
                               "--eval-every", "60", "--log-every", "60", "--lr", "3e-3", "--train-dtype", "bf16"])
    torch.manual_seed(0)
    head = eagle3_trainee(target, subset, fused)
    start = head.head.fc.weight.detach().clone()
    records = []
    final = training.train(head, samples, fused, config, torch.device("cpu"), records.append)
    first = [r for r in records if r["event"] == "eval"][0]
    assert final["top1_step"][0] > first["top1_step"][0]
    assert float((head.head.fc.weight.detach() - start).abs().max()) > 0
    assert all(p.dtype == torch.float32 for p in head.parameters())


def test_plain_features_are_sliced_from_a_fused_cache(tmp_path, monkeypatch):
    """A cache recorded with more layers serves a prefix of them (here none: the final state alone) without running
    the target again, and the cache file keeps every layer until samples are added."""
    target = tiny_llama(VOCAB, seed=5, sharpness=6.0)
    samples = greedy_samples(target, n=6, length=8)
    fused = features.build_features(target, samples, tmp_path, layers=(1,))
    (tmp_path / "fresh").mkdir()
    fresh = features.build_features(target, samples, tmp_path / "fresh")

    def refuse(*a, **k):
        raise AssertionError("ran the target instead of slicing the cache")

    monkeypatch.setattr(features, "target_features", refuse)
    plain = features.build_features(target, samples, tmp_path)
    assert plain["layers"] == () and plain["features"][0].shape[-1] == fused["features"][0].shape[-1] // 2
    assert all(torch.equal(a, b) for a, b in zip(plain["features"], fresh["features"]))
    assert all(torch.equal(a, b) for a, b in zip(plain["top1"], fresh["top1"]))
    assert tuple(torch.load(tmp_path / "features.pt")["layers"]) == (1,)

    monkeypatch.undo()  # more samples: the sliced prefix is kept and only the new ones run through the target
    more = samples + greedy_samples(target, n=8, length=8)[6:]
    grown = features.build_features(target, more, tmp_path)
    (tmp_path / "all").mkdir()
    whole = features.build_features(target, more, tmp_path / "all")
    assert len(grown["features"]) == 8 and grown["layers"] == ()
    assert all(torch.allclose(a.float(), b.float(), atol=1e-3) for a, b in zip(grown["features"], whole["features"]))
    assert tuple(torch.load(tmp_path / "features.pt")["layers"]) == ()


def assert_drafts_losslessly(target, tok, drafter, samples) -> None:
    """The trained head drafts for its target on the last sample's prompt: the target's own greedy output, and some
    drafts accepted."""
    from specdemo.config import GenerationConfig
    from specdemo.engine import autoregressive, generated_ids, speculative

    config = GenerationConfig(max_new_tokens=24, num_draft_tokens=3)
    prompt = samples[-1]["ids"][: samples[-1]["prompt_len"]]
    ar = generated_ids(list(autoregressive(target, tok, prompt, config)))
    events = list(speculative(target, tok, drafter, prompt, config))
    assert generated_ids(events) == ar
    assert sum(e.num_accepted for e in events if e.kind == "spec") > 0
