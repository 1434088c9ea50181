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
    mixed = [{"stage": ("self", "written", "simple")[i % 3]} for i in range(300)]  # file-given ones count as own
    held, _ = distill.split_held_out(mixed, random.Random(0))
    assert {mixed[i]["stage"] for i in held} <= {"self", "written"}


def test_instructions_files_are_read_in_order_without_duplicates(tmp_path):
    import json

    import pytest

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"instruction": x}) + "\n" for x in ["Name a bird.", " Sort these: 3, 1 ", "Name a bird."]))
    b.write_text(json.dumps({"instruction": "Name a tree."}) + "\n" + json.dumps({"instruction": "Sort these: 3, 1"}) + "\n")
    assert distill.read_instructions(f"{a}, {b}") == ["Name a bird.", "Sort these: 3, 1", "Name a tree."]
    assert distill.read_instructions("") == []
    assert distill.read_instructions(f"written,{b}") == [*distill.read_instructions(str(distill.WRITTEN)), "Name a tree.",
                                                          "Sort these: 3, 1"]  # "written" names the project's file
    both = distill.read_instructions("written,written2")  # and "written2" its second batch
    assert both == [*distill.read_instructions(str(distill.WRITTEN)), *distill.read_instructions(str(distill.WRITTEN_2))]
    args = distill.parse_args(["--target", "x", "--out", "y"])  # the shipped recipe by default
    assert (args.self_instruct, args.instructions, args.features, args.steps) == (0, "written,written2", "writer", 4000)
    assert distill.WRITTEN.is_file() and distill.WRITTEN_2.is_file()
    with pytest.raises(FileNotFoundError, match="no instructions file"):
        distill.read_instructions(str(tmp_path / "nothing.jsonl"))


def test_agreement_counts_every_draftable_token_and_misses_outside_the_subset(tmp_path):
    """evaluate()'s step-1 agreement is the share of answer tokens (from the second on: the first comes from the
    prefill) that the draft proposes from the true features, a target token outside the subset being a miss: the same
    rows at every depth, counted directly here."""
    target = tiny_llama(VOCAB, seed=5, sharpness=6.0)
    samples = greedy_samples(target, n=24, length=12)
    data = distill.build_features(target, samples, tmp_path)
    subset = distill.choose_subset(samples, data["top1"], 12, VOCAB, [0])
    sub_index = distill.subset_index(build_head(target, subset))
    answers = torch.tensor([t for s in samples for t in s["ids"][s["prompt_len"] :]])
    assert 0.1 < float((sub_index[answers] < 0).float().mean()) < 0.9  # some answer tokens lie outside it
    args = distill.parse_args(["--target", "x", "--out", "x", "--steps", "60", "--lr", "3e-3", "--eval-every", "60"])
    args.skip = 0
    torch.manual_seed(0)
    head = build_head(target, subset)
    distill.train(head, samples, data, args, torch.device("cpu"), lambda r: None)
    head.eval()
    hits, counts = [0, 0], [0, 0]  # tokens up to the end, and all but the last (a depth-2 row needs a next one)
    with torch.no_grad():
        for i, s in enumerate(samples):
            feats, tokens, *_ = distill._batch(samples, data, [i], 1 << 16, 0, 1, sub_index, torch.device("cpu"))
            drafted = head.subset[head.logits(head.unrolled(feats[:, :-1], tokens, 1)[0]).argmax(-1)][0]
            n, p = len(s["ids"]), s["prompt_len"]
            for q in range(p + 1, n):  # token q is drafted from row q - 2
                for j, last in enumerate((n - 1, n - 2)):
                    if q <= last:
                        hits[j] += int(drafted[q - 2] == s["ids"][q])
                        counts[j] += 1
    everything = list(range(len(samples)))
    for depth, j in ((1, 0), (2, 1)):
        args.depth = depth
        got = distill.evaluate(head, samples, data, everything, args, sub_index, torch.device("cpu"))
        assert got["top1_step"][0] == round(hits[j] / counts[j], 4)
    assert 0.2 < hits[0] / counts[0] < 0.9


