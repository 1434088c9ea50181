"""Prompt sets in the MT-Bench / Spec-Bench JSONL shape: `prompt` (string) or `turns` (first turn used), `category`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "prompts"
DEFAULT_PROMPTS = DATA / "dev.jsonl"  # the 30 development prompts the README's figures use (a copy of the project's shared dev set)
INDEPENDENT_PROMPTS = DATA / "independent.jsonl"  # 30 written without sight of dev.jsonl or the training data
REPETITIVE_PROMPTS = DATA / "repetitive.jsonl"  # 15: three tasks, each repeated on other data (suffix decoding's case)


@dataclass(frozen=True)
class PromptItem:
    id: str
    category: str
    prompt: str


def read_prompts(path: str | Path, limit: int | None = None) -> list[PromptItem]:
    """Read a JSONL prompt file; blank lines are skipped, a line with neither `prompt` nor `turns` is an error."""
    items = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if isinstance(row.get("prompt"), str):
            text = row["prompt"]
        elif isinstance(row.get("turns"), list) and row["turns"]:
            text = row["turns"][0]
        else:
            raise ValueError(f"{path}:{n}: a prompt line needs 'prompt' (string) or 'turns' (list)")
        items.append(PromptItem(str(row.get("id", row.get("question_id", n))), row.get("category", "uncategorized"), text))
        if limit and len(items) >= limit:
            break
    return items
