"""The request checks every entry point runs before any model loads (the app and its API, generate, bench, export,
serve-config, space): each refusal is one sentence naming the setting, the value and what is allowed. The app adds
the limits only a public server needs (app/race.py) on top. Knows no gradio; argparse only through `arg` and `Parser`.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import Any

from .config import BUNDLED_ID, MAX_K_ENGINE, MIN_K, TRAINED_DRAFT_ID, VERIFICATION_RULES, Runtime, parse_tree
from .drafters.registry import check_draft, get, kinds, names

MAX_SEED = 2**32 - 1  # numpy's and most tools' bound; torch takes more, but a seed means the same everywhere here
SPACE_ID_RULES = ("YOUR-NAME/NAME: ASCII letters, digits, '-', '_' and '.', each part at most 96 characters, not "
                  "starting or ending with '-' or '.', with no '--' or '..', not ending in '.git'")


class UserError(ValueError):
    """A value a user gave is refused; the message is one sentence: the setting, the value, what is allowed."""


def shown(value: Any) -> str:
    """A value as a refusal quotes it: numbers as numbers, text quoted and cut short."""
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**15:
        return f"a {int(value.bit_length() * math.log10(2)) + 1}-digit number"  # str() of a huge int may refuse
    text = repr(value)
    return text if len(text) <= 160 else f"{text[:150]}… ({len(str(value)):,} characters)"


def refused(name: str, value: Any, allowed: str) -> UserError:
    return UserError(f"{name} must be {allowed}, got {shown(value)}.")


def _as_number(value: Any) -> int | float | None:
    """An int or float (nan and inf included, for the refusal to quote) from a widget, an API client or a flag (which
    may send anything); None if it is no number."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:  # a fraction, an exponent, or more digits than int() reads
            pass
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return None


def _quoted(value: Any, x: int | float | None) -> Any:
    """What a refusal quotes: the number read, or what was sent when it is no number (or text that only overflows,
    such as 5,000 nines, which float() reads as inf)."""
    if x is None or (isinstance(value, str) and isinstance(x, float) and not math.isfinite(x)
                     and value.strip().lower().lstrip("+-") not in ("nan", "inf", "infinity")):
        return value
    return x


def whole(value: Any, name: str, least: int, most: int | None = None, allowed: str | None = None) -> int:
    """A whole number from `least` to `most` (None: no bound); 4.0 and "4" are 4."""
    allowed = allowed or (f"a whole number from {least} to {most}" if most is not None
                          else f"a whole number of at least {least}")
    x = _as_number(value)
    if x is None or (isinstance(x, float) and not (math.isfinite(x) and x.is_integer())):
        raise refused(name, _quoted(value, x), allowed)
    x = int(x)
    if x < least or (most is not None and x > most):
        raise refused(name, x, allowed)
    return x


def real(value: Any, name: str, ok: Callable[[float], bool], allowed: str) -> float:
    """A finite number that `ok` accepts (-0.0 reads as 0.0)."""
    x = _as_number(value)
    try:
        f = None if x is None else float(x)
    except OverflowError:  # an int beyond a float's range
        f = math.inf
    if f is None or not (math.isfinite(f) and ok(f)):
        raise refused(name, _quoted(value, x), allowed)
    return f + 0.0


def choice(value: Any, name: str, choices: tuple[str, ...], fold: bool = False) -> str:
    """One of `choices` (with `fold`: spaces and case ignored)."""
    text = value.strip().lower() if fold and isinstance(value, str) else value
    if not isinstance(text, str) or text not in choices:
        raise refused(name, value, f"one of {', '.join(choices)}")
    return text


# ---- the settings ----

def k(value: Any) -> int:
    return whole(value, "k", MIN_K, MAX_K_ENGINE)


def max_new_tokens(value: Any) -> int:
    return whole(value, "max new tokens", 1)


def temperature(value: Any) -> float:
    return real(value, "temperature", lambda x: x >= 0, "a finite number of at least 0 (0 is greedy)")


def top_p(value: Any) -> float:
    return real(value, "top-p", lambda x: 0 < x <= 1, "a number above 0 and at most 1")