def test_a_training_share_keeps_the_held_out_set_and_nests(tmp_path):
    import random

    samples = [{"stage": "self" if i % 2 else "simple"} for i in range(400)]
    held, train = distill.split_held_out(samples, random.Random(0))
    half, quarter = (distill.training_share(train, f, 8) for f in (0.5, 0.25))
    assert len(half) == 190 and len(quarter) == 95 and set(quarter) < set(half) < set(train)
    assert distill.training_share(train, 1.0, 8) == train and len(distill.training_share(train, 0.001, 8)) == 8
    target = tiny_llama(VOCAB, seed=5, sharpness=6.0)  # and train() logs and uses it, the held-out set unchanged
    samples = greedy_samples(target, n=48, length=8)
    data = distill.build_features(target, samples, tmp_path)
    args = distill.parse_args(["--target", "x", "--out", "x", "--steps", "2", "--train-fraction", "0.25"])
    args.skip, records = 0, []
    distill.train(build_head(target, distill.choose_subset(samples, data["top1"], 24, VOCAB, [0])), samples, data,
                  args, torch.device("cpu"), records.append)
    assert [r for r in records if r["event"] == "split"] == [{"event": "split", "held_out": 4, "training": 11}]


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


def test_plain_features_are_sliced_from_a_fused_cache(tmp_path, monkeypatch):
    """A cache recorded with more layers serves a prefix of them (here none: the final state alone) without running
    the target again, and the cache file keeps every layer until samples are added."""
    target = tiny_llama(VOCAB, seed=5, sharpness=6.0)
    samples = greedy_samples(target, n=6, length=8)
    fused = distill.build_features(target, samples, tmp_path, layers=(1,))
    (tmp_path / "fresh").mkdir()
    fresh = distill.build_features(target, samples, tmp_path / "fresh")

    def refuse(*a, **k):
        raise AssertionError("ran the target instead of slicing the cache")

    monkeypatch.setattr(distill, "target_features", refuse)
    plain = distill.build_features(target, samples, tmp_path)
    assert plain["layers"] == () and plain["features"][0].shape[-1] == fused["features"][0].shape[-1] // 2
    assert all(torch.equal(a, b) for a, b in zip(plain["features"], fresh["features"]))
    assert all(torch.equal(a, b) for a, b in zip(plain["top1"], fresh["top1"]))
    assert tuple(torch.load(tmp_path / "features.pt")["layers"]) == (1,)

    monkeypatch.undo()  # more samples: the sliced prefix is kept and only the new ones run through the target
    more = samples + greedy_samples(target, n=8, length=8)[6:]
    grown = distill.build_features(target, more, tmp_path)
    (tmp_path / "all").mkdir()
    whole = distill.build_features(target, more, tmp_path / "all")
    assert len(grown["features"]) == 8 and grown["layers"] == ()
    assert all(torch.allclose(a.float(), b.float(), atol=1e-3) for a, b in zip(grown["features"], whole["features"]))
    assert tuple(torch.load(tmp_path / "features.pt")["layers"]) == ()


