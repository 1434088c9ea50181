"""The app's plain parts, with no gradio: the limits of a deployment and the checks of a request against them (numbers,
model ids, local paths, prompt length), the finished runs and their costs, errors in words, and the race's pacing
(live throttling, the replay at the measured pace); the summary text is in summary.py. The handlers call these;
nothing here loads a model's weights.
"""

from __future__ import annotations

import contextlib
import os
import time
from bisect import bisect_right
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from .. import checks
from ..checks import UserError
from ..config import (
    BUNDLED_ID,
    PRESETS,
    TRAINED_DRAFT_ID,
    TREE_DEFAULT,
    GenerationConfig,
    Placement,
    Runtime,
    SamplingConfig,
    tree_default,
)
from ..drafters.registry import get
from ..drafters.resolve import starting_k
from ..engine import GenerationError, StepEvent, encode_prompt
from ..measure.tune_k import Run, SweepPoint, point
from ..models.fit import estimate_fit, parameter_count
from ..models.loading import (
    BUNDLED_ALIASES,
    ModelLoadError,
    TokenizerMismatchError,
    default_dtype,
    is_loaded,
    load_device,
    load_tokenizer,
    locate,
)
from .render import Segment
from .worker import WorkerError

TEXT_EVERY = 0.1  # seconds between text updates of a replay
LIVE_TEXT_EVERY = 0.5  # seconds between text updates while runs are timed (the page's drawing takes their CPU)
PLOTS_EVERY = 0.5  # seconds between plot updates of a replay
PROMPT_TOKENS_CEILING = 4096  # the default prompt cap never exceeds this
CHARS_PER_TOKEN = 16  # a prompt with more characters than this per allowed token is refused before tokenizing
OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


@dataclass(frozen=True)
class AppLimits:
    """Guards for a public deployment, read from the environment by app.py (its docstring names the variables)."""

    max_new_tokens: int = 256  # cap on max new tokens
    allowlist: tuple[str, ...] = ()  # model ids users may load (the bundled ones always); empty: any id
    device: str | None = None  # None: CUDA when present, else CPU
    max_prompt_tokens: int | None = None  # None: the target's context minus max new tokens, at most 4096
    allow_local_paths: bool = False  # whether model ids may be folders on the server's disk
    placement: Placement = Placement()  # a device map for every target (SPECDEMO_DEVICE_MAP, SPECDEMO_MAX_MEMORY,
    # SPECDEMO_OFFLOAD_FOLDER); without one, only the presets that need a map get it (with these memory limits)
    draft_device: str | None = None  # the draft's device (SPECDEMO_DRAFT_DEVICE); None: the target's


# ---- requests ----

@dataclass(frozen=True)
class RunRequest:
    """Widget values for one comparison, as plain data."""

    prompt: str
    target: str
    drafter: str  # a registry kind's name
    draft: str | None
    k: int
    dynamic_k: bool
    temperature: float
    top_p: float
    max_new_tokens: int
    verification: str = "token"  # the rule for sampled drafts (SamplingConfig.verification); greedy ignores it
    tree: str | None = None  # draft trees (--tree); None: the drafter's measured default (config.tree_default)

    def config(self) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=self.max_new_tokens, num_draft_tokens=self.k, dynamic_k=self.dynamic_k,
                                sampling=SamplingConfig(temperature=self.temperature, top_p=self.top_p,
                                                        verification=self.verification),
                                tree=self.tree or tree_default(self.drafter))


def flag(value, name: str) -> bool:
    """A checkbox value: a bool, or its usual spellings from an API client."""
    if isinstance(value, bool) or value in (0, 1):
        return bool(value)
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on", "false", "0", "no", "off", ""):
        return text in ("true", "1", "yes", "on")
    raise UserError(f"{name} must be true or false, got {value!r}.")