def top_k(value: Any) -> int:
    return whole(value, "top-k", 0, allowed="a whole number of at least 0 (0 keeps every token)")


def seed(value: Any) -> int:
    return whole(value, "seed", 0, MAX_SEED)


def verification(value: Any) -> str:
    return choice(value, "verification", VERIFICATION_RULES, fold=True)


def verifications(text: Any, temp: float) -> list[str]:
    """'token,block' -> ['token', 'block'] (each once; each checked as `verification`); several only when sampling."""
    rules = list(dict.fromkeys(verification(x) for x in str(text).split(",") if x.strip()))
    if not rules:
        raise refused("verification", text, f"one of {', '.join(VERIFICATION_RULES)}, or a comma list of them")
    if len(rules) > 1 and temp <= 0:
        raise UserError(f"verification lists several rules ({', '.join(rules)}), but at temperature 0 every rule is "
                        "greedy; give a temperature above 0 (for example 1.0) or one rule.")
    return rules


def tree(value: Any) -> str:
    """--tree: auto, off, or the most nodes a draft tree may have per step."""
    try:
        return parse_tree(value)
    except ValueError:
        raise refused("tree", value, f"auto, off or a node count from 1 to {MAX_K_ENGINE}") from None


def trees(value: Any) -> list[str]:
    """Several tree settings, 'off,auto,16' or a list of them (each once; each checked as `tree`): bench's --tree and
    Tune k's settings to sweep."""
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    settings = list(dict.fromkeys(tree(x) for x in items if str(x).strip()))
    if not settings:
        raise refused("tree", value, f"auto, off or a node count from 1 to {MAX_K_ENGINE}, or a comma list of them")
    return settings


def drafter(value: Any) -> str:
    return choice(value, "drafter", names())


def ks(text: Any) -> list[int] | str:
    """bench's --k: 'auto', or k values like 4 or 1,2,4,8 (each checked as `k`)."""
    if isinstance(text, str) and text.strip().lower() == "auto":
        return "auto"
    values = [k(x) for x in str(text).split(",") if x.strip()]
    if not values:
        raise refused("k", text, f"a whole number from {MIN_K} to {MAX_K_ENGINE}, a list like 1,2,4,8, or auto")
    return values


def count(name: str) -> Callable[[Any], int]:
    """A check for a count of something (threads, GPUs, batches): a whole number of at least 1."""
    return lambda value: whole(value, name, 1)


def device(value: Any, name: str = "device") -> str | None:
    """auto (None), cpu, cuda, cuda:N, mps, ...: what torch.device reads."""
    import torch

    if value is None or str(value).strip() in ("", "auto"):
        return None
    try:
        torch.device(str(value).strip())
    except (RuntimeError, ValueError, TypeError):
        raise refused(name, value, "auto, cpu, cuda, cuda:N or mps") from None
    return str(value).strip()


def prompt(text: Any) -> str:
    if not isinstance(text, str) or not text.strip():
        raise UserError("The prompt is empty: type something for the model to continue.")
    return text


def prompt_fits(n: int, context: int | None, new_tokens: int, target: str, most: int | None = None) -> None:
    """A prompt of n tokens and new_tokens more must fit in the target's context (and under `most`, a server's cap)."""
    if context and new_tokens >= context:
        raise refused("max new tokens", new_tokens, f"at most {context - 1} for {target} (its context of "
                                                    f"{context:,} tokens holds the prompt too)")
    room = [x for x in (most, context - new_tokens if context else None) if x is not None]
    if room and n > min(room):
        raise UserError(f"The prompt is too long: {n:,} tokens, at most {min(room):,} here"
                        + (f" ({target}'s context is {context:,} tokens, {new_tokens} of them for new tokens)."
                           if context else "."))