def test_soft_label_loss_is_cross_entropy_to_the_target_distribution_and_trains(tmp_path):
    """--soft-weight 1: the token loss is the cross-entropy from the target's own distribution over the subset
    (its frozen head on the recorded final state) to the draft's, EAGLE's classification loss; a head trained on it
    alone still learns the target's greedy tokens (more slowly than on them directly on this flat random target:
    about 0.5 held-out agreement after 150 steps, against over 0.6)."""
    import torch.nn.functional as F

    target = tiny_llama(VOCAB, seed=5, sharpness=6.0)
    samples = greedy_samples(target, n=48, length=20)
    data = distill.build_features(target, samples, tmp_path)
    subset = distill.choose_subset(samples, data["top1"], 24, VOCAB, [0])
    torch.manual_seed(0)
    head = build_head(target, subset)
    sub_index = distill.subset_index(head)
    feats, tokens, labels, valid, t = distill._batch(samples, data, list(range(8)), 64, 0, 2, sub_index,
                                                     torch.device("cpu"))
    hard = distill._losses(head, feats, tokens, labels, valid, t, 2, 0.0, 0.5)
    soft = distill._losses(head, feats, tokens, labels, valid, t, 2, 0.0, 0.5, soft_weight=1.0)
    outs = head.unrolled(feats[:, :t], tokens, 2)
    for d, g in enumerate(outs, start=1):
        ok = valid[:, d : d + t]
        draft_logprobs = F.log_softmax(head.logits(g[ok]), dim=-1)
        target_probs = F.softmax(feats[:, d : d + t][ok] @ target.lm_head.weight[subset].T, dim=-1)
        assert torch.allclose(soft[d - 1][0], -(target_probs * draft_logprobs).sum(-1).mean(), rtol=1e-4)
        assert torch.allclose(hard[d - 1][0], F.nll_loss(draft_logprobs, labels[:, d : d + t][ok]), rtol=1e-4)
        assert torch.equal(soft[d - 1][1], hard[d - 1][1])  # the feature loss is unchanged

    args = distill.parse_args(["--target", "x", "--out", str(tmp_path), "--steps", "150", "--batch-size", "8",
                               "--eval-every", "150", "--log-every", "150", "--lr", "3e-3", "--soft-weight", "1"])
    args.skip = 0
    records = []
    final = distill.train(head, samples, data, args, torch.device("cpu"), records.append)
    assert [r for r in records if r["event"] == "eval"][0]["top1_step"][0] < 0.1 and final["top1_step"][0] > 0.4


def test_dropout_and_weight_decay_regularise_training_only(tmp_path):
    """--dropout acts while training and never while drafting; --weight-decay shrinks the weight matrices (not the
    norms); a head trained with both still learns the target."""
    target = tiny_llama(VOCAB, seed=5, sharpness=6.0)
    samples = greedy_samples(target, n=48, length=20)
    data = distill.build_features(target, samples, tmp_path)
    subset = distill.choose_subset(samples, data["top1"], 24, VOCAB, [0])
    heads = {}
    for wd in ("0", "0.5"):
        args = distill.parse_args(["--target", "x", "--out", str(tmp_path), "--steps", "150", "--batch-size", "8",
                                   "--eval-every", "150", "--log-every", "150", "--lr", "3e-3", "--dropout", "0.1",
                                   "--weight-decay", wd])
        args.skip = 0
        torch.manual_seed(0)
        head = build_head(target, subset)
        final = distill.train(head, samples, data, args, torch.device("cpu"), lambda r: None)
        assert final["top1_step"][0] > 0.5  # learned despite the regularisation (over 0.6 without it)
        heads[wd] = head
    head = heads["0"]
    assert head.layer.dropout == 0.1
    feats, tokens, _, _, t = distill._batch(samples, data, list(range(4)), 64, 0, 1, distill.subset_index(head),
                                            torch.device("cpu"))
    draft = lambda: head(feats[:, :t], tokens[:, 1 : t + 1], torch.arange(t))[0]  # noqa: E731
    with torch.no_grad():
        head.train()
        assert not torch.equal(draft(), draft())
        head.eval()  # as every drafter holds it: the same input gives the same draft
        assert torch.equal(draft(), draft())
    norm = lambda h: sum(float(p.norm()) for p in h.parameters() if p.ndim >= 2)  # noqa: E731
    assert norm(heads["0.5"]) < 0.95 * norm(heads["0"])


