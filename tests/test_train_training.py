"""distill.training on a tiny random llama: the EAGLE-3 head learns the target's own answers (answer-only loss,
held-out agreement rises, the checkpoint drafts losslessly), the held-out split, the agreement figure (a target token
outside the draft vocabulary a miss), the losses, weight decay and the time budget."""

import json

import torch
from conftest import tiny_llama, tiny_tokenizer
from test_train_features import (
    AUX,
    VOCAB,
    assert_drafts_losslessly,
    eagle3_trainee,
    greedy_samples,
)

from specdemo.drafters.eagle3 import load_eagle3
from specdemo.models.loading import LoadedModel
from specdemo.train import cli, features, heads, training


def test_distill_learns_the_target_and_writes_a_lossless_draft(tmp_path):
    target = tiny_llama(VOCAB, seed=5, sharpness=6.0)
    samples = greedy_samples(target, n=48, length=20)
    data = features.build_features(target, samples, tmp_path, layers=AUX)
    assert (tmp_path / "features.pt").exists()
    # the recorded labels are the target's greedy tokens: along a greedy answer they are the next answer token
    s, top1 = samples[0], data["top1"][0]
    assert top1[s["prompt_len"] - 1 : -1].tolist() == s["ids"][s["prompt_len"] :]

    subset = features.choose_subset(samples, data["top1"], 24, VOCAB, [0])
    assert 0 in subset.tolist() and len(set(subset.tolist())) == 24
    config = cli.parse_config(["--target", "x", "--out", str(tmp_path), "--steps", "150", "--batch-size", "8",
                               "--eval-every", "150", "--log-every", "50", "--lr", "3e-3", "--fuse-layers", "1"])
    torch.manual_seed(0)
    head, save = heads.build(config, target, subset, data)
    records = []
    final = training.train(head, samples, data, config, torch.device("cpu"), records.append,
                          lambda step, m: save(str(tmp_path / "head"), {"target": "tiny", "step": step, "metrics": m}))
    evals = [r for r in records if r["event"] == "eval"]
    assert evals[0]["top1_step"][0] < 0.3 and final["top1_step"][0] > 0.6  # held-out agreement learned, not given
    assert json.loads((tmp_path / "head" / "specdemo.json").read_text())["step"] == 150

    tok = tiny_tokenizer([f"w{i}" for i in range(1, VOCAB)])
    drafter = load_eagle3(tmp_path / "head", LoadedModel("tiny", target, tok, torch.device("cpu"), torch.float32,
                                                         "test"))
    assert_drafts_losslessly(target, tok, drafter, samples)


def test_held_out_split_prefers_self_written_instructions():
    import random

    samples = [{"stage": "self" if i % 3 == 0 else "simple"} for i in range(300)]
    held, train = training.split_held_out(samples, random.Random(0))
    assert len(held) == 15 and all(samples[i]["stage"] == "self" for i in held)
    assert not set(held) & set(train) and len(held) + len(train) == 300
    assert training.split_held_out(samples, random.Random(0)) == (held, train)  # reproducible
    few = [{"stage": "self" if i < 10 else "simple"} for i in range(300)]  # too few of them: a plain random split
    held, train = training.split_held_out(few, random.Random(0))
    assert len(held) == 15 and any(few[i]["stage"] == "simple" for i in held)
    mixed = [{"stage": ("self", "written", "simple")[i % 3]} for i in range(300)]  # file-given ones count as own
    held, _ = training.split_held_out(mixed, random.Random(0))
    assert {mixed[i]["stage"] for i in held} <= {"self", "written"}