def make_request(prompt, target, drafter, draft, k, dynamic_k, temperature, top_p, max_new_tokens,
                 limits: AppLimits, verification="token", tree=None) -> RunRequest:
    """Validate widget (or API) values: the checks every entry point runs (specdemo.checks), then this server's
    limits on top (max new tokens, the allowlist, local paths); raise UserError with a readable message. Cheap: the
    prompt is checked by its characters here, by its tokens later (check_prompt_tokens)."""
    prompt, drafter = checks.prompt(prompt), checks.drafter(drafter)
    k, max_new_tokens = checks.k(k), checks.max_new_tokens(max_new_tokens)
    if max_new_tokens > limits.max_new_tokens:
        raise checks.refused("max new tokens", max_new_tokens, f"at most {limits.max_new_tokens} here")
    temperature, top_p = checks.temperature(temperature), checks.top_p(top_p)
    verification = checks.verification("token" if verification in (None, "") else verification)
    # none sent (an older client) or "default": the drafter's measured default (config.tree_default)
    tree = None if tree in (None, "", TREE_DEFAULT) else checks.tree(tree)
    check_prompt_chars(prompt, limits)
    target = str(target or "").strip() or BUNDLED_ID
    # the page keeps the draft box's value when another drafter is picked: a kind that takes no draft ignores it
    draft = (str(draft or "").strip() or None) if get(drafter).needs_draft else None
    for name in (target, draft):
        if name:
            check_model_id(name, limits)
    checks.pair(target, drafter, draft)
    return RunRequest(prompt, target, drafter, draft, k, flag(dynamic_k, "dynamic k"), temperature, top_p,
                      max_new_tokens, verification, tree)


# ---- model ids: the allowlist and local paths ----

def preset_ids() -> tuple[str, ...]:
    """Every target and draft id of config.PRESETS: what a Space may load when no allowlist is given."""
    ids = [name for p in PRESETS for name in (p.target, p.draft) if name]
    return tuple(dict.fromkeys(ids))


def is_local_path(name: str) -> bool:
    """Whether a model id names the server's filesystem rather than a hub repository or one of the app's own ids."""
    if name.lower() in BUNDLED_ALIASES | {TRAINED_DRAFT_ID}:
        return False
    return (name.startswith(("/", "~", ".")) or "\\" in name or ":" in name or name.count("/") > 1
            or os.path.exists(name))


def allowed(name: str, limits: AppLimits) -> bool:
    """Whether the allowlist lets a model id load: always the bundled model and its trained draft."""
    return not limits.allowlist or name in limits.allowlist or name.lower() in BUNDLED_ALIASES | {TRAINED_DRAFT_ID}


def check_model_id(name: str, limits: AppLimits) -> None:
    """Refuse a local path (unless the server allows them) or an id off the allowlist."""
    if not limits.allow_local_paths and is_local_path(name):
        raise UserError(f"{name!r} looks like a path on the server; this server loads models by hub id only "
                        "(its operator can allow folders with SPECDEMO_ALLOW_LOCAL_PATHS=1).")
    if not allowed(name, limits):
        raise UserError(f"{name!r} is not allowed on this server; allowed: {', '.join(limits.allowlist)} "
                        f"and the bundled {BUNDLED_ID}.")


CUSTOM = "Custom (type the ids below)"


def preset_choices(limits: AppLimits) -> list[str]:
    """Preset labels (bundled offline ones first, as in config.PRESETS) that the allowlist permits."""
    ok = [p.label for p in PRESETS if allowed(p.target, limits) and (p.draft is None or allowed(p.draft, limits))]
    return ok + [CUSTOM]


def matching_preset(target: str, kind: str, draft: str, limits: AppLimits) -> str:
    """The preset the settings are (its target and drafter kind, and its draft where the kind takes one), else
    Custom: what the Preset box shows once a drafter is picked by hand."""
    for label in preset_choices(limits)[:-1]:
        t, k, d = preset_fields(label)
        if (t, k) == (target, kind) and (d == (draft or "") or not get(kind).needs_draft):
            return label
    return CUSTOM


def preset_fields(label: str) -> tuple[str, str, str] | None:
    """(target, drafter kind, draft id) of a preset; None for Custom."""
    preset = next((p for p in PRESETS if p.label == label), None)
    if preset is None:
        return None
    return preset.target, preset.drafter or ("ngram" if preset.draft is None else "model"), preset.draft or ""


