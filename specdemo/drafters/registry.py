"""The drafter kinds, in one list: each kind's id, the app's name for it, the factory that builds it for a loaded
target, whether it takes a draft, its vLLM and SGLang methods, its CLI help, and its options with the flags that set
them. The CLI, the bench, serve-config, the app, the request checks and compare read it. Nothing heavy is imported
here: the factories import at call time.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..config import HYBRID_LOOKUPS, VLLM_SUFFIX, HybridConfig, Runtime, SuffixConfig
from .base import SharedState

if TYPE_CHECKING:
    from ..models.loading import LoadedModel
    from .base import Calibration, Drafter

    Built = tuple[Drafter, str | None, Calibration | None]  # (drafter, draft name or None, calibration or None)

COMMANDS = ("generate", "bench", "serve-config")  # the subcommands that build or serve a drafter


@dataclass(frozen=True)
class Flag:
    """One command-line flag of a kind: it sets `field` of the kind's options, whose default (config's) it shows; a
    bool field is a switch. `commands` are the subcommands that take it."""

    name: str  # "--suffix-max-tree-depth"
    field: str  # the options' field it sets
    help: str  # may name %(default)s
    choices: tuple[str, ...] | None = None
    commands: tuple[str, ...] = COMMANDS

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class BuildOptions:
    """How a factory builds: a draft LM's device and dtype (None: the defaults), remote code, the runtime; each kind's
    options; what drafters keep across requests; the engine's speculative loop for a kind that times itself."""

    device: Any = None
    dtype: Any = None
    trust_remote_code: bool = False
    runtime: Runtime = Runtime()
    drafter_options: Mapping[str, Any] = field(default_factory=dict)  # kind name -> its options (absent: defaults)
    shared: SharedState | None = None  # what drafters keep across requests, owned by the caller (None: nothing kept)
    speculative: Callable | None = None  # engine.speculative, for a kind that times its draft at load (the hybrid):
    # drafters never import the decoding loop, so whoever builds them passes it (compare.make_drafter)

    def of(self, name: str) -> Any:
        """Kind `name`'s options: as given, else its defaults."""
        return options_of(name, self.drafter_options)


@dataclass(frozen=True)
class DrafterKind:
    """One drafter kind, as every layer names and builds it."""

    name: str  # the id used everywhere: the CLI's --drafter, requests, results
    label: str  # the app's name for it
    factory: Callable[[LoadedModel, str | None, BuildOptions], Built]  # (target, draft or None, options)
    needs_draft: bool  # whether it uses a draft (model or head): --draft, or the target's trained draft
    vllm_method: str | None = None  # vLLM's speculative method; None: the draft's (eagle3 or draft_model)
    sglang_method: str | None = None  # SGLang's --speculative-algorithm; None: the draft's (EAGLE3 or STANDALONE)
    help: str = ""  # one line for the CLI's --drafter help
    serve_note: str = ""  # what serve-config says when the engines have no such drafter
    steady_draft_cost: bool = True  # whether its cost per drafted token is the same from prompt to prompt, so a run's
    # can be checked against a calibration (metrics.cost_drift); not a hybrid's, which depends on how much lookup
    # drafted
    options: Callable[[], Any] | None = None  # its options' class: a frozen dataclass whose defaults are the flags'
    # (an optional validate() checks a set of them); None: it takes none. The factory reads BuildOptions.of(name)
    flags: tuple[Flag, ...] = ()  # the flags that set its options, in every command that builds or serves it


_KINDS: dict[str, DrafterKind] = {}


