"""What a draft id or folder is: the shipped trained draft, an EAGLE-3 head (a folder or hub id) or a causal LM.
resolve_draft is the one place that decides; compare, serving and export act on its answer; starting_k says which k a
drafter starts at for a pair. Loads no weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..config import BUNDLED_HUB_ID, TRAINED_DRAFT_ID, GenerationConfig, Runtime, drafter_default
from .registry import get

DRAFTS = Path(__file__).resolve().parent.parent / "data"  # the shipped trained drafts: package data, so a clone and an
# installed package find them in the same place

TRAINED, EAGLE3, LM = "trained", "eagle3", "lm"  # Draft.kind: the shipped draft (an EAGLE-3 head), any EAGLE-3 head,
# a causal LM sharing the target's tokenizer


class DraftError(ValueError):
    """A draft name that names no usable draft; the message says what it is instead."""


@dataclass(frozen=True)
class Draft:
    """A resolved draft: which kind, the name as given, and its local folder when it has one."""

    kind: str  # TRAINED, EAGLE3 or LM
    name: str  # the id or folder as given (or the target's default draft)
    path: Path | None  # its folder (a hub head's downloaded snapshot); None: a hub id not fetched here
    local: bool  # a folder on this disk or the shipped draft, not a hub id

    @property
    def is_head(self) -> bool:
        """An EAGLE-3 head (the shipped draft is one), drafting from the target's hidden states."""
        return self.kind in (TRAINED, EAGLE3)

    @property
    def vllm_method(self) -> str:
        """vLLM's speculative method for this draft."""
        return "eagle3" if self.is_head else "draft_model"

    @property
    def sglang_method(self) -> str:
        """SGLang's --speculative-algorithm for this draft."""
        return "EAGLE3" if self.is_head else "STANDALONE"


def trained_draft_path(target_name: str | None) -> Path | None:
    """The shipped distilled draft for a target, if there is one."""
    from ..models.eagle3 import is_eagle3
    from ..models.loading import BUNDLED_ALIASES

    if target_name and target_name.lower() in BUNDLED_ALIASES | {BUNDLED_HUB_ID.lower()}:
        path = DRAFTS / TRAINED_DRAFT_ID
        return path if is_eagle3(path) else None
    return None


def default_draft(target_name: str | None) -> str | None:
    """The draft a drafter that needs one uses when none is given: the target's trained draft, if shipped."""
    return TRAINED_DRAFT_ID if trained_draft_path(target_name) else None


def resolve_draft(draft: str | None, target: str | None, runtime: Runtime = Runtime(), *, fetch: bool = True) -> Draft:
    """What `draft` names (None: the target's default draft), from config files only, never from the name.

    A folder is an EAGLE-3 head when its config.json names an EAGLE-3 architecture or `export` wrote
    speculative_config.json beside it; a hub id is one when its config.json says so (with `fetch`, the head is
    downloaded once and `path` is its snapshot; without, only the local hub cache is read). Anything else with a
    config.json is a causal LM; a folder without one is refused (DraftError)."""
    from ..models.eagle3 import (
        eagle3_export,
        is_eagle3,
        locate_eagle3,
        not_a_draft,
        read_config,
    )

    name = draft or default_draft(target)
    if not name:
        raise DraftError(f"no draft model given for target '{target}': pass a draft id (same tokenizer; --draft) "
                         f"or use prompt lookup (--drafter ngram)")
    shipped = DRAFTS / TRAINED_DRAFT_ID
    if name == TRAINED_DRAFT_ID:
        if not is_eagle3(shipped):
            raise DraftError(f"the trained draft '{name}' is not in {shipped}; train it with "
                             f"`python -m specdemo distill`")
        return Draft(TRAINED, name, shipped, True)
    path = Path(name)
    if path.is_dir():
        if path.resolve() == shipped.resolve() and is_eagle3(path):
            return Draft(TRAINED, name, path, True)
        if is_eagle3(path) or eagle3_export(path):
            return Draft(EAGLE3, name, path, True)
        if read_config(path) is None:
            raise DraftError(not_a_draft(name, "the folder has no config.json"))
        return Draft(LM, name, path, True)
    if fetch:
        head = locate_eagle3(name, runtime)  # a hub id whose config.json is an EAGLE-3 head, downloaded once
        if head is not None:
            return Draft(EAGLE3, name, head, False)
    else:
        from ..models.loading import cached_hub_config

        if is_eagle3(cached_hub_config(name)):
            return Draft(EAGLE3, name, None, False)
    return Draft(LM, name, None, False)


RECORDED = "the head's recorded k"  # starting_k's source for an EAGLE-3 head that records its k (export writes it)


def starting_k(kind: str, target: str | None, draft: str | None = None,
               runtime: Runtime = Runtime()) -> tuple[int, str]:
    """The k a drafter kind starts at for a pair when none is given, and where it comes from: the measured default
    (config.DRAFTER_DEFAULTS: a model-free kind's on any target, a draft's with the target's shipped trained draft),
    else an EAGLE-3 head's recorded k, else GenerationConfig's (not measured). Reads config files only (the local hub
    cache, no download); the CLI, the bench, the app, serve-config and export all ask here."""
    from ..models.eagle3 import recorded_k

    measured = drafter_default(kind)
    if not get(kind).needs_draft:
        if measured is not None:
            return measured.k, f"measured best in {measured.evidence}"
    else:
        try:
            resolved = resolve_draft(draft, target, runtime, fetch=False)
        except (DraftError, OSError):
            resolved = None
        if resolved is not None and resolved.kind == TRAINED and measured is not None:
            return measured.k, f"measured best in {measured.evidence}"
        recorded = recorded_k(resolved.path) if resolved is not None and resolved.is_head and resolved.path else None
        if recorded:
            return recorded, RECORDED
    usual = GenerationConfig.num_draft_tokens
    return usual, f"not measured for this pair: the usual {usual}"
