"""One validation for every entry point (specdemo.checks): the same bad value gets the same one-sentence refusal from
the app's handler, generate, bench, serve-config and export (the API's turn is in test_app_client.py), before any
model loads; a property test over numbers and text for every numeric setting; model folders, Space ids and prompt
files. Only the bundled model's tokenizer is read (for the prompt-length row), never its weights."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field, fields

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdemo import checks
from specdemo.__main__ import main
from specdemo.app.handlers import Handlers, Outputs, RaceOutputs, SettingsOutputs, SweepOutputs
from specdemo.app.race import AppLimits, make_request
from specdemo.measure.bench import main as bench_main
from specdemo.prompts import read_prompts

OUTPUTS = Outputs(*(cls(*(f.name for f in fields(cls))) for cls in (RaceOutputs, SweepOutputs, SettingsOutputs)))
LONG_PROMPT = "hello " * 400  # some 400 tokens: more than the 192 that 8,000 new tokens leave of SmolLM2's 8,192


@dataclass(frozen=True)
class Row:
    """A value of one setting, as the page or an API client sends it (the command line gets it as text), the sentence
    that refuses it, and the entry points that take the setting. `also`: other settings the case needs."""

    setting: str  # the app's parameter name (make_request); the flag is --setting with - for _
    value: object
    sentence: str  # {folder} and {n} (the prompt's tokens) are filled in by the test
    where: tuple[str, ...]
    also: dict = field(default_factory=dict)


EVERYWHERE = ("app", "api", "generate", "bench", "serve-config", "export")
SAMPLED = ("app", "api", "generate", "bench")
K = "k must be a whole number from 1 to 64, got {}."
TEMPERATURE = "temperature must be a finite number of at least 0 (0 is greedy), got {}."
TOP_P = "top-p must be a number above 0 and at most 1, got {}."
NEW_TOKENS = "max new tokens must be a whole number of at least 1, got {}."
TARGET = ("target must be a model folder (a config.json transformers reads), a hub id like org/name, or smollm2-135m, "
          "got '{folder}/{name}': {why}.")
DRAFT = ("draft must be a model folder (a config.json transformers reads, or an EAGLE-3 head), a hub id like org/name, "
         "or smollm2-135m-draft, got '{folder}/empty': a folder with no config.json.")
ROWS = (
    Row("k", "abc", K.format("'abc'"), EVERYWHERE),
    Row("k", 0, K.format(0), EVERYWHERE),  # once silently the default k
    Row("k", 2.5, K.format(2.5), EVERYWHERE),
    Row("k", 65, K.format(65), EVERYWHERE),
    Row("max_new_tokens", 0, NEW_TOKENS.format(0), SAMPLED),
    Row("max_new_tokens", "lots", NEW_TOKENS.format("'lots'"), SAMPLED),
    Row("temperature", math.nan, TEMPERATURE.format("nan"), SAMPLED),  # once a torch traceback
    Row("temperature", math.inf, TEMPERATURE.format("inf"), SAMPLED),
    Row("temperature", -1, TEMPERATURE.format(-1), SAMPLED),
    Row("temperature", "hot", TEMPERATURE.format("'hot'"), SAMPLED),
    Row("top_p", 0, TOP_P.format(0), ("app", "api", "generate")),
    Row("top_p", math.nan, TOP_P.format("nan"), ("app", "api", "generate")),
    Row("top_p", 1.5, TOP_P.format(1.5), ("app", "api", "generate")),
    Row("verification", "tree", "verification must be one of token, block, got 'tree'.",
        ("app", "api", "generate", "bench", "serve-config"), {"temperature": 1.0}),
    Row("tree", "many", "tree must be auto, off or a node count from 1 to 64, got 'many'.",
        ("app", "api", "generate", "bench")),
    # the built-in kinds (this process also lists conftest's toy kind after them, the app server's does not)
    Row("drafter", "magic", "drafter must be one of model, ngram, hybrid, suffix",
        ("app", "api", "generate", "bench", "serve-config")),
    Row("prompt", "   ", "The prompt is empty: type something for the model to continue.", ("app", "api", "generate")),
    Row("prompt", LONG_PROMPT, "The prompt is too long: {n} tokens, at most 192 here (smollm2-135m's context is 8,192 "
        "tokens, 8000 of them for new tokens).", ("app", "generate", "bench"), {"max_new_tokens": 8000}),
    Row("target", "{folder}/empty", TARGET.format(folder="{folder}", name="empty", why="a folder with no config.json"),
        ("app", "generate", "bench", "serve-config", "export")),
    Row("target", "{folder}/unreadable",  # the sentence's beginning: transformers' own words follow
        TARGET.split("{why}")[0].format(folder="{folder}", name="unreadable")
        + "transformers cannot read its config.json (",
        ("app", "generate", "bench", "serve-config", "export")),
    Row("draft", "{folder}/empty", DRAFT, ("app", "generate", "bench", "serve-config", "export"), {"drafter": "model"}),
)
APP = dict(prompt="Say hi.", target="smollm2-135m", drafter="ngram", draft="", k=4, dynamic_k=False, temperature=0.0,
           top_p=1.0, max_new_tokens=8, hide_rejected=False, replay=False, verification="token", tree="auto")
# the app's own limits set wide open, so only the shared checks can refuse
OPEN = AppLimits(max_new_tokens=8000, max_prompt_tokens=8192, allow_local_paths=True, device="cpu")
BASE = {"generate": ["generate", "--prompt", "Say hi.", "--drafter", "ngram"], "bench": ["--drafter", "ngram"],
        "serve-config": ["serve-config", "--drafter", "ngram"],
        "export": ["export", "--draft", "smollm2-135m-draft", "--out", "{folder}/export"]}
FLAGS = {"generate": set(APP) - {"hide_rejected", "replay"}, "bench": {"k", "max_new_tokens", "temperature",
         "verification", "drafter", "target", "draft", "tree"},
         "serve-config": {"k", "verification", "drafter", "target", "draft"}, "export": {"k", "target", "draft"}}


def text(value) -> str:
    return value if isinstance(value, str) else str(value)


def fill(value, folder: str):
    """A row's value with its folder placeholder filled in."""
    return value.replace("{folder}", folder) if isinstance(value, str) else value


