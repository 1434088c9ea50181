"""distill.cli: the flags become one frozen TrainConfig with TrainConfig's defaults, a whole run on a tiny model folder
writes a lossless asset, and `distill agreement` measures it on a prompt set and on the run's held-out split."""

import dataclasses
import json

import pytest
import torch
from conftest import tiny_llama, tiny_tokenizer

from specdemo.config import GenerationConfig
from specdemo.engine import autoregressive, encode_prompt, generated_ids, speculative
from specdemo.models.loading import load_model
from specdemo.train import TrainConfig, agreement, cli, heads, main, training

VOCAB = 40
cells = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]  # noqa: E731  (a markdown table row)
TEMPLATE = ("{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}"
            "{% if add_generation_prompt %}w3 {% endif %}")


def test_the_shipped_recipe_is_the_default():
    config = cli.parse_config(["--target", "x", "--out", "y"])
    assert (config.self_instruct, config.instructions, config.features, config.steps, config.fuse_layers) == (
        0, "written,written2", "writer", 4000, "")  # no aux layers given: vLLM's default (2, L // 2, L - 3)
    assert config == TrainConfig(target="x", out="y")  # every flag's default is TrainConfig's


def test_every_flag_is_a_field_of_one_frozen_config():
    """One flag per TrainConfig field, parsed to the field's type; the config cannot be changed on the way down."""
    flags = {a.dest for a in cli.train_parser()._actions if a.dest != "help"}
    assert flags == {f.name for f in dataclasses.fields(TrainConfig)}
    config = cli.parse_config(["--target", "t", "--out", "o", "--fuse-layers", "3, 7", "--lr", "1e-3", "--steps", "9",
                               "--init-layer", "-1", "--data-only"])
    assert (config.layers, config.lr, config.steps, config.init_layer, config.data_only) == ((3, 7), 1e-3, 9, -1, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.skip = 3


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny target saved as a model folder, and one whole `distill` run on it (its asset in out/)."""
    root = tmp_path_factory.mktemp("distill_cli")
    target = tiny_llama(VOCAB, seed=5, sharpness=6.0)
    tok = tiny_tokenizer([f"w{i}" for i in range(1, VOCAB)])
    tok.chat_template = TEMPLATE
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    argv = ["--target", str(root / "target"), "--out", str(root / "out"), "--device", "cpu", "--scale", "0.05",
            "--max-new-tokens", "8", "--gen-batch-size", "16", "--self-instruct", "4", "--instructions", "",
            "--subset-size", "24", "--steps", "40", "--batch-size", "4", "--eval-every", "20", "--log-every", "20",
            "--lr", "3e-3", "--seed", "1",
            "--fuse-layers", "1"]  # a 2-layer target has no 3 distinct default aux layers
    torch.manual_seed(0)
    assert main(argv) == 0
    return root, argv


def test_a_run_logs_its_config_and_writes_a_lossless_asset(tiny_run):
    """The run's log starts with its TrainConfig, goes through every stage, and its asset drafts for the target
    without changing the target's greedy output."""
    root, argv = tiny_run
    records = [json.loads(line) for line in (root / "out" / "train_log.jsonl").read_text().splitlines()]
    assert records[0]["event"] == "start" and records[0]["args"] == dataclasses.asdict(cli.parse_config(argv))
    events = {r["event"] for r in records}
    assert {"generated", "instructions", "features", "split", "eval", "done"} <= events
    assert {r["stage"] for r in records if r["event"] == "generated"} >= {"paragraph", "self"}
    assert json.loads((root / "out" / "specdemo.json").read_text())["step"] == 40

    loaded = load_model(str(root / "target"), device="cpu", dtype="fp32")
    drafter = heads.load_drafter(str(root / "out"), loaded)
    assert drafter.name == "eagle3" and drafter.target_layers == (1,)
    config = GenerationConfig(max_new_tokens=16, num_draft_tokens=3)
    prompt = loaded.tokenizer("w3 w5 w7 w9").input_ids
    ar = generated_ids(list(autoregressive(loaded.model, loaded.tokenizer, prompt, config)))
    assert generated_ids(list(speculative(loaded.model, loaded.tokenizer, drafter, prompt, config))) == ar


def test_agreement_on_a_prompt_set_by_category(tiny_run, tmp_path, capsys):
    """`distill agreement` answers each prompt with the target's greedy output and scores the draft along it as
    evaluate() does: one row for all prompts and one per category, with their counts."""
    root, _ = tiny_run
    prompts = tmp_path / "prompts.jsonl"
    rows = [("a", "w3 w5 w7"), ("a", "w9 w2"), ("b", "w12 w30 w31"), ("b", "w4 w4 w8"), ("b", "w20")]
    prompts.write_text("".join(json.dumps({"prompt": p, "category": c}) + "\n" for c, p in rows))
    md = tmp_path / "agreement.md"
    assert main(["agreement", "--target", str(root / "target"), "--draft", str(root / "out"), "--prompts",
                 str(prompts), "--max-new-tokens", "10", "--depth", "2", "--device", "cpu", "--out", str(md)]) == 0
    printed = capsys.readouterr().out
    text = md.read_text()
    assert text.startswith("`python -m specdemo distill agreement --target") and printed in text
    table = {cells(line)[0]: cells(line) for line in printed.splitlines()[2:]}
    assert list(table) == ["all", "a", "b"] and [table[k][1] for k in table] == ["5", "2", "3"]

    loaded = load_model(str(root / "target"), device="cpu", dtype="fp32")
    drafter = heads.load_drafter(str(root / "out"), loaded)
    head = heads.evaluable(drafter.head, loaded.model)
    from specdemo.prompts import read_prompts

    samples = agreement.target_answers(loaded.model, loaded.tokenizer, read_prompts(prompts), 10)
    config = GenerationConfig(max_new_tokens=10)
    for s, (_, p) in zip(samples, rows):  # the target's own greedy answers
        ids = encode_prompt(loaded.tokenizer, p)
        assert s["ids"] == ids + generated_ids(list(autoregressive(loaded.model, loaded.tokenizer, ids, config)))
    data = agreement.answer_features(loaded.model, samples, drafter.target_layers)
    m = training.evaluate(head, samples, data, list(range(5)), training.subset_index(head), loaded.device, depth=2,
                          batch_size=1, max_len=1 << 16, skip=0)
    assert table["all"][2] == " / ".join(f"{x:.3f}" for x in m["top1_step"])
    assert table["all"][3] == " / ".join(f"{x:.3f}" for x in m["chain"])


def test_agreement_on_a_runs_held_out_split(tiny_run, capsys):
    """--held-out CACHE scores each draft on the run's own held-out split, with distill's defaults."""
    root, _ = tiny_run
    assert main(["agreement", "--target", str(root / "target"), "--draft", str(root / "out"), "--held-out",
                 str(root / "out" / "cache"), "--depth", "2", "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| draft | held-out top-1 agreement, steps 1..2 |") and len(lines) == 3
    top1, chain = ([float(x) for x in cell.split(" / ")] for cell in cells(lines[2])[1:3])
    assert len(top1) == len(chain) == 2 and all(0 <= c <= t <= 1 for t, c in zip(top1, chain))
