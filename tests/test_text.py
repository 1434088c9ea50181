"""Incremental detokenization and stop strings, on the real SmolLM2 tokenizer."""

import pytest

from specdemo.engine.text import IncrementalDetokenizer, find_stop

TEXTS = [
    "Hello  world,\n\n  indented line\tand a tab",
    "Emoji 🚀🎉 and accents: café, naïve, Zürich",
    "中文字符和日本語のテキスト",
    "def f(x):\n    return {'a': [1, 2]}\n",
    "   leading spaces and trailing   ",
]


@pytest.fixture(scope="module")
def tokenizer(bundled):
    return bundled.tokenizer


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_full_decode(tokenizer, text):
    """Feeding tokens one by one yields deltas that join to the one-shot decode, never a broken character."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=tokenizer("Say:", add_special_tokens=False)["input_ids"])
    deltas = [detok.add(i) for i in ids] + [detok.flush()]
    assert "".join(deltas) == tokenizer.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


def test_find_stop_only_looks_at_new_text():
    assert find_stop("abc END def", ("END",), new_chars=4) == -1  # it ended before the new text
    assert find_stop("abc EN", ("END",), new_chars=2) == -1
    assert find_stop("abc END", ("END",), new_chars=1) == 7
    assert find_stop("x\n\ny", ("\n\n", "y"), new_chars=3) == 3
