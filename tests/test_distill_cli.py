"""distill.cli: the flags become one frozen TrainConfig with TrainConfig's defaults, and a whole run on a tiny model
folder writes a lossless asset."""

import dataclasses
import json

import pytest
import torch

from specdemo.config import GenerationConfig
from specdemo.distill import TrainConfig, cli, main
from specdemo.eagle import load_trained_draft
from specdemo.engine import autoregressive, generated_ids, speculative
from specdemo.loading import load_model

from conftest import tiny_llama, tiny_tokenizer

VOCAB = 40
TEMPLATE = ("{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}"
            "{% if add_generation_prompt %}w3 {% endif %}")


def test_the_shipped_recipe_is_the_default():
    config = cli.parse_config(["--target", "x", "--out", "y"])
    assert (config.self_instruct, config.instructions, config.features, config.steps) == (0, "written,written2",
                                                                                         "writer", 4000)
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
            "--lr", "3e-3", "--seed", "1"]
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
    assert json.loads((root / "out" / "eagle_config.json").read_text())["step"] == 40

    loaded = load_model(str(root / "target"), device="cpu", dtype="fp32")
    drafter = load_trained_draft(root / "out", loaded)
    config = GenerationConfig(max_new_tokens=16, num_draft_tokens=3)
    prompt = loaded.tokenizer("w3 w5 w7 w9").input_ids
    ar = generated_ids(list(autoregressive(loaded.model, loaded.tokenizer, prompt, config)))
    assert generated_ids(list(speculative(loaded.model, loaded.tokenizer, drafter, prompt, config))) == ar

