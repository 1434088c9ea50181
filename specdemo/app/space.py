"""Deploy app.py as a Hugging Face Space: which files go (and which of them by LFS), the Space's variables, the upload.

Knows the repository's files and the Hub's rules; knows nothing of models. The network is touched only by `deploy`.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .. import checks
from .race import AppLimits, preset_ids

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
# what a Space runs: the app, the package (with the trained draft), the README whose front matter configures the
# Space, the requirements it installs, the screenshot the README shows, and the LFS rules
SPACE_PATTERNS = ("app.py", "requirements.txt", "README.md", ".gitattributes", "specdemo/*", "assets/*")
SPACE_IGNORE = ("*/__pycache__/*", "*.pyc")
HUB_MAX_PLAIN_BYTES = 10 * 1024 * 1024  # the Hub refuses larger files outside LFS / Xet
BINARY_SNIFF_BYTES = 8000  # git's own test: a NUL byte in the first 8000 bytes makes a file binary


@dataclass(frozen=True)
class SpaceFile:
    """One file of the upload, as the Hub will see it."""

    path: str  # relative to the repository root, '/'-separated
    size: int  # bytes
    binary: bool
    lfs: bool  # `git check-attr filter` says lfs

    @property
    def refused_outside_lfs(self) -> bool:
        """Whether the Hub refuses this file unless it goes by LFS (over 10 MiB, or binary)."""
        return self.size > HUB_MAX_PLAIN_BYTES or self.binary


def space_variables(limits: AppLimits = AppLimits()) -> dict[str, str]:
    """The Space's variables: app.py's public-deployment guards, written out so the Settings page shows them."""
    return {
        "SPECDEMO_MODEL_ALLOWLIST": ",".join(preset_ids()),
        "SPECDEMO_MAX_NEW_TOKENS": str(limits.max_new_tokens),
        "SPECDEMO_ALLOW_LOCAL_PATHS": "1" if limits.allow_local_paths else "0",
    }


def _git(root: Path, *args: str, stdin: str | None = None) -> str:
    return subprocess.run(["git", "-C", str(root), *args], input=stdin, capture_output=True, text=True,
                          check=True).stdout


def repo_files(root: Path = ROOT) -> list[str]:
    """Tracked and untracked files of the checkout that .gitignore does not hide."""
    out = _git(root, "ls-files", "--cached", "--others", "--exclude-standard", "-z")
    return sorted(p for p in set(out.split("\0")) if p and (root / p).is_file())


def lfs_paths(paths: Sequence[str], root: Path = ROOT) -> set[str]:
    """The paths whose `filter` attribute is lfs (.gitattributes), by one `git check-attr --stdin` call."""
    out = _git(root, "check-attr", "-z", "--stdin", "filter", stdin="\0".join(paths) + "\0") if paths else ""
    fields = out.split("\0")  # path, attribute, value, path, ...
    return {fields[i] for i in range(0, len(fields) - 2, 3) if fields[i + 2] == "lfs"}


def is_binary(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" in f.read(BINARY_SNIFF_BYTES)


def describe(paths: Iterable[str], root: Path = ROOT) -> list[SpaceFile]:
    """Size, binary or not, and LFS or not for each path."""
    paths = list(paths)
    lfs = lfs_paths(paths, root)
    return [SpaceFile(p, (root / p).stat().st_size, is_binary(root / p), p in lfs) for p in paths]


def space_files(root: Path = ROOT) -> list[SpaceFile]:
    """What `deploy` uploads: the repository's files that match SPACE_PATTERNS and not SPACE_IGNORE."""
    from huggingface_hub.utils import filter_repo_objects

    chosen = filter_repo_objects(repo_files(root), allow_patterns=list(SPACE_PATTERNS),
                                 ignore_patterns=list(SPACE_IGNORE))
    return describe(chosen, root)


def dry_run_lines(files: Sequence[SpaceFile], space_id: str, hardware: str | None,
                  variables: dict[str, str]) -> list[str]:
    """The dry run's report: every file with its size and how it goes, then the variables and the hardware."""
    space_id = checks.space_id(space_id)  # the Hub's rules, before anything is planned
    lines = [f"# {space_id}: {len(files)} files, {sum(f.size for f in files) / 1e6:.1f} MB"]
    for f in files:
        how = "lfs" if f.lfs else ("REFUSED: binary or over 10 MiB outside LFS" if f.refused_outside_lfs else "git")
        lines.append(f"{f.size:>12,}  {how:<4}  {f.path}")
    lines += [f"variable {k}={v}" for k, v in variables.items()]
    lines.append(f"hardware {hardware or 'the Space default (cpu-basic)'}")
    return lines


def deploy(space_id: str, hardware: str | None = None, private: bool = False, root: Path = ROOT,
           token: str | None = None) -> str:
    """Create (or update) the Gradio Space, set its variables and hardware, upload its files; returns its URL."""
    from huggingface_hub import HfApi

    space_id = checks.space_id(space_id)  # the Hub's rules, before anything is uploaded
    files = space_files(root)
    refused = [f.path for f in files if f.refused_outside_lfs and not f.lfs]
    if refused:
        raise ValueError(f"the Hub would refuse these outside LFS; add them to .gitattributes: {refused}")
    api = HfApi(token=token)
    url = api.create_repo(space_id, repo_type="space", space_sdk="gradio", private=private, exist_ok=True)
    for key, value in space_variables().items():
        api.add_space_variable(space_id, key, value)
    if hardware:
        api.request_space_hardware(space_id, hardware)
    # the exact paths as patterns, so the upload is the dry run's list and nothing the walk of the folder adds
    api.upload_folder(repo_id=space_id, repo_type="space", folder_path=str(root),
                      allow_patterns=[f.path for f in files], commit_message="Deploy specdemo")
    log.info("uploaded %d files to %s", len(files), url)
    return str(url)