def prompt_tokens(target: str, text: str, new_tokens: int, runtime: Runtime = Runtime(), chat_template: bool = True,
                  trust_remote_code: bool = False, where: str = "") -> int:
    """Count a prompt's tokens with the target's tokenizer (no weights) and refuse it when it cannot fit; `where`
    (a file and line) opens the refusal."""
    from .engine import encode_prompt
    from .models.loading import load_tokenizer

    tokenizer, context = load_tokenizer(target, trust_remote_code, runtime)
    try:
        n = len(encode_prompt(tokenizer, prompt(text), chat_template))
        prompt_fits(n, context, new_tokens, target)
    except UserError as exc:
        raise UserError(f"{where}: {exc}" if where else str(exc)) from None
    return n


# ---- models: ids and folders ----

def not_a_model(folder: str, head: bool = False, trust_remote_code: bool = False) -> str | None:
    """Why a folder is not a model (no config.json, or one transformers cannot read), or None when it is one; with
    `head`, an EAGLE-3 head (or `export`'s folder) is one."""
    from .models.eagle3 import eagle3_export, is_eagle3, read_config

    if is_eagle3(folder) or eagle3_export(folder):
        return None if head else "an EAGLE-3 head, which drafts for a target (give it as the draft)"
    if read_config(folder) is None:
        return "a folder with no config.json" if not os.path.exists(os.path.join(folder, "config.json")) else \
            "its config.json is not JSON"
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"transformers cannot read its config.json ({str(exc).strip().splitlines()[0][:300].rstrip('.')})"
    return None


def is_hub_id(name: str) -> bool:
    """Whether a name is a hub repository id by the Hub's rules (huggingface_hub's validate_repo_id, ASCII only)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return name.isascii()


def model(name: Any, role: str = "target", trust_remote_code: bool = False) -> str:
    """A target or draft name: one of ours, a folder that holds a model, or a hub id by the Hub's rules."""
    from .models.loading import BUNDLED_ALIASES

    own = BUNDLED_ID if role == "target" else TRAINED_DRAFT_ID
    allowed = (f"a model folder (a config.json transformers reads{'' if role == 'target' else ', or an EAGLE-3 head'}"
               f"), a hub id like org/name, or {own}")
    text = name.strip() if isinstance(name, str) else ""
    if text.lower() in BUNDLED_ALIASES | {TRAINED_DRAFT_ID}:
        return text
    if text and os.path.isdir(text):
        why = not_a_model(text, role == "draft", trust_remote_code)
        if why:
            raise UserError(f"{role} must be {allowed}, got {shown(name)}: {why}.")
        return text
    if not text or not is_hub_id(text):
        raise refused(role, name, allowed)
    return text


def pair(target: str, kind: str, draft: str | None, trust_remote_code: bool = False) -> None:
    """The target and draft names, and the draft against the drafter: named only for a kind that takes one, and
    given (or shipped for the target) when it needs one."""
    from .drafters.resolve import default_draft

    model(target, "target", trust_remote_code)
    kind = drafter(kind)
    try:
        check_draft(kind, draft)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if draft:
        model(draft, "draft", trust_remote_code)
    elif get(kind).needs_draft and default_draft(target) is None:
        lookups = ", ".join(x.name for x in kinds() if not x.needs_draft)
        raise UserError(f"drafter {kind} needs a draft: {target} ships no trained draft, so name one (same tokenizer) "
                        f"or choose a drafter that takes none ({lookups}).")


def space_id(value: Any) -> str:
    """A Space id by the Hub's rules, with its owner: checked before anything is planned or uploaded."""
    text = value.strip() if isinstance(value, str) else ""
    if text.count("/") != 1 or not is_hub_id(text):
        raise refused("the Space id", value, SPACE_ID_RULES)
    return text


# ---- argparse ----

def arg(check: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse `type` that runs a check: a refusal becomes argparse's error (Parser's UserError)."""

    def parse(text: str) -> Any:
        try:
            return check(text)
        except UserError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = getattr(check, "__name__", "value")
    return parse


class Parser(argparse.ArgumentParser):
    """argparse whose refusals are UserErrors (`argument --k: k must be ...`), which the CLI prints on one line with
    exit status 2, as it does every other refusal; its subcommands' parsers are of this class too."""

    def error(self, message: str):
        raise UserError(message)
