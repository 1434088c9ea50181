"""The instructions the target answers: templated ones, ones the target writes itself (Magpie-style, optionally
steered by an opening), and the project's helper-written request files (specdemo/data/instructions). Never the
evaluation prompts (specdemo/data/prompts); knows nothing of answers, features or training.
"""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path

import torch

from ..models.kernels import left_pad
from .config import LogFn

log = logging.getLogger(__name__)

TOPICS = [
    "honeybees", "volcanoes", "the history of the bicycle", "coral reefs", "solar panels", "the Roman Empire",
    "black holes", "sourdough bread", "electric cars", "the water cycle", "chess openings", "the human heart",
    "public libraries", "climate change", "the invention of the printing press", "octopuses", "jazz music",
    "remote work", "recycling plastic", "the Great Wall of China", "vaccines", "deep sea exploration",
    "the stock market", "photosynthesis", "urban gardening", "the Olympic Games", "machine learning",
    "ancient Egypt", "coffee farming", "earthquakes", "the internet", "penguins", "wind turbines",
    "the French Revolution", "meditation", "rainforests", "space tourism", "the immune system", "board games",
    "renewable energy", "the moon landing", "migratory birds", "3D printing", "tea ceremonies", "glaciers",
    "the Silk Road", "smartphones", "sleep and memory", "desert plants", "video game design", "tides",
    "the periodic table", "lighthouses", "marathon training", "ocean plastic", "the Renaissance", "bats",
    "volunteering", "cloud computing", "hot air balloons", "fermentation", "the Amazon river",
]

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "counts the words in a sentence", "merges two sorted lists", "removes duplicates from a list while keeping order",
    "computes the factorial of n", "finds the largest element in a list", "checks whether a string is a palindrome",
    "converts Celsius to Fahrenheit", "flattens a nested list", "returns the average of a list of numbers",
    "counts vowels in a string", "sorts a list of dictionaries by a key", "reads a text file and returns its lines",
    "computes the greatest common divisor of two numbers", "capitalizes the first letter of every word",
    "returns the second largest number in a list", "checks whether two strings are anagrams",
    "implements binary search", "computes the sum of the digits of an integer", "transposes a matrix",
    "groups words by their first letter", "validates an email address with a regular expression",
]
CODE_LANGS = ["Python", "Python", "Python", "JavaScript", "C", "Rust", "Java", "Go"]
SNIPPETS = [
    "def f(xs):\n    return [x * x for x in xs if x % 2 == 0]",
    "for i in range(1, 16):\n    print('FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 else 'Buzz' if i % 5 == 0 "
    "else i)",
    "def g(d):\n    return {v: k for k, v in d.items()}",
    "total = 0\nfor line in open('data.txt'):\n    total += int(line)\nprint(total)",
    "def mean(xs):\n    return sum(xs) / len(xs)",
    "const add = (a, b) => a + b;\nconsole.log([1, 2, 3].reduce(add, 0));",
    "SELECT name, COUNT(*) FROM orders GROUP BY name ORDER BY COUNT(*) DESC;",
    "def fact(n):\n    return 1 if n <= 1 else n * fact(n - 1)",
]

ENTITIES = [
    ("a museum", "name, city, founded, collections"), ("a person", "name, age, email, city"),
    ("a movie", "title, director, year, rating"), ("a recipe", "name, ingredients, steps, time_minutes"),
    ("a product", "name, price, in_stock, tags"), ("a city", "name, country, population, landmarks"),
    ("a car", "make, model, year, color"), ("a song", "title, artist, album, duration_seconds"),
    ("an employee", "id, name, department, salary"), ("a planet", "name, diameter_km, moons, has_rings"),
    ("a student", "name, grade, subjects, average"), ("a flight", "number, origin, destination, departure_time"),
]

SENTENCES = [
    "The weather is beautiful today.", "Where is the nearest train station?", "I would like a cup of coffee, please.",
    "My brother works in a hospital.", "We are going to the beach this weekend.", "This book is very interesting.",
    "Can you help me find my keys?", "The museum opens at nine in the morning.", "I have been learning to cook.",
    "Thank you for your help yesterday.", "The children are playing in the garden.", "How much does this cost?",
]
LANGS = ["French", "Spanish", "German", "Italian", "Portuguese"]

