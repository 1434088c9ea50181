"""The limits the code base holds: no source file under specdemo/ or tests/ over 450 lines; gradio imported only in
app/ and app.py, plotly only in measure/charts.py and app/; README plus docs/*.md (docs/notes/ aside) at most 1,200
lines; every dotted `specdemo.` name the docs, docstrings and comments mention importable; ruff clean under
pyproject.toml's configuration."""

from __future__ import annotations

import ast
import importlib
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_FILE_LINES = 450
MAX_DOC_LINES = 1200
SOURCE = {".py", ".js", ".css", ".html", ".sh", ".md"}
FILE_NAMES = {"json", "jsonl", "md", "py", "txt", "html", "safetensors", "bin", "toml"}  # specdemo.json is a file


def source_files() -> list[Path]:
    """Every source file under specdemo/ and tests/ (specdemo/data/'s shipped data and generated folders aside)."""
    out = []
    for top in ("specdemo", "tests"):
        for path in (ROOT / top).rglob("*"):
            parts = path.relative_to(ROOT).parts
            if path.suffix in SOURCE and path.is_file() and parts[:2] != ("specdemo", "data") and not any(
                    p.startswith((".", "__pycache__")) or p == "artifacts" for p in parts):
                out.append(path)
    return out


def test_no_source_file_is_over_450_lines():
    """A file that long does more than one thing: split it along a seam."""
    long = {p.relative_to(ROOT).as_posix(): n for p in source_files()
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert long == {}


def importers_of(library: str) -> set[str]:
    found = set()
    for path in [*(ROOT / "specdemo").rglob("*.py"), ROOT / "app.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if node.__class__ is ast.ImportFrom and not node.level else [])
            if any(n == library or n.startswith(library + ".") for n in names):
                found.add(path.relative_to(ROOT).as_posix())
    return found


def test_gradio_only_in_the_app_and_plotly_only_in_charts_and_the_app():
    """Charts, render and race stay plain; the figures are measure/charts.py's, the bench's too."""
    gradio, plotly = importers_of("gradio"), importers_of("plotly")
    assert gradio and all(p.startswith("specdemo/app/") or p == "app.py" for p in gradio), gradio
    assert plotly and all(p == "specdemo/measure/charts.py" or p.startswith("specdemo/app/") for p in plotly), plotly


def docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_docs_fit_their_budget():
    """README plus the feature pages stay readable; history and detail go to docs/notes/, linked."""
    assert sum(len(p.read_text().splitlines()) for p in docs()) <= MAX_DOC_LINES


def mentions() -> list[tuple[str, str]]:
    """(where, text) of every doc, and of every docstring and comment in specdemo/, tests/, scripts/ and app.py."""
    out = [(p.relative_to(ROOT).as_posix(), p.read_text()) for p in docs()]
    for path in [*(ROOT / "specdemo").rglob("*.py"), *(ROOT / "tests").glob("*.py"), *(ROOT / "scripts").glob("*.py"),
                 ROOT / "app.py"]:
        where, source = path.relative_to(ROOT).as_posix(), path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((where, ast.get_docstring(node, clean=False) or ""))
        out += [(where, t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
                if t.type == tokenize.COMMENT]
    return out


def resolves(name: str) -> bool:
    """Whether a dotted name is a module, or an attribute path on its longest module prefix."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_dotted_specdemo_name_in_the_docs_and_docstrings_imports():
    """A module that moved leaves no stale dotted name behind (file names such as specdemo.json aside)."""
    stale = set()
    for where, text in mentions():
        for name in re.findall(r"(?<![\w./-])specdemo(?:\.[A-Za-z_]\w*)+", text):
            if name.rsplit(".", 1)[-1] not in FILE_NAMES and not resolves(name):
                stale.add((where, name))
    assert stale == set()


def test_ruff_is_clean():
    """pyproject.toml's [tool.ruff] rules (pycodestyle, pyflakes, import order; 120 columns) over the repository."""
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], capture_output=True,
                         text=True, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    # the reports' folder is left out, the package's bench module is not (an unanchored "bench" once dropped both)
    files = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--show-files", str(ROOT)],
                           capture_output=True, text=True, cwd=ROOT).stdout
    assert "specdemo/measure/bench/run.py" in files and f"{ROOT}/bench/" not in files
