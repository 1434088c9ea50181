"""distill.answers on a tiny random llama: batched answers are each prompt's own, the answering passes record what a
separate pass would, and a stage resumes its cache by prompt."""

import torch
from conftest import tiny_llama, tiny_tokenizer

from specdemo.train import answers, features, instructions

VOCAB = 40


def test_batched_answers_are_each_prompts_own_greedy_answer_without_a_pad_token():
    """Left-padded batches give every conversation the answer it gets alone, also from a tokenizer with no pad token
    (as transformers 5.17 converts the bundled GGUF's)."""
    target = tiny_llama(VOCAB, seed=5, sharpness=6.0)
    tok = tiny_tokenizer([f"w{i}" for i in range(1, VOCAB)])
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    assert tok.pad_token is None
    convs = [[{"role": "user", "content": "w3 w5 w7 w9 w11 w2"}], [{"role": "user", "content": "w4"}]]
    batched = answers.generate_answers(target, tok, convs, max_new_tokens=6, batch_size=2)
    alone = [answers.generate_answers(target, tok, [c], max_new_tokens=6, batch_size=1)[0] for c in convs]
    assert batched == alone
    assert [r["prompt_len"] for r in batched] == [6, 1] and all(len(r["ids"]) > r["prompt_len"] for r in batched)


def test_answers_are_hf_generates_greedy_answers():
    """The engine's answers are transformers' `generate` ones, token for token, each ending at its first EOS."""
    target, tok, convs = _recording_setup()
    got = answers.generate_answers(target, tok, convs, max_new_tokens=8, batch_size=4)
    for conv, sample in zip(convs, got):
        prompt = answers.prompt_ids(tok, [conv])[0]
        with torch.inference_mode():
            out = target.generate(input_ids=torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                  pad_token_id=0)[0, len(prompt):].tolist()
        expected = out[: out.index(0) + 1] if 0 in out else out
        assert sample == {"ids": prompt + expected, "prompt_len": len(prompt)}
    assert any(s["ids"][-1] == 0 for s in got) and any(len(s["ids"]) - s["prompt_len"] == 8 for s in got)


def _recording_setup():
    """A tiny target whose greedy answers sometimes end at EOS, its tokenizer, and six conversations of 1-6 words."""
    target = tiny_llama(VOCAB, seed=5, sharpness=6.0)
    with torch.no_grad():
        target.lm_head.weight[0] = target.lm_head.weight[31] * 1.05  # EOS where w31 would win: some answers end early
    tok = tiny_tokenizer([f"w{i}" for i in range(1, VOCAB)])
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    contents = ["w3 w5 w7 w9 w11 w2", "w4", "w8 w8 w1", "w12 w30 w31 w2 w6", "w20 w21", "w9 w1 w3 w3"]
    return target, tok, [[{"role": "user", "content": c}] for c in contents]


def test_features_recorded_while_answering_are_those_of_a_separate_pass(tmp_path):
    """--features writer: the passes that answer also give the features and greedy labels, the same (to fp16
    rounding) as build_features' own pass over the finished sequences; answers are `generate_answers`', shortest prompt
    first, some ended by EOS; the sampled stage still labels each position with the greedy token."""
    target, tok, convs = _recording_setup()
    path, samples, log = tmp_path / "samples.jsonl", [], []
    answers.run_stage("s", convs, target, tok, 8, 4, 0.0, 0, path, samples, log.append, record=True)
    reference = answers.generate_answers(target, tok, convs, 8, batch_size=6)
    order = sorted(range(len(convs)), key=lambda i: reference[i]["prompt_len"])
    assert [{"ids": s["ids"], "prompt_len": s["prompt_len"]} for s in samples] == [reference[i] for i in order]
    assert any(s["ids"][-1] == 0 for s in samples) and any(len(s["ids"]) - s["prompt_len"] == 8 for s in samples)
    assert len(list((tmp_path / answers.RECORDED).iterdir())) == 2  # a file per batch until features.pt holds them
    data = features.build_features(target, samples, tmp_path)
    assert not (tmp_path / answers.RECORDED).exists()
    plain = [{"ids": s["ids"], "prompt_len": s["prompt_len"]} for s in samples]
    (tmp_path / "separate").mkdir()
    separate = features.build_features(target, plain, tmp_path / "separate")
    for s, a, b, la, lb in zip(samples, data["features"], separate["features"], data["top1"], separate["top1"]):
        assert a.shape == b.shape == (len(s["ids"]), 32) and torch.allclose(a.float(), b.float(), atol=2e-3)
        assert torch.equal(la, lb)
    assert features.build_features(target, samples, tmp_path)["top1"][0].tolist() == data["top1"][0].tolist()  # cached

    two = answers.prompt_ids(tok, convs[:2])
    sampled, _ = answers.generate_recorded(target, tok, two, 8, sample_temp=1.5, seed=3)
    again, recorded = answers.generate_recorded(target, tok, two, 8, sample_temp=1.5, seed=3)
    assert sampled == again  # seeded
    (tmp_path / "sampled").mkdir()
    greedy = features.build_features(target, [{**s, "stage": "x"} for s in again], tmp_path / "sampled")
    assert all(torch.equal(top, g) for (_, top), g in zip(recorded, greedy["top1"]))


