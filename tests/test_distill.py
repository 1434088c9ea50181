"""distill on a tiny random llama: the target's own answers, answer-only loss, agreement rises, the asset works."""

import json

import torch

from specdemo import distill
from specdemo.config import GenerationConfig
from specdemo.eagle import build_head, load_trained_draft, save_draft
from specdemo.engine import autoregressive, generated_ids, speculative
from specdemo.loading import LoadedModel

from conftest import tiny_llama, tiny_tokenizer

VOCAB = 40


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


def test_distill_learns_the_target_and_writes_a_lossless_draft(tmp_path):
    target = tiny_llama(VOCAB, seed=5, sharpness=6.0)
    samples = greedy_samples(target, n=48, length=20)
    data = distill.build_features(target, samples, tmp_path)
    assert (tmp_path / "features.pt").exists()
    # the recorded labels are the target's greedy tokens: along a greedy answer they are the next answer token
    s, top1 = samples[0], data["top1"][0]
    assert top1[s["prompt_len"] - 1 : -1].tolist() == s["ids"][s["prompt_len"] :]

    subset = distill.choose_subset(samples, data["top1"], 24, VOCAB, [0])
    assert 0 in subset.tolist() and len(set(subset.tolist())) == 24
    args = distill.parse_args(["--target", "x", "--out", str(tmp_path), "--steps", "150", "--batch-size", "8",
                               "--eval-every", "150", "--log-every", "50", "--lr", "3e-3"])
    args.skip = 0
    torch.manual_seed(0)
    head = build_head(target, subset)
    records = []
    final = distill.train(head, samples, data, args, torch.device("cpu"), records.append,
                          lambda step, m: save_draft(head, tmp_path, {"target": "tiny", "step": step, "metrics": m}))
    evals = [r for r in records if r["event"] == "eval"]
    assert evals[0]["top1_step"][0] < 0.3 and final["top1_step"][0] > 0.6  # held-out agreement learned, not given
    assert json.loads((tmp_path / "eagle_config.json").read_text())["step"] == 150

    tok = tiny_tokenizer([f"w{i}" for i in range(1, VOCAB)])
    drafter = load_trained_draft(tmp_path, LoadedModel("tiny", target, tok, torch.device("cpu"), torch.float32, "test"))
    config = GenerationConfig(max_new_tokens=24, num_draft_tokens=3)
    prompt = samples[-1]["ids"][: samples[-1]["prompt_len"]]
    ar = generated_ids(list(autoregressive(target, tok, prompt, config)))
    events = list(speculative(target, tok, drafter, prompt, config))
    assert generated_ids(events) == ar
    assert sum(e.num_accepted for e in events if e.kind == "spec") > 0


def test_self_instructions_are_sampled_unique_cached_and_resumable(tmp_path):
    """Magpie-style: the target continues its chat template's user-turn prefix; results are unique, cached per batch,
    and a rerun reads the cache instead of generating, or extends it."""
    target = tiny_llama(VOCAB, seed=6, sharpness=1.0)
    tok = tiny_tokenizer([f"w{i}" for i in range(1, VOCAB)])
    tok.chat_template = ("{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}"
                         "{% if add_generation_prompt %}w3 {% endif %}")
    path, log = tmp_path / "instructions.jsonl", []
    first = distill.self_instructions(target, tok, 6, 8, 0, path, log.append, max_tokens=16)
    assert len(first) == len(set(first)) == 6 and all(len(x) >= 12 for x in first)
    assert len(path.read_text().splitlines()) == 6 and log[0]["event"] == "instructions"

    def refuse(*a, **k):
        raise AssertionError("generated again instead of reading the cache")

    original, target.generate = target.generate, refuse
    assert distill.self_instructions(target, tok, 6, 8, 0, path, log.append, max_tokens=16) == first
    target.generate = original
    more = distill.self_instructions(target, tok, 10, 8, 0, path, log.append, max_tokens=16)
    assert more[:6] == first and len(set(more)) == 10


def test_held_out_split_prefers_self_written_instructions():
    import random

    samples = [{"stage": "self" if i % 3 == 0 else "simple"} for i in range(300)]
    held, train = distill.split_held_out(samples, random.Random(0))
    assert len(held) == 15 and all(samples[i]["stage"] == "self" for i in held)
    assert not set(held) & set(train) and len(held) + len(train) == 300
    assert distill.split_held_out(samples, random.Random(0)) == (held, train)  # reproducible
    few = [{"stage": "self" if i < 10 else "simple"} for i in range(300)]  # too few of them: a plain random split
    held, train = distill.split_held_out(few, random.Random(0))
    assert len(held) == 15 and any(few[i]["stage"] == "simple" for i in held)


def test_fused_features_cache_and_training(tmp_path):
    """With fused layers the cache holds wider features (final state first, same labels), is rebuilt when the layers
    change, and a fused head trains on them under bf16 autocast: held-out agreement rises, the fusion moves off the
    identity it starts as, and the weights stay fp32."""
    target = tiny_llama(VOCAB, seed=5, sharpness=6.0)
    samples = greedy_samples(target, n=24, length=12)
    plain = distill.build_features(target, samples, tmp_path)
    fused = distill.build_features(target, samples, tmp_path, layers=(1,))
    assert fused["layers"] == (1,) and plain["layers"] == ()
    h = plain["features"][0].shape[-1]
    assert fused["features"][0].shape[-1] == 2 * h
    assert torch.equal(fused["features"][0][:, :h], plain["features"][0])
    assert all(torch.equal(a, b) for a, b in zip(fused["top1"], plain["top1"]))
    assert not torch.equal(fused["features"][0][:, h:], plain["features"][0])  # a different layer's state

    subset = distill.choose_subset(samples, fused["top1"], 24, VOCAB, [0])
    args = distill.parse_args(["--target", "x", "--out", str(tmp_path), "--steps", "60", "--batch-size", "8",
                               "--eval-every", "60", "--log-every", "60", "--lr", "3e-3", "--train-dtype", "bf16"])
    args.skip = 0
    torch.manual_seed(0)
    head = build_head(target, subset, (1,))
    start = head.fuse.weight.detach().clone()
    records = []
    final = distill.train(head, samples, fused, args, torch.device("cpu"), records.append)
    first = [r for r in records if r["event"] == "eval"][0]
    assert final["top1_step"][0] > first["top1_step"][0]
    assert float((head.fuse.weight.detach() - start)[:, h:].abs().max()) > 0
    assert all(p.dtype == torch.float32 for p in head.parameters())
