"""distill.instructions: self-written instructions (Magpie-style, steered) are unique, cached and resumable, the
project's instruction files are read in order, and no training instruction comes close to an evaluation prompt."""

from conftest import tiny_llama, tiny_tokenizer

from specdemo.train import cli, instructions

VOCAB = 40


def test_self_instructions_are_sampled_unique_cached_and_resumable(tmp_path):
    """Magpie-style: the target continues its chat template's user-turn prefix; results are unique, cached per batch,
    and a rerun reads the cache instead of generating, or extends it."""
    target = tiny_llama(VOCAB, seed=6, sharpness=1.0)
    tok = tiny_tokenizer([f"w{i}" for i in range(1, VOCAB)])
    tok.chat_template = ("{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}"
                         "{% if add_generation_prompt %}w3 {% endif %}")
    path, log = tmp_path / "instructions.jsonl", []
    first = instructions.self_instructions(target, tok, 6, 8, 0, path, log.append, max_tokens=16)
    assert len(first) == len(set(first)) == 6 and all(len(x) >= 12 for x in first)
    assert len(path.read_text().splitlines()) == 6 and log[0]["event"] == "instructions"

    def refuse(*a, **k):
        raise AssertionError("generated again instead of reading the cache")

    original, target.generate = target.generate, refuse
    assert instructions.self_instructions(target, tok, 6, 8, 0, path, log.append, max_tokens=16) == first
    target.generate = original
    more = instructions.self_instructions(target, tok, 10, 8, 0, path, log.append, max_tokens=16)
    assert more[:6] == first and len(set(more)) == 10


def test_steered_self_instructions_start_with_an_opening_and_continue_it(tmp_path):
    """With openings, each user turn starts with one of them and the target writes the rest; drawn per row, so a
    batch mixes them, and a rerun reads the same rows from the cache."""
    target = tiny_llama(VOCAB, seed=6, sharpness=1.0)
    tok = tiny_tokenizer([f"w{i}" for i in range(1, VOCAB)])
    tok.chat_template = ("{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}"
                         "{% if add_generation_prompt %}w3 {% endif %}")
    openings = ["w5 w6", "w7", "w8 w9 w10"]
    path, log = tmp_path / "steered.jsonl", []
    rows = instructions.self_instructions(target, tok, 8, 8, 0, path, log.append, max_tokens=16, openings=openings)
    assert len(rows) == len(set(rows)) == 8
    starts = [next(o for o in openings if r.startswith(o + " ")) for r in rows]  # an opening, then the target's words
    assert len(set(starts)) > 1
    assert all(len(r) > len(s) + 1 for r, s in zip(rows, starts))
    again = instructions.self_instructions(target, tok, 8, 8, 0, path, log.append, max_tokens=16, openings=openings)
    assert again == rows


def test_instructions_files_are_read_in_order_without_duplicates(tmp_path):
    import json

    import pytest

    read = instructions.read_instructions
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"instruction": x}) + "\n"
                         for x in ["Name a bird.", " Sort these: 3, 1 ", "Name a bird."]))
    b.write_text(json.dumps({"instruction": "Name a tree."}) + "\n" + json.dumps({"instruction": "Sort these: 3, 1"})
                 + "\n")
    assert read(f"{a}, {b}") == ["Name a bird.", "Sort these: 3, 1", "Name a tree."]
    assert read("") == []
    assert read(f"written,{b}") == [*read(str(instructions.WRITTEN)), "Name a tree.",
                                    "Sort these: 3, 1"]  # "written" names the project's file
    both = read("written,written2")  # and "written2" its second batch
    assert both == [*read(str(instructions.WRITTEN)), *read(str(instructions.WRITTEN_2))]
    assert instructions.WRITTEN.is_file() and instructions.WRITTEN_2.is_file()
    with pytest.raises(FileNotFoundError, match="no instructions file"):
        read(str(tmp_path / "nothing.jsonl"))


def test_training_instructions_never_contain_an_evaluation_prompt():
    """The project's own training instructions share at most 60% of their words with any prompt of the evaluation
    sets (specdemo/data/prompts: dev.jsonl and independent.jsonl): the templated ones at the default seed and scale,
    every templated stage, and below 45% for the three helper-written files. A shared template such as "Write a short
    poem about X" scores 0.56; the JSON-of-a-book instruction that nearly copied a dev prompt, and was removed, scored
    0.71; helper-written requests at 0.45 or more were dropped from their file (the closest, a git question, scored
    0.86). The paragraphs the target writes for the extractive and multi-turn instructions are left empty: only the
    templates' own words are compared."""
    import random
    import re

    from specdemo.prompts import DEFAULT_PROMPTS, INDEPENDENT_PROMPTS, read_prompts

    evaluation = [p.prompt for p in read_prompts(INDEPENDENT_PROMPTS)]
    assert len(evaluation) == 30
    dev = [p.prompt for p in read_prompts(DEFAULT_PROMPTS)]  # in the repository: no ../shared needed
    assert len(dev) == 30
    evaluation += dev
    config = cli.parse_config(["--target", "x", "--out", "y"])  # the default seed and scale
    rng = random.Random(config.seed)
    simple, sampled = instructions.templated_prompts(rng, config.seed, config.scale)
    text = instructions.text_prompts(rng, [""] * instructions.PARAGRAPHS, config.scale)  # the same draws as build_data
    convs = [m for _, m in simple + sampled + text] + instructions.paragraph_prompts()
    assert len(convs) == 612
    templated = [turn["content"] for m in convs for turn in m if turn["role"] == "user"]
    written = instructions.read_instructions(str(instructions.WRITTEN))
    second = instructions.read_instructions(str(instructions.WRITTEN_2))
    third = instructions.read_instructions(str(instructions.WRITTEN_3))
    assert (len(written), len(second), len(third)) == (2974, 2978, 2989)
    assert not set(written) & set(second) and not (set(written) | set(second)) & set(third)
    words = lambda text: set(re.findall(r"[a-z0-9]+", text.lower()))  # noqa: E731
    evaluation_words = [(e, words(e)) for e in evaluation]  # each text split into words once, not once per pair

    def closest(training):
        return max((len(w & ew) / len(w | ew), t, e)
                   for t, w in ((t, words(t)) for t in training) for e, ew in evaluation_words)

    assert closest(templated)[0] < 0.6, closest(templated)
    assert closest(written)[0] < 0.45, closest(written)
    assert closest(second)[0] < 0.45, closest(second)
    assert closest(third)[0] < 0.45, closest(third)