def test_head_can_start_as_a_copy_of_a_target_layer():
    """--init-layer -1: the head's decoder layer and final norm start as the target's last layer and final norm."""
    from specdemo.eagle import init_from_target_layer

    target = tiny_llama(VOCAB, seed=5, sharpness=6.0)
    head = build_head(target, torch.arange(24))
    init_from_target_layer(head, target, -1)
    last = target.model.layers[-1]
    assert torch.equal(head.layer.q_proj.weight, last.self_attn.q_proj.weight)
    assert torch.equal(head.layer.down_proj.weight, last.mlp.down_proj.weight)
    assert torch.equal(head.layer.post_norm.weight, last.post_attention_layernorm.weight)
    assert torch.equal(head.norm.weight, target.model.norm.weight)
    head.layer.q_proj.weight.data.add_(1.0)  # a copy: training the head leaves the target alone
    assert not torch.equal(head.layer.q_proj.weight, last.self_attn.q_proj.weight)


def test_steered_self_instructions_start_with_an_opening_and_continue_it(tmp_path):
    """With openings, each user turn starts with one of them and the target writes the rest; drawn per row, so a
    batch mixes them, and a rerun reads the same rows from the cache."""
    target = tiny_llama(VOCAB, seed=6, sharpness=1.0)
    tok = tiny_tokenizer([f"w{i}" for i in range(1, VOCAB)])
    tok.chat_template = ("{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}"
                         "{% if add_generation_prompt %}w3 {% endif %}")
    openings = ["w5 w6", "w7", "w8 w9 w10"]
    path, log = tmp_path / "steered.jsonl", []
    rows = distill.self_instructions(target, tok, 8, 8, 0, path, log.append, max_tokens=16, openings=openings)
    assert len(rows) == len(set(rows)) == 8
    starts = [next(o for o in openings if r.startswith(o + " ")) for r in rows]  # an opening, then the target's words
    assert len(set(starts)) > 1
    assert all(len(r) > len(s) + 1 for r, s in zip(rows, starts))
    assert distill.self_instructions(target, tok, 8, 8, 0, path, log.append, max_tokens=16, openings=openings) == rows


def test_training_instructions_never_contain_an_evaluation_prompt():
    """The project's own training instructions share at most 60% of their words with any prompt of the evaluation
    sets (specdemo/data/prompts: dev.jsonl and independent.jsonl): the templated ones at the default seed and scale,
    every templated stage, and below 45% for the three helper-written files. A shared template such as
    "Write a short poem about X" scores 0.56; the JSON-of-a-book instruction that nearly copied a dev prompt, and was
    removed, scored 0.71; helper-written requests at 0.45 or more were dropped from their file (the closest, a git
    question, scored 0.86). The paragraphs the target writes for the extractive and multi-turn instructions are left
    empty: only the templates' own words are compared."""
    import random
    import re
    from specdemo.prompts import DEFAULT_PROMPTS, INDEPENDENT_PROMPTS, read_prompts

    evaluation = [p.prompt for p in read_prompts(INDEPENDENT_PROMPTS)]
    assert len(evaluation) == 30
    dev = [p.prompt for p in read_prompts(DEFAULT_PROMPTS)]  # in the repository: no ../shared needed
    assert len(dev) == 30
    evaluation += dev
    args = distill.parse_args(["--target", "x", "--out", "y"])  # the default seed and scale
    rng = random.Random(args.seed)
    simple, sampled = distill.templated_prompts(rng, args.seed, args.scale)
    text = distill.text_prompts(rng, [""] * distill.PARAGRAPHS, args.scale)  # the same draws as build_data
    convs = [m for _, m in simple + sampled + text] + distill.paragraph_prompts()
    assert len(convs) == 612
    templated = [turn["content"] for m in convs for turn in m if turn["role"] == "user"]
    written = distill.read_instructions(str(distill.WRITTEN))
    second = distill.read_instructions(str(distill.WRITTEN_2))
    third = distill.read_instructions(str(distill.WRITTEN_3))
    assert (len(written), len(second), len(third)) == (2974, 2978, 2989)
    assert not set(written) & set(second) and not (set(written) | set(second)) & set(third)
    words = lambda text: set(re.findall(r"[a-z0-9]+", text.lower()))  # noqa: E731
    evaluation_words = [(e, words(e)) for e in evaluation]  # each text split into words once, not once per pair

    def closest(training):
        return max((len(w & ew) / len(w | ew), t, e)
                   for t, w in ((t, words(t)) for t in training) for e, ew in evaluation_words)

    assert closest(templated)[0] < 0.6, closest(templated)
    assert closest(written)[0] < 0.45, closest(written)
    assert closest(second)[0] < 0.45, closest(second)
    assert closest(third)[0] < 0.45, closest(third)