def preset_k(label: str, runtime: Runtime = Runtime()) -> int:
    """The k a preset starts at: its pair's starting k (resolve.starting_k, the measured default on the bundled
    pairs, as generate and bench take it); GenerationConfig's for Custom."""
    fields = preset_fields(label)
    if fields is None:
        return GenerationConfig.num_draft_tokens
    target, kind, draft = fields
    return starting_k(kind, target, draft or None, runtime)[0]


def placement_for(target: str, limits: AppLimits) -> Placement:
    """The server's device map for every target, else a preset's for its target (with the server's memory limits and
    offload folder), else none: the whole target on one device."""
    if limits.placement.active:
        return limits.placement
    strategy = next((p.device_map for p in PRESETS if p.target == target and p.device_map), None)
    if strategy is None:
        return Placement()
    return Placement(strategy, limits.placement.max_memory, limits.placement.offload_folder)


# ---- memory, before loading any weights ----

def check_fit(request: RunRequest, limits: AppLimits, runtime: Runtime, placement: Placement) -> str | None:
    """About how much memory the pair needs against what this server allows (fit.estimate_fit), from parameter counts
    alone; UserError when it cannot fit. Returns the estimate in words, or None when a model is already loaded or no
    count can be had (then loading itself says what goes wrong)."""
    if is_loaded(request.target):
        return None
    model_ids = [request.target] + ([request.draft] if request.draft and get(request.drafter).needs_draft else [])
    counts = []
    for name in model_ids:
        if name == TRAINED_DRAFT_ID:
            continue  # a draft head of a few million parameters, borrowing the target's embeddings
        try:
            count = parameter_count(*locate(name, runtime), runtime)
        except ModelLoadError:  # not found: loading says so in full
            return None
        if count is None:
            return None
        counts.append(count)
    device = load_device(placement, limits.device)
    fit = estimate_fit(counts, default_dtype(device).itemsize, placement, device)
    message = fit.message(" + ".join(model_ids))
    if not fit.fits:
        raise UserError(f"This pair does not fit here: {message}")
    return message


# ---- the prompt's length, before any model work ----

def check_prompt_chars(prompt: str, limits: AppLimits) -> None:
    """Refuse a prompt far too long to tokenize, by its length alone (no tokenizer)."""
    most = (limits.max_prompt_tokens or PROMPT_TOKENS_CEILING) * CHARS_PER_TOKEN
    if len(prompt) > most:
        raise UserError(f"The prompt is too long: {len(prompt):,} characters, at most {most:,} here (and at most "
                        f"{limits.max_prompt_tokens or PROMPT_TOKENS_CEILING:,} tokens). Shorten it.")


def check_prompt_tokens(request: RunRequest, limits: AppLimits, runtime: Runtime) -> int:
    """Count the prompt's tokens (chat template included) with the target's tokenizer only, no weights; refuse it
    over the limit: the target's context minus max new tokens (checks.prompt_fits), and SPECDEMO_MAX_PROMPT_TOKENS,
    else 4096, on top. Returns the count."""
    tokenizer, context = load_tokenizer(request.target, runtime=runtime)
    n = len(encode_prompt(tokenizer, request.prompt, request.config().use_chat_template))
    checks.prompt_fits(n, context, request.max_new_tokens, request.target, limits.max_prompt_tokens or
                       PROMPT_TOKENS_CEILING)
    return n


# ---- the finished runs ----

@dataclass
class Runs:
    """Both runs as far as they got: events, display segments per event, and the CLI's JSON result at the end."""

    ar_events: list[StepEvent] = field(default_factory=list)
    sd_events: list[StepEvent] = field(default_factory=list)
    ar_segments: list[list[Segment]] = field(default_factory=list)
    sd_segments: list[list[Segment]] = field(default_factory=list)
    result: dict = field(default_factory=dict)

    def add(self, which: str, event: StepEvent, segments: list[Segment]) -> None:
        events, segs = (self.ar_events, self.ar_segments) if which == "ar" else (self.sd_events, self.sd_segments)
        events.append(event)
        segs.append(segments)

    @property
    def done(self) -> bool:
        return bool(self.result)