NAMES = ["Tom", "Maria", "Ali", "Sara", "Ken", "Lena", "Omar", "Julia"]
ITEMS = ["apples", "pencils", "tickets", "books", "cookies", "stamps"]


def _reasoning(rng: random.Random) -> str:
    a, b, c = rng.randint(3, 19), rng.randint(2, 12), rng.randint(20, 100)
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    forms = [
        f"{name} buys {a} {item} that cost ${b} each and pays with ${a * b + c}. How much change does {name} get? "
        "Explain step by step.",
        f"A train travels {a * 10} km in {b} hours. What is its average speed? Show your reasoning.",
        f"{name} has {c} {item} and gives away {a} to each of {b % 5 + 2} friends. How many are left?",
        f"If a rectangle is {a} cm long and {b} cm wide, what are its area and perimeter?",
        f"What is {a * b} divided by {b}, plus {c}? Think step by step.",
        f"A class has {c} students and {a}% of them wear glasses. About how many wear glasses?",
        f"Is {a * 7 + 1} a prime number? Explain how you know.",
        f"{name} reads {a} pages a day. How many days does it take to finish a book of {a * b + a} pages?",
    ]
    return rng.choice(forms)


def simple_prompts(rng: random.Random, n_each: dict[str, int]) -> list[tuple[str, list[dict]]]:
    """(category, messages) for instructions that need no earlier answer."""
    out = []
    t = lambda: rng.choice(TOPICS)  # noqa: E731
    chat = [
        "What is {x}?", "Explain {x} in simple terms.", "Give me three interesting facts about {x}.",
        "What are the pros and cons of {x}?", "Why is {x} important?", "How would you explain {x} to a child?",
        "What are common misconceptions about {x}?", "I want to learn about {x}. Where should I start?",
    ]
    creative = [
        "Write a short poem about {x}.", "Write a haiku about {x}.", "Write a short story involving {x}.",
        "Write a limerick about {x}.", "Write a motivational speech that mentions {x}.",
        "Describe {x} as if you were a pirate.", "Write a short dialogue between two friends about {x}.",
        "Write a product advertisement inspired by {x}.",
    ]
    for _ in range(n_each["chat"]):
        out.append(("chat", [{"role": "user", "content": rng.choice(chat).format(x=t())}]))
    for _ in range(n_each["creative"]):
        out.append(("creative", [{"role": "user", "content": rng.choice(creative).format(x=t())}]))
    for _ in range(n_each["code"]):
        form = rng.randrange(3)
        if form == 0:
            msg = f"Write a {rng.choice(CODE_LANGS)} function that {rng.choice(CODE_TASKS)}."
        elif form == 1:
            msg = f"Explain what this code does:\n\n{rng.choice(SNIPPETS)}"
        else:
            msg = f"Write a {rng.choice(CODE_LANGS)} program that {rng.choice(CODE_TASKS)}, with comments."
        out.append(("code", [{"role": "user", "content": msg}]))
    for _ in range(n_each["structured"]):
        what, fields = rng.choice(ENTITIES)
        form = rng.randrange(4)
        if form == 0:
            msg = f"Return a JSON object describing {what} with the fields {fields}."
        elif form == 1:
            msg = f"Create a JSON array of three examples of {what}, each with {fields}."
        elif form == 2:
            msg = f"Make a markdown table of four examples of {what} with columns {fields}."
        else:
            msg = f"List five facts about {t()} as a numbered list."
        out.append(("structured", [{"role": "user", "content": msg}]))
    for _ in range(n_each["reasoning"]):
        out.append(("reasoning", [{"role": "user", "content": _reasoning(rng)}]))
    for _ in range(n_each["translation"]):
        s, lang = rng.choice(SENTENCES), rng.choice(LANGS)
        form = rng.choice([f"Translate to {lang}: {s}", f"Translate the following sentence into {lang}.\n\n{s}",
                           f"How do you say \"{s}\" in {lang}?"])
        out.append(("translation", [{"role": "user", "content": form}]))
    return out