def test_fused_layers_recorded_while_answering_are_those_of_a_separate_pass(tmp_path):
    """With fused layers (EAGLE-3's aux states) the answering passes record the final state then each layer's input
    hidden state, as build_features' own pass does (layer 0's input: the embeddings)."""
    target, tok, convs = _recording_setup()
    path, samples = tmp_path / "samples.jsonl", []
    answers.run_stage("s", convs, target, tok, 8, 4, 0.0, 0, path, samples, lambda r: None, record=True, layers=(0, 1))
    assert all(s["recorded"][2] == [0, 1] for s in samples)
    data = features.build_features(target, samples, tmp_path, layers=(0, 1))
    assert not (tmp_path / answers.RECORDED).exists()  # read from the recordings
    plain = [{"ids": s["ids"], "prompt_len": s["prompt_len"]} for s in samples]
    (tmp_path / "separate").mkdir()
    separate = features.build_features(target, plain, tmp_path / "separate", layers=(0, 1))
    for s, a, b in zip(samples, data["features"], separate["features"]):
        assert a.shape == b.shape == (len(s["ids"]), 3 * 32) and torch.allclose(a.float(), b.float(), atol=2e-3)
    emb = target.get_input_embeddings().weight
    first = data["features"][0][:, 32:64].float()  # layer 0's input: the token embeddings
    assert torch.allclose(first, emb[torch.tensor(samples[0]["ids"])].half().float())
    assert all(torch.equal(a, b) for a, b in zip(data["top1"], separate["top1"]))


def test_a_recorded_stage_whose_list_grew_answers_only_the_new_prompts(tmp_path):
    """A cache recorded for a stage's first four conversations, then the stage run with six (a new instructions
    file appended): the new ones sort between the cached ones by length, yet only they are answered, once each, and
    the features cached for the first four stay valid for the grown list. Copies of a conversation are counted, and
    the other --features mode resumes the same cache."""
    target, tok, convs = _recording_setup()
    path, samples, log = tmp_path / "samples.jsonl", [], []
    answers.run_stage("s", convs[:4], target, tok, 8, 3, 0.0, 0, path, samples, log.append, record=True)
    first = features.build_features(target, samples, tmp_path)
    answers.run_stage("s", convs, target, tok, 8, 3, 0.0, 0, path, samples, log.append, record=True)
    assert [r["sequences"] for r in log] == [3, 4, 6]  # one batch of the two new prompts
    reference = answers.generate_answers(target, tok, convs, 8, batch_size=6)
    assert sorted(s["ids"] for s in samples) == sorted(r["ids"] for r in reference)  # each prompt answered once
    assert instructions.read_jsonl(path) == samples
    grown = features.build_features(target, samples, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(first["features"], grown["features"][:4]))
    (tmp_path / "separate").mkdir()  # the new ones were read from their file: a pass of the target agrees
    separate = features.build_features(target, [{"ids": s["ids"], "prompt_len": s["prompt_len"]} for s in samples[4:]],
                                      tmp_path / "separate")
    for f, top, g, gtop in zip(grown["features"][4:], grown["top1"][4:], separate["features"], separate["top1"]):
        assert torch.allclose(f.float(), g.float(), atol=2e-3) and torch.equal(top, gtop)

    # Cut short after its first batch (the three shortest prompts), a stage resumes in the other mode, in file order;
    # a conversation listed twice is answered twice, also when one copy was cached.
    listed = [convs[1], *convs, convs[4]]
    path, samples = tmp_path / "cut.jsonl", []
    answers.run_stage("c", listed, target, tok, 8, 3, 0.0, 0, path, samples, [].append, max_sequences=3, record=True)
    assert sorted(s["ids"] for s in samples) == sorted(reference[i]["ids"] for i in (1, 1, 4))
    answers.run_stage("c", listed, target, tok, 8, 3, 0.0, 0, path, samples, [].append, record=False)
    assert sorted(s["ids"] for s in samples) == sorted(r["ids"] for r in [*reference, reference[1], reference[4]])
    assert [s["ids"] for s in samples[3:]] == [reference[i]["ids"] for i in (0, 2, 3, 5, 4)]