def test_agreement_counts_every_draftable_token_and_misses_outside_the_subset(tmp_path):
    """evaluate()'s step-1 agreement is the share of answer tokens (from the second on: the first comes from the
    prefill) that the draft proposes from the true features, a target token outside the subset being a miss: the same
    rows at every depth, counted directly here."""
    target = tiny_llama(VOCAB, seed=5, sharpness=6.0)
    samples = greedy_samples(target, n=24, length=12)
    data = features.build_features(target, samples, tmp_path, layers=AUX)
    subset = features.choose_subset(samples, data["top1"], 12, VOCAB, [0])
    sub_index = training.subset_index(eagle3_trainee(target, subset, data))
    answers = torch.tensor([t for s in samples for t in s["ids"][s["prompt_len"] :]])
    assert 0.1 < float((sub_index[answers] < 0).float().mean()) < 0.9  # some answer tokens lie outside it
    config = cli.parse_config(["--target", "x", "--out", "x", "--steps", "60", "--lr", "3e-3", "--eval-every", "60"])
    torch.manual_seed(0)
    head = eagle3_trainee(target, subset, data)
    training.train(head, samples, data, config, torch.device("cpu"), lambda r: None)
    head.eval()
    hits, counts = [0, 0], [0, 0]  # tokens up to the end, and all but the last (a depth-2 row needs a next one)
    with torch.no_grad():
        for i, s in enumerate(samples):
            feats, tokens, *_ = training.padded_batch(samples, data, [i], 1 << 16, 0, 1, sub_index, torch.device("cpu"))
            drafted = head.subset[head.logits(head.unrolled(feats[:, :-1], tokens, 1)[0]).argmax(-1)][0]
            n, p = len(s["ids"]), s["prompt_len"]
            for q in range(p + 1, n):  # token q is drafted from row q - 2
                for j, last in enumerate((n - 1, n - 2)):
                    if q <= last:
                        hits[j] += int(drafted[q - 2] == s["ids"][q])
                        counts[j] += 1
    everything = list(range(len(samples)))
    for depth, j in ((1, 0), (2, 1)):
        got = training.evaluate(head, samples, data, everything, sub_index, torch.device("cpu"), depth=depth,
                                batch_size=config.batch_size, max_len=config.max_len, skip=config.skip)
        assert got["top1_step"][0] == round(hits[j] / counts[j], 4)
    assert 0.2 < hits[0] / counts[0] < 0.9


def test_a_training_share_keeps_the_held_out_set_and_nests(tmp_path):
    import random

    samples = [{"stage": "self" if i % 2 else "simple"} for i in range(400)]
    held, train = training.split_held_out(samples, random.Random(0))
    half, quarter = (training.training_share(train, f, 8) for f in (0.5, 0.25))
    assert len(half) == 190 and len(quarter) == 95 and set(quarter) < set(half) < set(train)
    assert training.training_share(train, 1.0, 8) == train and len(training.training_share(train, 0.001, 8)) == 8
    target = tiny_llama(VOCAB, seed=5, sharpness=6.0)  # and train() logs and uses it, the held-out set unchanged
    samples = greedy_samples(target, n=48, length=8)
    data = features.build_features(target, samples, tmp_path, layers=AUX)
    config = cli.parse_config(["--target", "x", "--out", "x", "--steps", "2", "--train-fraction", "0.25"])
    records = []
    subset = features.choose_subset(samples, data["top1"], 24, VOCAB, [0])
    training.train(eagle3_trainee(target, subset, data), samples, data, config, torch.device("cpu"), records.append)
    assert [r for r in records if r["event"] == "split"] == [{"event": "split", "held_out": 4, "training": 11}]


def test_soft_label_loss_is_cross_entropy_to_the_target_distribution_and_trains(tmp_path):
    """--soft-weight 1: the token loss is the cross-entropy from the target's own distribution over the subset
    (its frozen head on the recorded final state) to the draft's, EAGLE's classification loss; a head trained on it
    alone still learns the target's greedy tokens (more slowly than on them directly on this flat random target:
    about 0.5 held-out agreement after 150 steps, against over 0.6)."""
    import torch.nn.functional as F

    target = tiny_llama(VOCAB, seed=5, sharpness=6.0)
    samples = greedy_samples(target, n=48, length=20)
    data = features.build_features(target, samples, tmp_path, layers=AUX)
    subset = features.choose_subset(samples, data["top1"], 24, VOCAB, [0])
    torch.manual_seed(0)
    head = eagle3_trainee(target, subset, data)
    sub_index = training.subset_index(head)
    feats, tokens, labels, valid, t = training.padded_batch(samples, data, list(range(8)), 64, 0, 2, sub_index,
                                                     torch.device("cpu"))
    hard = training.losses(head, feats, tokens, labels, valid, t, 2, 0.0, 0.5)
    soft = training.losses(head, feats, tokens, labels, valid, t, 2, 0.0, 0.5, soft_weight=1.0)
    outs = head.unrolled(feats[:, :t], tokens, 2)
    for d, g in enumerate(outs, start=1):
        ok = valid[:, d : d + t]
        draft_logprobs = F.log_softmax(head.logits(g[ok]), dim=-1)
        final = feats[:, d : d + t, :32][ok]  # the target's final hidden state (the aux states follow it)
        target_probs = F.softmax(final @ target.lm_head.weight[subset].T, dim=-1)
        assert torch.allclose(soft[d - 1][0], -(target_probs * draft_logprobs).sum(-1).mean(), rtol=1e-4)
        assert torch.allclose(hard[d - 1][0], F.nll_loss(draft_logprobs, labels[:, d : d + t][ok]), rtol=1e-4)
        assert torch.equal(soft[d - 1][1], hard[d - 1][1])  # the feature loss is unchanged

    config = cli.parse_config(["--target", "x", "--out", str(tmp_path), "--steps", "150", "--batch-size", "8",
                               "--eval-every", "150", "--log-every", "150", "--lr", "3e-3", "--soft-weight", "1"])
    records = []
    final = training.train(head, samples, data, config, torch.device("cpu"), records.append)
    assert [r for r in records if r["event"] == "eval"][0]["top1_step"][0] < 0.1 and final["top1_step"][0] > 0.4