def points(events: list[StepEvent], n: int | None = None) -> list[tuple[float, int]]:
    """(seconds, tokens) after each of the first n events, from (0, 0)."""
    return [(0.0, 0)] + [(e.elapsed, e.num_generated) for e in events[:n]]


def run_point(runs: Runs) -> SweepPoint | None:
    """Both runs as one point of the Tune-k sweep (sweep.point), so alpha, c (draft seconds per drafted token over
    the autoregressive seconds per 1-token pass) and the verify cost (seconds per verify step over the same) mean
    what they mean there. None before both runs have events."""
    if not runs.ar_events or not runs.sd_events:
        return None
    return point(max(1, runs.result.get("k", 1)), [Run(runs.ar_events, runs.ar_events[-1].elapsed)],
                 [Run(runs.sd_events, runs.sd_events[-1].elapsed)])


def drafted_at(events: list[StepEvent], width: int) -> list[int]:
    """How many speculative steps drafted a token at each position 1..width (the per-position rates' denominators)."""
    return [sum(1 for e in events if e.kind == "spec" and len(e.drafted) > i) for i in range(width)]


def passes(events: list[StepEvent]) -> list[tuple[float, float, float]]:
    """(start, draft seconds, verify seconds) of each step on its run's own clock (a step starts where the one
    before it ended, since the clock counts only compute)."""
    starts = [0.0] + [e.elapsed for e in events[:-1]]
    return [(s, e.draft_seconds, e.verify_seconds) for s, e in zip(starts, events)]


def friendly_error(exc: Exception) -> str:
    """A one-paragraph message for the status line."""
    if isinstance(exc, (OOM, MemoryError)) or (isinstance(exc, ModelLoadError) and "out of memory" in str(exc)):
        return f"Out of memory: {exc}. Try a smaller model pair or fewer new tokens."
    if isinstance(exc, TokenizerMismatchError):
        return f"Tokenizer mismatch: {exc}"
    if isinstance(exc, ModelLoadError):
        return f"Could not load the model: {exc}"
    return str(exc)


def free_memory(exc: Exception) -> None:
    """After running out of memory, hand CUDA's cached blocks back, so that the next (smaller) request can load."""
    if "out of memory" in friendly_error(exc).lower()[:20] and torch.cuda.is_available():
        with contextlib.suppress(RuntimeError):  # torch refuses while a failed capture's pool stays open
            torch.cuda.empty_cache()


KNOWN_ERRORS = (UserError, ModelLoadError, TokenizerMismatchError, GenerationError, ValueError, OOM, MemoryError,
                WorkerError)


# ---- pacing ----

class Throttle:
    """Whether a live frame is due: at most every `every` seconds (wall time); a final frame is always due. Live
    frames carry text only: the plots are drawn when the timed work is over."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, every: float = LIVE_TEXT_EVERY):
        self.clock = clock
        self.every = every
        self.last = float("-inf")

    def due(self, final: bool = False) -> bool:
        now = self.clock()
        if final or now - self.last >= self.every:
            self.last = now
            return True
        return False


def replay_frames(ar_times: list[float], sd_times: list[float], pace: bool = True,
                  clock: Callable[[], float] = time.monotonic,
                  sleep: Callable[[float], None] = time.sleep) -> Iterator[tuple[int, int, bool]]:
    """(events of AR shown, events of SD shown, plots due) as each run's events come due at their measured times.

    Text frames come at most every TEXT_EVERY seconds, plot refreshes every PLOTS_EVERY; the last frame shows all.
    """
    end = max(ar_times[-1:] + sd_times[-1:] + [0.0])
    if not pace:
        yield len(ar_times), len(sd_times), True
        return
    start, last_plot, shown = clock(), float("-inf"), None
    while True:
        t = clock() - start
        final = t >= end
        n = (len(ar_times), len(sd_times)) if final else (bisect_right(ar_times, t), bisect_right(sd_times, t))
        if n != shown or final:
            plots = final or t - last_plot >= PLOTS_EVERY
            last_plot = t if plots else last_plot
            shown = n
            yield n[0], n[1], plots
        if final:
            return
        sleep(min(TEXT_EVERY, end - t))
