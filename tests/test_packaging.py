"""The package as `pip install .` makes it: pyproject.toml's dependencies are requirements.txt's, and an installed
copy (outside the clone) finds the bundled model and the shipped trained draft and runs `specdemo generate` offline."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def requirement_lines(path: Path) -> list[str]:
    return [line.split("#")[0].strip() for line in path.read_text().splitlines() if line.split("#")[0].strip()]


def test_pyproject_declares_what_requirements_txt_installs():
    """One list of runtime dependencies: a Space installs requirements.txt, `pip install .` reads pyproject.toml."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["dependencies"] == requirement_lines(ROOT / "requirements.txt")
    assert project["optional-dependencies"]["test"] == requirement_lines(ROOT / "requirements-dev.txt")
    assert project["scripts"]["specdemo"] == "specdemo.__main__:main"


@pytest.mark.slow
def test_an_installed_copy_runs_generate_offline_with_the_shipped_draft(tmp_path):
    """`pip install .` (the package alone, built as pip builds it, from PyPI's setuptools; its dependencies come from
    this environment through a .pth file rather than a second download of torch) into a new venv, then the `specdemo`
    command from a folder outside the clone: the trained draft is package data there, greedy output equals the
    target's own, and the `--json` line has the documented keys (the suite's one `generate --json` outside the timed
    browser test, which runs the clone's)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "here-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # torch, transformers, ... from here
    source = tmp_path / "source"  # a copy, so that the build's own folders (build/, *.egg-info) stay out of the clone
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "specdemo", source / "specdemo", ignore=shutil.ignore_patterns("__pycache__"))
    install = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(source)],
                             capture_output=True, text=True, cwd=tmp_path)
    assert install.returncode == 0, install.stderr[-3000:]
    installed = site / "specdemo"
    assert (installed / "data" / "smollm2-135m-draft" / "model.safetensors").stat().st_size > 10_000_000
    assert (installed / "data" / "prompts" / "dev.jsonl").exists()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_HUB_OFFLINE": "1"}
    out = subprocess.run([str(venv / "bin" / "specdemo"), "generate", "--prompt", "Write a haiku about rain", "--k",
                          "2", "--max-new-tokens", "16", "--json"], capture_output=True, text=True, cwd=tmp_path,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])  # the last line: one JSON object, the documented keys
    for key in ("target", "draft", "drafter", "k", "temperature", "device", "ar", "sd", "speedup", "identical"):
        assert key in result
    assert set(result["ar"]) >= {"text", "tokens", "seconds", "tokens_per_s"}
    assert set(result["sd"]) >= {"text", "tokens", "seconds", "tokens_per_s", "acceptance_rate", "mean_accepted",
                                 "steps"}
    assert result["draft"] == "smollm2-135m-draft" and result["identical"] is True and result["sd"]["tokens"] == 16
    assert result["ar"]["text"] == result["sd"]["text"]
    where = subprocess.run([str(py), "-c", "import specdemo, sys; print(specdemo.__file__)"], capture_output=True,
                           text=True, cwd=tmp_path, env=env).stdout
    assert where.startswith(str(site)), where  # the installed copy ran, not the clone