def cases(where: str) -> list[Row]:
    return [r for r in ROWS if where in r.where]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """An empty folder, one whose config.json transformers cannot read, and a prompt file."""
    root = tmp_path_factory.mktemp("checks")
    (root / "empty").mkdir()
    (root / "unreadable").mkdir()
    (root / "unreadable" / "config.json").write_text('{"hidden_size": 8}')
    return str(root)


@pytest.fixture(scope="module")
def tokens() -> int:
    """LONG_PROMPT's tokens, chat template included, by the bundled tokenizer (no weights)."""
    from specdemo.engine import encode_prompt
    from specdemo.models.loading import load_tokenizer

    return len(encode_prompt(load_tokenizer("smollm2-135m")[0], LONG_PROMPT))


def says(message: str, row: Row, folder: str, n: int) -> bool:
    """Whether a message holds the row's sentence."""
    return row.sentence.replace("{folder}", folder).replace("{n}", f"{n:,}") in message


def cli_argv(where: str, row: Row, folder: str) -> list[str]:
    """The command line of one entry point with the row's value (and the settings it needs) as flags."""
    argv = [a.replace("{folder}", folder) for a in BASE[where]]
    if where == "bench":
        prompts = f"{folder}/{'long' if row.value == LONG_PROMPT else 'short'}.jsonl"
        with open(prompts, "w") as f:
            f.write(json.dumps({"prompt": LONG_PROMPT if row.value == LONG_PROMPT else "Say hi."}) + "\n")
        argv += ["--prompts", prompts, "--out", f"{folder}/bench", "--quiet"]
    for name, value in {**row.also, row.setting: row.value}.items():
        if name not in FLAGS[where]:
            continue  # a setting the command has not (bench's prompt is in its prompt file)
        argv.append(f"--{name.replace('_', '-')}={text(fill(value, folder))}")
    return argv


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    """(exit status, stderr) of one command, in this process: what `python -m specdemo ...` would exit with."""
    code = bench_main(argv) if argv[0].startswith("--") else main(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("row", cases("app"), ids=lambda r: f"{r.setting}={text(r.value)[:12]}")
def test_the_apps_handler_refuses_with_the_sentence(row, folder, tokens):
    """The race's handler (what the page and /compare run) answers with exactly the row's sentence, and one frame."""
    values = {**APP, **row.also, row.setting: fill(row.value, folder)}
    with pytest.warns(UserWarning):
        outs = list(Handlers(OUTPUTS, OPEN).run_compare(*values.values()))
    error = outs[-1]["result_json"]["error"]
    assert says(error, row, folder, tokens) and error.startswith(row.sentence[:12]) and error.endswith("."), error


@pytest.mark.parametrize("where", ["generate", "bench", "serve-config", "export"])
def test_every_command_refuses_with_the_same_sentence_on_one_line(where, folder, tokens, capsys):
    """Each command that takes the setting exits with status 2 and one line holding the row's sentence; nothing is
    written or loaded (export's folder stays absent)."""
    for row in cases(where):
        code, err = run_cli(cli_argv(where, row, folder), capsys)
        assert code == 2 and err.count("\n") == 1 and says(err, row, folder, tokens), (row, err)
    assert not os.path.exists(f"{folder}/export")



# ---- every numeric setting: a clear refusal or a valid value, never a traceback ----

NUMERIC = {"k": (checks.k, "k"), "max_new_tokens": (checks.max_new_tokens, "max new tokens"),
           "temperature": (checks.temperature, "temperature"), "top_p": (checks.top_p, "top-p"),
           "top_k": (checks.top_k, "top-k"), "seed": (checks.seed, "seed")}
ANYTHING = st.one_of(st.floats(), st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e308, 5e-324, 1e-300]),
                     st.integers(), st.integers(min_value=10**18, max_value=10**400), st.text(max_size=30),
                     st.sampled_from(["4", " 4 ", "4.0", "1e3", "1_0", "0x10", "nan", "-inf", "", "1e400", "9" * 5000]),
                     st.none(), st.booleans())
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def refusal_or_value(setting: str, value) -> None:
    """The check's answer: a valid value of its setting, or a one-line refusal that names the setting and says 'got'."""
    check, name = NUMERIC[setting]
    try:
        x = check(value)
    except checks.UserError as exc:
        message = str(exc)
        assert message.startswith(f"{name} must be ") and ", got " in message and "\n" not in message, message
        return
    whole = setting in ("k", "max_new_tokens", "top_k", "seed")
    assert type(x) is int if whole else (type(x) is float and math.isfinite(x) and str(x) != "-0.0")
    assert make_request_ok(setting, x) if setting in APP else True