def text_prompts(rng: random.Random, paragraphs: list[str], scale: float) -> list[tuple[str, list[dict]]]:
    """(category, messages) built on paragraphs the target wrote first: summaries, rewrites, follow-up turns."""
    extract = [
        "Summarize the following text in two sentences.\n\n{p}", "Summarize the following text in one sentence.\n\n{p}",
        "Rewrite the following paragraph in a formal tone.\n\n{p}",
        "List the key points of this text as bullets.\n\n{p}",
        "Give this text a title and a one-line summary.\n\n{p}", "Rewrite this for a ten-year-old.\n\n{p}",
        "Extract three keywords from the text below.\n\n{p}", "{p}\n\nWhat is the main idea of the text above?",
        "Shorten the following paragraph to about half its length.\n\n{p}",
    ]
    follow = ["Can you make that shorter?", "Give me an example.", "Explain that to a child.",
              "Now summarize it in one sentence.", "Can you turn that into a list?", "Tell me more about it."]
    out = []
    for _ in range(round(64 * scale)):
        out.append(("extractive", [{"role": "user", "content": rng.choice(extract).format(p=rng.choice(paragraphs))}]))
    for _ in range(round(32 * scale)):
        i = rng.randrange(len(paragraphs))
        out.append(("multi_turn", [
            {"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]}."},
            {"role": "assistant", "content": paragraphs[i]},
            {"role": "user", "content": rng.choice(follow)},
        ]))
    return out


PARAGRAPHS = 64  # first-stage paragraphs, material for the extractive and multi-turn instructions


def paragraph_prompts() -> list[list[dict]]:
    """The first stage: paragraphs on the topics, the material of `text_prompts`."""
    return [[{"role": "user", "content": f"Write a paragraph of about 100 words about {TOPICS[i % len(TOPICS)]}."}]
            for i in range(PARAGRAPHS)]


def templated_prompts(rng: random.Random, seed: int,
                      scale: float) -> tuple[list[tuple[str, list[dict]]], list[tuple[str, list[dict]]]]:
    """(simple, sampled): the templated instructions that need no earlier answer, answered greedily and with
    sampling. `rng` is shared with `text_prompts`, which `build_data` draws next."""
    n = lambda x: round(x * scale)  # noqa: E731
    simple = simple_prompts(rng, {"chat": n(40), "creative": n(32), "code": n(48), "structured": n(40),
                                  "reasoning": n(32), "translation": n(24)})
    sampled = simple_prompts(random.Random(seed + 1), {"chat": n(12), "creative": n(12), "code": n(4),
                                                       "structured": n(4), "reasoning": 0, "translation": 0})
    return simple, sampled


# Openings for steered self-instructions: the target writes the rest of the user turn (material included), so the
# instructions keep its own wording but cover the kinds of request that plain Magpie sampling rarely produces
# (translations, edits of a given text or code, extraction, formats). Our own list, written with the evaluation
# categories in view: several openings echo how evaluation prompts begin, so gains on those prompts partly reflect
# the format (README, "Steered self-written instructions").
OPENINGS = [
    "Translate into French:", "Translate into German:", "Translate into Spanish:", "Translate into Italian:",
    "Translate this sentence into Portuguese:", "Translate the following text into French.",
    "Summarize the following text", "Summarize this article in", "Rewrite the following paragraph",
    "Rewrite this text so that", "Extract the", "Answer using only the text below:", "Here is a short story:",
    "Read the passage and", "Fix the bug in this Python code:", "Add comments to this code:",
    "Rewrite this Python function", "Convert the following data to JSON:", "Turn this list into a table:",
    "Correct the grammar in this sentence:", "Write a SQL query that", "Write a bash script that",
    "Write a Markdown table", "Give a JSON object", "List the", "Write a Python function that",
    "Write a regular expression that", "If", "A store sells", "How many", "What is", "Solve", "Calculate",
    "What are some", "How does", "Why do", "I have a", "Can you explain", "What is the best way to",
    "Write a short story about", "Write a poem about", "Invent", "Write a letter", "Describe", "Suggest",
    "Give me ideas for", "Compare", "Plan a",
]