def register(kind: DrafterKind) -> DrafterKind:
    """Add a kind (after those already registered); a name is registered once."""
    if kind.name in _KINDS:
        raise ValueError(f"drafter kind '{kind.name}' is already registered")
    if kind.flags and kind.options is None:
        raise ValueError(f"drafter kind '{kind.name}' has flags but no options for them to set")
    _KINDS[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    """Remove a kind (tests register toy kinds and remove them after)."""
    _KINDS.pop(name, None)


def kinds() -> tuple[DrafterKind, ...]:
    """Every registered kind, in registration order."""
    return tuple(_KINDS.values())


def names() -> tuple[str, ...]:
    """The registered kinds' ids: the --drafter choices."""
    return tuple(_KINDS)


def get(name: str) -> DrafterKind:
    """The kind with this id; ValueError names the choices."""
    try:
        return _KINDS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown drafter '{name}'; choose one of {', '.join(names())}") from None


def check_draft(name: str, draft: str | None) -> None:
    """ValueError when a draft is named for a kind that takes none."""
    kind = get(name)
    if draft and not kind.needs_draft:
        raise ValueError(f"--draft names a draft model, but --drafter {kind.name} ({kind.label}) uses none")


def cli_help(default: str | None = None) -> str:
    """--drafter's help: each kind's line."""
    return "; ".join(f"'{k.name}'{' (default)' if k.name == default else ''}: {k.help}" for k in kinds())


# ---- each kind's options, and the flags that set them ----

def options_of(name: str, given: Mapping[str, Any]) -> Any:
    """Kind `name`'s options in `given` (kind name -> options), else its defaults; None for a kind that takes none."""
    kind = get(name)
    options = given.get(name)
    return options if options is not None or kind.options is None else kind.options()


def default_options() -> dict[str, Any]:
    """Every kind's default options, by name (the kinds that take some)."""
    return {k.name: k.options() for k in kinds() if k.options is not None}


def add_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """Every kind's flags that `command` takes, defaulting to the kind's options' defaults."""
    for kind in kinds():
        defaults = kind.options() if kind.options is not None else None
        for flag in kind.flags:
            if command not in flag.commands:
                continue
            default = getattr(defaults, flag.field)
            if isinstance(default, bool):
                parser.add_argument(flag.name, dest=flag.dest, default=default, help=flag.help,
                                    action=argparse.BooleanOptionalAction if default else "store_true")
            else:
                parser.add_argument(flag.name, dest=flag.dest, type=type(default), default=default,
                                    choices=flag.choices, help=flag.help)


def options_from(args: argparse.Namespace) -> dict[str, Any]:
    """Each kind's options from parsed flags (a flag the command does not take keeps its default), checked by their
    validate() (ValueError)."""
    out = {}
    for kind in kinds():
        if kind.options is None:
            continue
        options = replace(kind.options(), **{f.field: getattr(args, f.dest) for f in kind.flags
                                              if hasattr(args, f.dest)})
        if hasattr(options, "validate"):
            options.validate()
        out[kind.name] = options
    return out


# ---- the built-in kinds ----

def draft_drafter(target: LoadedModel, draft: str | None, options: BuildOptions) -> Built:
    """The drafter of a draft (resolve.resolve_draft says which): an EAGLE-3 head, computing where the target's
    embeddings are, or a causal LM sharing the target's tokenizer, on options.device."""
    from ..models.eagle3 import Eagle3FormatError
    from ..models.loading import ModelLoadError, check_tokenizers, load_model
    from .eagle3 import load_eagle3
    from .model import ModelDrafter
    from .resolve import DraftError, resolve_draft

    try:
        resolved = resolve_draft(draft, target.name, options.runtime)
    except DraftError as exc:
        raise ModelLoadError(str(exc)) from exc
    if resolved.is_head:
        try:
            head = load_eagle3(resolved.path, target, options.runtime)
            head.pass_costs = tree_pass_costs(target)  # sizes its dynamic trees (--tree auto)
            return head, resolved.name, None
        except Eagle3FormatError as exc:
            raise ModelLoadError(str(exc)) from exc
    loaded = load_model(resolved.name, device=options.device, dtype=options.dtype,
                        trust_remote_code=options.trust_remote_code, runtime=options.runtime)
    check_tokenizers(target, loaded.name, loaded.tokenizer)
    return ModelDrafter(loaded.model, target.device), resolved.name, None


def tree_pass_costs(target: LoadedModel) -> dict[int, float]:
    """The target's pass costs that size draft trees (--tree auto) and cost-aware suffix drafts: timed at its first
    load (engine.timing.load_time_verify_costs) up to the widest pass auto considers there (config.auto_tree_nodes:
    wider on a GPU), then remembered."""
    from ..config import auto_tree_nodes
    from ..engine.timing import PROBE_TEXT, load_time_verify_costs

    return load_time_verify_costs(target.model, target.tokenizer(PROBE_TEXT)["input_ids"],
                                  auto_tree_nodes(target.device))


def lookup_drafter(target: LoadedModel, draft: str | None, options: BuildOptions) -> Built:
    """Prompt lookup: no model; the target's pass costs size its trees."""
    from .ngram import NgramDrafter

    return NgramDrafter(pass_costs=tree_pass_costs(target)), None, None


def suffix_drafter(target: LoadedModel, draft: str | None, options: BuildOptions) -> Built:
    """Suffix decoding: no model; earlier answers come from the SuffixCache in options.shared. The target's pass
    costs, timed at load, size its trees and, cost-aware, cut its chains."""
    from .suffix import SuffixCache, SuffixDrafter

    config = options.of("suffix")
    return SuffixDrafter(SuffixCache.of(options.shared, config), config, pass_costs=tree_pass_costs(target),
                         cost_aware=config.cost_aware), None, None


def hybrid_drafter(target: LoadedModel, draft: str | None, options: BuildOptions) -> Built:
    """A draft (as draft_drafter) with prompt lookup, or suffix decoding (its options' lookup, drafting with suffix
    decoding's options), taking over where the context repeats, calibrated here."""
    from .hybrid import calibrated_hybrid

    if options.speculative is None:
        raise ValueError("the hybrid times its draft at load: BuildOptions.speculative must be engine.speculative")
    config = options.of("hybrid")
    config.validate()
    lookup = None
    if config.lookup == "suffix":
        from .suffix import SuffixCache, SuffixDrafter

        suffix = options.of("suffix")
        lookup = SuffixDrafter(SuffixCache.of(options.shared, suffix), suffix, min_match=3)
    model, name, _ = draft_drafter(target, draft, options)
    hybrid, calibration = calibrated_hybrid(model, target, options.speculative, name, lookup=lookup,
                                            pass_costs=tree_pass_costs(target))
    return hybrid, name, calibration


register(DrafterKind(
    "model", "draft model", draft_drafter, needs_draft=True,
    help="--draft (an EAGLE-3 head, or a causal LM sharing the target's tokenizer) or the target's trained draft"))
register(DrafterKind(
    "ngram", "prompt lookup", lookup_drafter, needs_draft=False, vllm_method="ngram", sglang_method="NGRAM",
    help="prompt lookup, no draft model: the tokens that followed the context's last n-gram where it appeared "
         "before"))
register(DrafterKind(
    "hybrid", "draft + lookup", hybrid_drafter, needs_draft=True,
    help="prompt lookup where the context repeats (up to k tokens) and the draft elsewhere (1 token per step where "
         "a 3-token verify pass costs too much more than a 2-token one, as on a small CPU; measured at load)",
    steady_draft_cost=False,
    serve_note="vLLM has no hybrid drafter (prompt lookup where the context repeats, the draft elsewhere); this is "
               "its draft half, and --drafter ngram gives its lookup half",
    options=HybridConfig, flags=(
        Flag("--hybrid-lookup", "lookup", "--drafter hybrid: its model-free half, prompt lookup or suffix decoding "
             "(default %(default)s)", choices=HYBRID_LOOKUPS, commands=("generate", "bench")),)))
register(DrafterKind(
    "suffix", "suffix decoding", suffix_drafter, needs_draft=False, vllm_method="suffix", sglang_method="SUFFIX",
    help="suffix decoding, no draft model: the most frequent continuation of the context's suffix in this request "
         "and in earlier answers (kept per process), as long as the match supports; k is the most per step",
    options=SuffixConfig, flags=(  # vLLM's suffix_decoding_* options, with our measured defaults; the cost-aware cut
        Flag("--suffix-max-tree-depth", "max_tree_depth", "--drafter suffix: the longest match plus draft the trees "
             "hold (vLLM's suffix_decoding_max_tree_depth; default %(default)s)"),
        Flag("--suffix-max-cached-requests", "max_cached_requests", "--drafter suffix: earlier answers kept for "
             "drafting, oldest evicted first; 0: none (suffix_decoding_max_cached_requests; default %(default)s)"),
        Flag("--suffix-max-spec-factor", "max_spec_factor", "--drafter suffix: a match of L tokens drafts at most "
             f"this x L tokens (suffix_decoding_max_spec_factor; default %(default)s, vLLM's "
             f"{VLLM_SUFFIX.max_spec_factor})"),
        Flag("--suffix-min-token-prob", "min_token_prob", "--drafter suffix: the least estimated probability of a "
             "drafted token (suffix_decoding_min_token_prob; default %(default)s)"),
        Flag("--suffix-cost-aware", "cost_aware", "--drafter suffix: cut each draft where its expected accepted "
             "tokens stop paying for a wider verify pass (pass costs timed at load, acceptance learned as it runs; "
             "ours, not vLLM's; default on)"))))
