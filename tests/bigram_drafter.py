"""A toy drafter kind, written as a new model-free drafter would be: this module and one register(...) call
(conftest.py), nothing else. It takes one option (--bigram-max-tokens) and keeps state across requests: what
followed each token in earlier answers, in the SharedState its caller owns.

It drafts, token by token, what followed the last token in an earlier answer (the token itself where none did), so
its drafts are often wrong: the tests that run every registered kind show that the target still decides.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from specdemo.drafters.base import Drafter, DraftRequest, Proposal, cut_at_eos


@dataclass(frozen=True)
class BigramOptions:
    """The toy's one option: the most tokens it drafts per step (k caps it too)."""

    max_tokens: int = 3

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"--bigram-max-tokens={self.max_tokens} must be >= 1")


class Bigrams:
    """What followed each token in earlier answers (the latest wins); len(): the answers learned. A request's answer
    is learned when a later request opens on this memory (so never while it is being written), and not at all if it
    opened while paused."""

    def __init__(self):
        self.follows: dict[int, int] = {}
        self.answers = 0
        self.recording = True
        self._open: list[tuple[list[int], int]] = []  # (a request's ids so far, its prompt's length)

    def __len__(self) -> int:
        return self.answers

    def open(self, prompts) -> list[list[int]]:
        """New requests' ids (the drafter extends them in place); the answers of earlier requests are learned first."""
        for ids, start in self._open:
            self.follows.update(zip(ids[start - 1 :], ids[start:]))  # from the prompt's last token on
            self.answers += 1
        rows = [list(p) for p in prompts]
        self._open = [(row, len(row)) for row in rows] if self.recording else []
        return rows

    def clear(self) -> None:
        self.follows.clear()
        self.answers = 0
        self._open = []

    @contextmanager
    def paused(self) -> Iterator[None]:
        before, self.recording = self.recording, False
        try:
            yield
        finally:
            self.recording = before


class BigramDrafter(Drafter):
    """Drafts up to min(k, max_tokens) tokens per row from the bigrams of earlier answers."""

    name = "bigram"

    def __init__(self, memory: Bigrams | None = None, options: BigramOptions = BigramOptions()):
        options.validate()
        self.memory = memory if memory is not None else Bigrams()
        self.options = options
        self._rows: list[list[int]] = []

    def begin(self, prompts, target_hidden=None) -> None:
        self._rows = self.memory.open(prompts)

    def propose(self, request: DraftRequest) -> list[Proposal]:
        out = []
        for ids, k in zip(request.ids, request.ks):
            tokens, last = [], ids[-1]
            while len(tokens) < min(k, self.options.max_tokens):
                last = self.memory.follows.get(last, last)
                tokens.append(last)
            out.append(Proposal(cut_at_eos(tokens, request.eos_token_ids)))
        return out

    def update(self, verdicts) -> None:
        for row, verdict in zip(self._rows, verdicts):
            row[:] = verdict.ids

    def select(self, rows) -> None:
        self._rows = [self._rows[r] for r in rows]

    def paused(self):
        return self.memory.paused()

    def forget(self) -> None:
        self.memory.clear()


def bigram_drafter(target, draft, options):
    """The kind's factory: its options from the registry's BuildOptions, its bigrams from the caller's SharedState."""
    memory = options.shared.get("bigram", Bigrams) if options.shared is not None else None
    return BigramDrafter(memory, options.of("bigram")), None, None