def test_batched_answers_are_each_prompts_own_greedy_answer_without_a_pad_token():
    """Left-padded batches give every conversation the answer it gets alone, also from a tokenizer with no pad token
    (as transformers 5.17 converts the bundled GGUF's)."""
    target = tiny_llama(VOCAB, seed=5, sharpness=6.0)
    tok = tiny_tokenizer([f"w{i}" for i in range(1, VOCAB)])
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    assert tok.pad_token is None
    convs = [[{"role": "user", "content": "w3 w5 w7 w9 w11 w2"}], [{"role": "user", "content": "w4"}]]
    batched = distill._generate(target, tok, convs, max_new_tokens=6, batch_size=2)
    alone = [distill._generate(target, tok, [c], max_new_tokens=6, batch_size=1)[0] for c in convs]
    assert batched == alone
    assert [r["prompt_len"] for r in batched] == [6, 1] and all(len(r["ids"]) > r["prompt_len"] for r in batched)


def test_time_budget_uses_the_pace_after_warm_up(tmp_path, monkeypatch):
    """--train-minutes sizes the run from the pace of steps 11-30, not the first ten: on a GPU those are several
    times slower (0.88 s against 0.10 s a step on the H200), which cut a 1-minute budget to 68 steps."""
    import types

    target = tiny_llama(VOCAB, seed=5, sharpness=6.0)
    samples = greedy_samples(target, n=24, length=12)
    data = distill.build_features(target, samples, tmp_path)
    subset = distill.choose_subset(samples, data["top1"], 24, VOCAB, [0])
    args = distill.parse_args(["--target", "x", "--out", str(tmp_path), "--steps", "500", "--batch-size", "4",
                               "--eval-every", "1000", "--train-minutes", "1"])
    args.skip = 0
    clock = [0.0]
    monkeypatch.setattr(distill, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    losses, calls = distill._losses, [0]

    def slow_start(*a, **kw):  # steps 1-10 take 5 s each, later ones 0.1 s
        calls[0] += 1
        clock[0] += 5.0 if calls[0] <= 10 else 0.1
        return losses(*a, **kw)

    monkeypatch.setattr(distill, "_losses", slow_start)
    records = []
    distill.train(build_head(target, subset), samples, data, args, torch.device("cpu"), records.append)
    budget = next(r for r in records if r["event"] == "budget")
    assert budget["seconds_per_step"] == 0.1
    assert 100 <= budget["steps"] <= 110  # 52 s spent by step 30, 8 s left at 0.1 s a step: 30 + 80
    assert calls[0] == budget["steps"]


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
    rounding) as build_features' own pass over the finished sequences; answers are `_generate`'s, shortest prompt
    first, some ended by EOS; the sampled stage still labels each position with the greedy token."""
    target, tok, convs = _recording_setup()
    path, samples, log = tmp_path / "samples.jsonl", [], []
    distill._run_stage("s", convs, target, tok, 8, 4, 0.0, 0, path, samples, log.append, record=True)
    reference = distill._generate(target, tok, convs, 8, batch_size=6)
    order = sorted(range(len(convs)), key=lambda i: reference[i]["prompt_len"])
    assert [{"ids": s["ids"], "prompt_len": s["prompt_len"]} for s in samples] == [reference[i] for i in order]
    assert any(s["ids"][-1] == 0 for s in samples) and any(len(s["ids"]) - s["prompt_len"] == 8 for s in samples)
    assert len(list((tmp_path / distill.RECORDED).iterdir())) == 2  # a file per batch until features.pt holds them
    data = distill.build_features(target, samples, tmp_path)
    assert not (tmp_path / distill.RECORDED).exists()
    plain = [{"ids": s["ids"], "prompt_len": s["prompt_len"]} for s in samples]
    (tmp_path / "separate").mkdir()
    separate = distill.build_features(target, plain, tmp_path / "separate")
    for s, a, b, la, lb in zip(samples, data["features"], separate["features"], data["top1"], separate["top1"]):
        assert a.shape == b.shape == (len(s["ids"]), 32) and torch.allclose(a.float(), b.float(), atol=2e-3)
        assert torch.equal(la, lb)
    assert distill.build_features(target, samples, tmp_path)["top1"][0].tolist() == data["top1"][0].tolist()  # cached

    two = distill._prompt_ids(tok, convs[:2])
    sampled, _ = distill._generate_recorded(target, tok, two, 8, sample_temp=1.5, seed=3)
    again, recorded = distill._generate_recorded(target, tok, two, 8, sample_temp=1.5, seed=3)
    assert sampled == again  # seeded
    (tmp_path / "sampled").mkdir()
    greedy = distill.build_features(target, [{**s, "stage": "x"} for s in again], tmp_path / "sampled")
    assert all(torch.equal(top, g) for (_, top), g in zip(recorded, greedy["top1"]))


def test_a_recorded_stage_whose_list_grew_answers_only_the_new_prompts(tmp_path):
    """A cache recorded for a stage's first four conversations, then the stage run with six (a new instructions
    file appended): the new ones sort between the cached ones by length, yet only they are answered, once each, and
    the features cached for the first four stay valid for the grown list. Copies of a conversation are counted, and
    the other --features mode resumes the same cache."""
    target, tok, convs = _recording_setup()
    path, samples, log = tmp_path / "samples.jsonl", [], []
    distill._run_stage("s", convs[:4], target, tok, 8, 3, 0.0, 0, path, samples, log.append, record=True)
    first = distill.build_features(target, samples, tmp_path)
    distill._run_stage("s", convs, target, tok, 8, 3, 0.0, 0, path, samples, log.append, record=True)
    assert [r["sequences"] for r in log] == [3, 4, 6]  # one batch of the two new prompts
    reference = distill._generate(target, tok, convs, 8, batch_size=6)
    assert sorted(s["ids"] for s in samples) == sorted(r["ids"] for r in reference)  # each prompt answered once
    assert distill._jsonl_load(path) == samples
    grown = distill.build_features(target, samples, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(first["features"], grown["features"][:4]))
    (tmp_path / "separate").mkdir()  # the new ones were read from their file: a pass of the target agrees
    separate = distill.build_features(target, [{"ids": s["ids"], "prompt_len": s["prompt_len"]} for s in samples[4:]],
                                      tmp_path / "separate")
    for f, top, g, gtop in zip(grown["features"][4:], grown["top1"][4:], separate["features"], separate["top1"]):
        assert torch.allclose(f.float(), g.float(), atol=2e-3) and torch.equal(top, gtop)

    # Cut short after its first batch (the three shortest prompts), a stage resumes in the other mode, in file order;
    # a conversation listed twice is answered twice, also when one copy was cached.
    listed = [convs[1], *convs, convs[4]]
    path, samples = tmp_path / "cut.jsonl", []
    distill._run_stage("c", listed, target, tok, 8, 3, 0.0, 0, path, samples, [].append, max_sequences=3, record=True)
    assert sorted(s["ids"] for s in samples) == sorted(reference[i]["ids"] for i in (1, 1, 4))
    distill._run_stage("c", listed, target, tok, 8, 3, 0.0, 0, path, samples, [].append, record=False)
    assert sorted(s["ids"] for s in samples) == sorted(r["ids"] for r in [*reference, reference[1], reference[4]])
    assert [s["ids"] for s in samples[3:]] == [reference[i]["ids"] for i in (0, 2, 3, 5, 4)]  # the cached copy of 4 first
