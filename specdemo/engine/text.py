"""Incremental detokenization and stop strings. Knows tokenizers, not models."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, holding back incomplete multi-byte characters.

    Decoding a window (prefix_offset..read_offset) and diffing against a longer window keeps leading spaces
    and byte-fallback characters right, as in vLLM and TGI.
    """

    def __init__(self, tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-6:]) if prompt_ids else []  # a little context for leading spaces
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add(self, token_id: int) -> str:
        """Append one token; return the new text it completes (may be empty while a character is incomplete)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Emit whatever is held back at the end of generation (an incomplete character decodes as U+FFFD)."""
        full = self._decode(self.ids[self.prefix_offset :])
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        delta = full[len(prefix) :]
        self.read_offset = len(self.ids)
        self.prefix_offset = self.read_offset
        self.text += delta
        return delta


def find_stop(text: str, stop_strings: tuple[str, ...], new_chars: int) -> int:
    """Index just past the first stop string that ends within the last `new_chars` characters, or -1."""
    best = -1
    for stop in stop_strings:
        if not stop:
            continue
        start = max(0, len(text) - new_chars - len(stop) + 1)
        i = text.find(stop, start)
        if i >= 0 and (best < 0 or i + len(stop) < best):
            best = i + len(stop)
    return best


def token_texts(tokenizer, ids: list[int]) -> list[str]:
    """Each token decoded on its own, for display (special tokens shown as themselves)."""
    return [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
