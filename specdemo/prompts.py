"""Prompt sets in the MT-Bench / Spec-Bench JSONL shape: `prompt` (string) or `turns` (first turn used), `category`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "prompts"
# the 30 development prompts the README's figures use (a copy of the project's shared dev set)
DEFAULT_PROMPTS = DATA / "dev.jsonl"
INDEPENDENT_PROMPTS = DATA / "independent.jsonl"  # 30 written without sight of dev.jsonl or the training data
REPETITIVE_PROMPTS = DATA / "repetitive.jsonl"  # 15: three tasks, each repeated on other data (suffix decoding's case)


@dataclass(frozen=True)
class PromptItem:
    id: str
    category: str
    prompt: str
    line: int = 0  # its line in the file (1-based), for messages that name it


SHAPE = "a JSON object with 'prompt' (a non-empty string) or 'turns' (a list whose first turn is one)"


def read_prompts(path: str | Path, limit: int | None = None) -> list[PromptItem]:
    """Read a JSONL prompt file; blank lines are skipped. A line that is not a prompt is a ValueError naming the file
    and the line (and for undecodable bytes, the byte's line)."""
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ValueError(f"{path}:{line}: the file must be UTF-8 text, got the byte {data[exc.start]:#04x}") from None
    items = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        item = _item(line, n)
        if item is None:
            raise ValueError(f"{path}:{n}: a prompt line must be {SHAPE}, got {line.strip()[:60]!r}")
        items.append(item)
        if limit and len(items) >= limit:
            break
    return items


def _item(line: str, n: int) -> PromptItem | None:
    """One line as a prompt, or None when it is not one."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    if not isinstance(row, dict):
        return None
    turns = row.get("turns")
    text = row["prompt"] if isinstance(row.get("prompt"), str) else (turns[0] if isinstance(turns, list) and turns
                                                                       else None)
    if not isinstance(text, str) or not text.strip():
        return None
    return PromptItem(str(row.get("id", row.get("question_id", n))), str(row.get("category", "uncategorized")), text, n)
