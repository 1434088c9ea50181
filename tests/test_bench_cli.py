"""`python -m specdemo bench` from the command line: flags, defaults, errors, and a real run."""

import json
import subprocess
from pathlib import Path

import pytest

from specdemo.config import DEFAULT_DRAFTER, drafter_default
from specdemo.drafters.registry import names
from specdemo.measure.bench import main
from specdemo.measure.bench.cli import bench_config, parser
from specdemo.prompts import DEFAULT_PROMPTS


def test_defaults_come_from_the_config_and_need_nothing_outside_the_repository():
    """With no flags: the in-repo prompt set, a git-ignored output folder, the drafters the registry knows."""
    args = parser().parse_args([])
    bc = bench_config(args, env={})
    assert Path(bc.prompts) == DEFAULT_PROMPTS and DEFAULT_PROMPTS.exists()
    assert Path(__file__).resolve().parent.parent in DEFAULT_PROMPTS.resolve().parents  # inside the repository
    assert bc.out == "out/bench"
    ignored = subprocess.run(["git", "check-ignore", "-q", "out/bench/bench.json"], cwd=Path(__file__).parent.parent)
    assert ignored.returncode == 0
    assert parser()._option_string_actions["--drafter"].choices == names()
    # no --drafter or --k: the bundled target's trained draft at its measured k, as generate and the app start
    assert bc.drafter_kind == DEFAULT_DRAFTER and bc.k is None
    assert bc.starting_k()[0] == drafter_default(DEFAULT_DRAFTER).k
    assert bench_config(parser().parse_args(["--target", "org/other"]), env={}).drafter_kind == "ngram"
    assert bench_config(args, env={"SPECDEMO_FAST_LINEAR": "0"}).runtime.fast_linear is False


def test_main_refuses_bad_k(capsys):
    """An element of a k list out of range is refused with k's sentence, before any prompt is read."""
    assert main(["--k", "2,0", "--limit", "1", "--out", "/nonexistent/never"]) == 2
    assert capsys.readouterr().err == "error: k must be a whole number from 1 to 64, got 0.\n"


@pytest.mark.slow
def test_bench_cli_on_the_bundled_model(tmp_path):
    """The real CLI on 2 prompts: files written, greedy outputs identical, anchors present."""
    assert main(["--limit", "2", "--max-new-tokens", "16", "--drafter", "ngram", "--k", "2", "--anchors", "--out",
                 str(tmp_path), "--quiet"]) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert len(report["results"]) == 2
    assert report["overall"]["identical_fraction"] == 1.0
    assert report["anchors"]["hf_generate_identical_fraction"] == 1.0
    assert (tmp_path / "bench.md").exists() and (tmp_path / "bench.html").exists()
    assert not (tmp_path / "rows.partial.jsonl").exists()  # bench.json holds them


@pytest.mark.slow
def test_a_bench_stopped_early_leaves_the_rows_it_measured(tmp_path, monkeypatch):
    """A run stopped by a time limit (each stage of scripts/gpu_check.sh has one) still leaves every finished
    prompt's rows, in rows.partial.jsonl."""
    from specdemo.measure.bench import run

    real, calls = run.bench_prompt, []

    def stopped_at_the_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # as a signal stops it
        return real(*args, **kwargs)

    monkeypatch.setattr(run, "bench_prompt", stopped_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        main(["--limit", "2", "--max-new-tokens", "8", "--drafter", "ngram", "--k", "2", "--out", str(tmp_path),
              "--quiet"])
    rows = [json.loads(line) for line in (tmp_path / run.PARTIAL_ROWS).read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["identical"] and rows[0]["k"] == 2
    assert not (tmp_path / "bench.json").exists()