def test_weight_decay_shrinks_the_weight_matrices_and_the_head_still_learns(tmp_path):
    """--weight-decay shrinks the trained weight matrices (not the norms, nor the frozen lm_head); a head trained with
    it still learns the target."""
    target = tiny_llama(VOCAB, seed=5, sharpness=6.0)
    samples = greedy_samples(target, n=48, length=20)
    data = features.build_features(target, samples, tmp_path, layers=AUX)
    subset = features.choose_subset(samples, data["top1"], 24, VOCAB, [0])
    trained = {}
    for wd in ("0", "0.5"):
        config = cli.parse_config(["--target", "x", "--out", str(tmp_path), "--steps", "150", "--batch-size", "8",
                                   "--eval-every", "150", "--log-every", "150", "--lr", "3e-3", "--weight-decay", wd])
        torch.manual_seed(0)
        head = eagle3_trainee(target, subset, data)
        final = training.train(head, samples, data, config, torch.device("cpu"), lambda r: None)
        assert final["top1_step"][0] > 0.5  # learned despite the regularisation
        trained[wd] = head

    def norm(h):
        return sum(float(p.detach().norm()) for p in h.parameters() if p.ndim >= 2 and p.requires_grad)

    assert norm(trained["0.5"]) < 0.95 * norm(trained["0"])
    assert torch.equal(trained["0.5"].head.lm_head.weight, trained["0"].head.lm_head.weight)  # frozen in both


def test_time_budget_uses_the_pace_after_warm_up(tmp_path, monkeypatch):
    """--train-minutes sizes the run from the pace of steps 11-30, not the first ten: on a GPU those are several
    times slower (0.88 s against 0.10 s a step on the H200), which cut a 1-minute budget to 68 steps."""
    import types

    target = tiny_llama(VOCAB, seed=5, sharpness=6.0)
    samples = greedy_samples(target, n=24, length=12)
    data = features.build_features(target, samples, tmp_path, layers=AUX)
    subset = features.choose_subset(samples, data["top1"], 24, VOCAB, [0])
    config = cli.parse_config(["--target", "x", "--out", str(tmp_path), "--steps", "500", "--batch-size", "4",
                               "--eval-every", "1000", "--train-minutes", "1"])
    clock = [0.0]
    monkeypatch.setattr(training, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    losses, calls = training.losses, [0]

    def slow_start(*a, **kw):  # steps 1-10 take 5 s each, later ones 0.1 s
        calls[0] += 1
        clock[0] += 5.0 if calls[0] <= 10 else 0.1
        return losses(*a, **kw)

    monkeypatch.setattr(training, "losses", slow_start)
    records = []
    training.train(eagle3_trainee(target, subset, data), samples, data, config, torch.device("cpu"), records.append)
    budget = next(r for r in records if r["event"] == "budget")
    assert budget["seconds_per_step"] == 0.1
    assert 100 <= budget["steps"] <= 110  # 52 s spent by step 30, 8 s left at 0.1 s a step: 30 + 80
    assert calls[0] == budget["steps"]