def make_request_ok(setting: str, x) -> bool:
    """The app takes what the check takes (up to its own max new tokens)."""
    values = {k: v for k, v in APP.items() if k not in ("hide_rejected", "replay")}
    limits = AppLimits(max_new_tokens=x if setting == "max_new_tokens" else 8)
    return make_request(**{**values, setting: x}, limits=limits) is not None


@pytest.mark.parametrize("setting", list(NUMERIC))
@FAST
@given(value=ANYTHING)
def test_any_value_of_a_numeric_setting_is_a_clear_refusal_or_a_valid_value(setting, value, capsys):
    """Direct (as an API client sends it) and through generate's and bench's flags (as text): a refusal names the
    setting and exits 2 on one line; a value that parses goes on to the next check (the empty prompt, the missing
    prompt file), so no model ever loads. Values that cannot be typed on a command line (None, bools) go direct only."""
    refusal_or_value(setting, value)
    if value is None or isinstance(value, bool):
        return
    flag = f"--{setting.replace('_', '-')}={value}"
    if "\x00" in flag:
        return
    code, err = run_cli(["generate", "--prompt", " ", flag], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert ("The prompt is empty" in err) == (checks_text(setting, value) is not None), err
    if setting in ("k", "max_new_tokens", "temperature", "seed"):
        code, err = run_cli([flag, "--prompts", "/nonexistent/prompts.jsonl"], capsys)
        assert code == 2 and err.count("\n") == 1, err
        assert ("the prompt file must be" in err) == (checks_text(setting, value) is not None), err


def checks_text(setting: str, value):
    """What the check makes of the value as the command line hands it over (text), or None when refused."""
    try:
        return NUMERIC[setting][0](str(value))
    except checks.UserError:
        return None


# ---- k lists, verification lists, model names, Space ids, prompt files ----

def test_bench_k_and_verification_lists_check_each_item_as_the_app_does():
    """bench's --k takes auto or a list whose items are each a k; --verification a list of rules, several only when
    sampling; an item refused gets the setting's own sentence."""
    assert checks.ks("4") == [4] and checks.ks("1, 2,4,8") == [1, 2, 4, 8] and checks.ks(" Auto ") == "auto"
    for bad, sentence in (("0", K.format(0)), ("2,x", K.format("'x'")), (" ", "or auto, got ' '.")):
        with pytest.raises(checks.UserError, match=re.escape(sentence)):
            checks.ks(bad)
    assert checks.verifications("token, Block", 1.0) == ["token", "block"]
    assert checks.verifications("block", 0) == ["block"]
    with pytest.raises(checks.UserError, match="verification must be one of token, block, got 'tree'."):
        checks.verifications("token,tree", 1.0)
    with pytest.raises(checks.UserError, match="at temperature 0 every rule is greedy"):
        checks.verifications("token,block", 0.0)


def test_model_names_are_ours_a_model_folder_or_a_hub_id(folder, tmp_path):
    """Our ids and hub ids by the Hub's rules pass without the network; a path that is no folder, or a folder that
    holds no model, is refused naming the setting; a folder transformers reads passes, and a draft may be the shipped
    EAGLE-3 head's folder."""
    from conftest import save_tiny_folder

    from specdemo.drafters.resolve import DRAFTS

    for name in ("smollm2-135m", "bundled", "org/model", "gpt2", "Qwen/Qwen2.5-0.5B-Instruct"):
        assert checks.model(name) == name
    assert checks.model("smollm2-135m-draft", "draft") == "smollm2-135m-draft"
    for name in ("./no/such/folder", "/nowhere", "org/a/b", "bad..name", "org/-x", "ünïcode/model", "", None):
        with pytest.raises(checks.UserError, match=r"^target must be a model folder .*, got "):
            checks.model(name)
    save_tiny_folder(tmp_path / "tiny", layers=1)
    assert checks.model(str(tmp_path / "tiny")) == str(tmp_path / "tiny")
    assert checks.model(str(DRAFTS / "smollm2-135m-draft"), "draft")
    with pytest.raises(checks.UserError, match="got '.*smollm2-135m-draft': an EAGLE-3 head, which drafts for"):
        checks.model(str(DRAFTS / "smollm2-135m-draft"), "target")  # a head is not a target


def test_a_draft_must_suit_its_drafter():
    """A draft named for a kind that takes none is refused (the app's page ignores it instead: its draft box keeps
    its value across drafters); a kind that needs one, for a target that ships none, must be given one."""
    checks.pair("smollm2-135m", "model", None)  # the shipped trained draft
    with pytest.raises(checks.UserError, match="--drafter ngram \\(prompt lookup\\) uses none"):
        checks.pair("smollm2-135m", "ngram", "org/draft")
    with pytest.raises(checks.UserError, match="drafter model needs a draft: org/big ships no trained draft"):
        checks.pair("org/big", "model", None)


def test_a_space_id_follows_the_hubs_rules_before_anything_is_planned(capsys):
    """OWNER/NAME with the Hub's characters passes; anything else is refused by `space` (--dry-run too) and by
    deploy() before any request is made."""
    from specdemo.app import space

    for good in ("someone/specdemo", "Org-1/my_space.v2"):
        assert checks.space_id(good) == good
    for bad in ("specdemo", "a/b/c", "bad..id/x", "me/x--y", "me/.x", "me/x.git", "me/sp ace", "me/" + "x" * 97, "ü/x"):
        with pytest.raises(checks.UserError, match="^the Space id must be YOUR-NAME/NAME"):
            checks.space_id(bad)
    assert main(["space", "me/bad..id", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the Space id must be YOUR-NAME/NAME" in err and "got 'me/bad..id'." in err
    with pytest.raises(checks.UserError, match="the Space id"):
        space.deploy("not an id", token="unused")


def test_a_malformed_prompt_file_is_named_by_file_and_line(tmp_path, capsys):
    """Bad JSON, a line that is no object, an empty prompt and bytes that are not UTF-8 each name the file and the
    line; bench refuses such a file on one line, exit status 2."""
    path = tmp_path / "p.jsonl"
    for lines, line_no in (([b'{"prompt": "a"}', b'{"prompt": "b",}'], 2), ([b'', b'["a"]'], 2),
                           ([b'{"prompt": "a"}', b'', b'{"turns": [" "]}'], 3), ([b'{"prompt": "a"}', b'\xff'], 2)):
        path.write_bytes(b"\n".join(lines) + b"\n")
        with pytest.raises(ValueError, match=f"^{path}:{line_no}: "):
            read_prompts(path)
    assert bench_main(["--prompts", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {path}:2: the file must be UTF-8 text, got the byte 0xff\n"
    path.write_text('\n{"prompt": "a"}\n\n{"turns": ["b"]}\n')
    assert [(i.prompt, i.line) for i in read_prompts(path)] == [("a", 2), ("b", 4)]
