"""Prompt sets in the Spec-Bench / MT-Bench JSONL shape."""

from specdemo.prompts import read_prompts


def test_read_prompts_both_shapes(tmp_path):
    """`prompt` strings and MT-Bench `turns` lists (first turn) both read; blank lines skipped; limit honoured."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": 7, "category": "chat", "prompt": "hello"}\n\n'
                    '{"question_id": 81, "category": "writing", "turns": ["first turn", "second"]}\n'
                    '{"prompt": "third"}\n')
    items = read_prompts(path)
    assert [(i.id, i.category, i.prompt) for i in items] == [
        ("7", "chat", "hello"), ("81", "writing", "first turn"), ("4", "uncategorized", "third")]
    assert len(read_prompts(path, limit=2)) == 2