def self_instructions(target, tokenizer, n: int, batch_size: int, seed: int, path: Path, log_fn: LogFn,
                      temperature: float = 1.0, top_p: float = 0.95, max_tokens: int = 64,
                      openings: list[str] | None = None) -> list[str]:
    """Instructions the target writes itself (Magpie, Xu et al. 2024): sample the user turn from the chat template's
    pre-query prefix. They follow the target's own idea of what users ask, so they are far more varied than templates.
    With `openings`, each user turn starts with one of them (drawn per row, seeded by batch and row) and the target
    writes the rest. Kept: at least 12 characters (an unfinished one up to its last sentence end), not seen before.
    Cached batch by batch in `path`."""
    marker = "\u0001INSTRUCTION\u0001"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    prefix_text = text[: text.index(marker)]
    prefix_ids = tokenizer(prefix_text, add_special_tokens=False).input_ids
    eos = tokenizer.eos_token_id
    rows = read_jsonl(path)
    seen = {r["instruction"] for r in rows}
    batch = max((r["batch"] for r in rows), default=-1) + 1
    barren = 0  # batches in a row that kept nothing: a model that never ends a user turn must not loop forever
    while len(rows) < n and barren < 5:
        t0 = time.perf_counter()
        starts = ([random.Random(seed + 7919 * batch + r).choice(openings) for r in range(batch_size)]
                  if openings else [""] * batch_size)
        ids = [tokenizer(prefix_text + o, add_special_tokens=False).input_ids for o in starts]
        x, mask = left_pad(ids, eos, target.device)
        torch.manual_seed(seed + 7919 * batch)  # batch-indexed, so a resumed run draws what a full run would
        with torch.inference_mode():
            out = target.generate(x, attention_mask=mask, do_sample=True,
                                  temperature=temperature, top_p=top_p, top_k=0, max_new_tokens=max_tokens,
                                  pad_token_id=eos)
        new = []
        for start, opening, row in zip(starts, ids, out[:, x.shape[1]:].tolist()):
            # decoded together with the opening's tokens, so the join is the tokenizer's, not a guessed space
            own = opening[len(prefix_ids):] if opening[: len(prefix_ids)] == prefix_ids else []
            instruction = tokenizer.decode(own + (row[: row.index(eos)] if eos in row else row),
                                           skip_special_tokens=True)
            if eos not in row:  # cut at max_tokens: keep it up to its last finished sentence
                instruction = instruction[: max(instruction.rfind(c) for c in ".?!") + 1]
            instruction = instruction.strip()
            if len(instruction) >= 12 + len(start) and instruction not in seen:
                seen.add(instruction)
                new.append({"instruction": instruction, "batch": batch})
        with path.open("a") as f:
            for r in new[: n - len(rows)]:
                f.write(json.dumps(r) + "\n")
        rows.extend(new[: n - len(rows)])
        barren = 0 if new else barren + 1
        log_fn({"event": "instructions", "batch": batch, "kept": len(new), "total": len(rows), "of": n,
                "seconds": round(time.perf_counter() - t0, 1)})
        batch += 1
    if len(rows) < n:
        log.warning("the target wrote only %d usable instructions of %d", len(rows), n)
    return [r["instruction"] for r in rows[:n]]


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSONL file, or [] where there is none yet (a cache not yet written)."""
    return [json.loads(line) for line in path.open()] if path.exists() else []


DATA = Path(__file__).resolve().parent.parent / "data" / "instructions"
WRITTEN = DATA / "written.jsonl"
WRITTEN_2 = DATA / "written2.jsonl"
WRITTEN_3 = DATA / "written3.jsonl"
NAMED = {"written": WRITTEN, "written2": WRITTEN_2, "written3": WRITTEN_3}


def read_instructions(paths: str) -> list[str]:
    """Instructions from JSONL files (comma-separated paths, or the names in `NAMED`), one {"instruction": ...} per
    line, in file order, duplicates dropped. `WRITTEN` holds 2,974 requests written for the project by helpers that
    saw neither evaluation set, `WRITTEN_2` 2,978 and `WRITTEN_3` 2,989 more written the same way
    (specdemo/data/README.md)."""
    out, seen = [], set()
    for name in (x.strip() for x in paths.split(",") if x.strip()):
        path = NAMED.get(name, Path(name))
        if not path.is_file():
            raise FileNotFoundError(f"no instructions file at {path}")
        for row in read_jsonl(path):
            text = row["instruction"].strip()
            if text and text not in seen:
                seen.add(text)
                out.append(text)
    return out
