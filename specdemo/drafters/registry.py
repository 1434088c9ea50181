"""The drafter kinds, in one list: each kind's id, the app's name for it, the factory that builds it for a loaded
target, whether it takes a draft, its vLLM and SGLang methods and its CLI help. The CLI, the bench, the app, the
request checks, compare and serve-config read it. Nothing heavy is imported here: the factories import at call time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..config import HYBRID_LOOKUP, Runtime, SuffixConfig

from .base import SharedState

if TYPE_CHECKING:
    from ..models.loading import LoadedModel
    from .base import Drafter
    from .hybrid import HybridCalibration

    Built = tuple[Drafter, str | None, HybridCalibration | None]  # (drafter, draft name or None, calibration or None)


@dataclass(frozen=True)
class BuildOptions:
    """How a factory loads a draft: a draft LM's device and dtype (None: the defaults), remote code, the runtime."""

    device: Any = None
    dtype: Any = None
    trust_remote_code: bool = False
    runtime: Runtime = Runtime()
    suffix: SuffixConfig = SuffixConfig()  # suffix decoding's options (vLLM's names)
    shared: SharedState | None = None  # what drafters keep across requests, owned by the caller (None: nothing kept)
    hybrid_lookup: str = HYBRID_LOOKUP  # the hybrid's model-free half: "ngram" or "suffix"
    speculative: Callable | None = None  # engine.speculative, for a kind that times its draft at load (the hybrid):
    # drafters never import the decoding loop, so whoever builds them passes it (compare.make_drafter)


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
    # can be checked against a calibration (metrics.cost_drift); not a hybrid's, which depends on how much lookup drafted


_KINDS: dict[str, DrafterKind] = {}


def register(kind: DrafterKind) -> DrafterKind:
    """Add a kind (after those already registered); a name is registered once."""
    if kind.name in _KINDS:
        raise ValueError(f"drafter kind '{kind.name}' is already registered")
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


# ---- the built-in kinds ----

def draft_drafter(target: LoadedModel, draft: str | None, options: BuildOptions) -> Built:
    """The drafter of a draft (drafts.resolve_draft says which): an EAGLE-3 head, computing where the target's
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
            return load_eagle3(resolved.path, target), resolved.name, None
        except Eagle3FormatError as exc:
            raise ModelLoadError(str(exc)) from exc
    loaded = load_model(resolved.name, device=options.device, dtype=options.dtype,
                        trust_remote_code=options.trust_remote_code, runtime=options.runtime)
    check_tokenizers(target, loaded.name, loaded.tokenizer)
    return ModelDrafter(loaded.model, target.device), resolved.name, None


def lookup_drafter(target: LoadedModel, draft: str | None, options: BuildOptions) -> Built:
    """Prompt lookup: no model."""
    from .ngram import NgramDrafter

    return NgramDrafter(), None, None


def suffix_drafter(target: LoadedModel, draft: str | None, options: BuildOptions) -> Built:
    """Suffix decoding: no model; earlier answers come from the SuffixCache in options.shared. Cost-aware, it times
    the target's verify passes at load."""
    from .suffix import SuffixCache, SuffixDrafter

    costs = None
    if options.suffix.cost_aware:
        from ..config import MAX_K
        from ..engine.timing import PROBE_TEXT, load_time_verify_costs

        costs = load_time_verify_costs(target.model, target.tokenizer(PROBE_TEXT)["input_ids"], MAX_K)
    return SuffixDrafter(SuffixCache.of(options.shared, options.suffix), options.suffix, pass_costs=costs), None, None


def hybrid_drafter(target: LoadedModel, draft: str | None, options: BuildOptions) -> Built:
    """A draft (as draft_drafter) with prompt lookup, or suffix decoding (options.hybrid_lookup), taking over where
    the context repeats, calibrated here."""
    from ..config import HYBRID_LOOKUPS
    from .hybrid import calibrated_hybrid

    if options.speculative is None:
        raise ValueError("the hybrid times its draft at load: BuildOptions.speculative must be engine.speculative")
    if options.hybrid_lookup not in HYBRID_LOOKUPS:
        raise ValueError(f"the hybrid's lookup is one of {', '.join(HYBRID_LOOKUPS)}, not '{options.hybrid_lookup}'")
    lookup = None
    if options.hybrid_lookup == "suffix":
        from .suffix import SuffixCache, SuffixDrafter

        lookup = SuffixDrafter(SuffixCache.of(options.shared, options.suffix), options.suffix, min_match=3)
    model, name, _ = draft_drafter(target, draft, options)
    hybrid, calibration = calibrated_hybrid(model, target, options.speculative, name, lookup=lookup)
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
               "its draft half, and --drafter ngram gives its lookup half"))
register(DrafterKind(
    "suffix", "suffix decoding", suffix_drafter, needs_draft=False, vllm_method="suffix", sglang_method="SUFFIX",
    help="suffix decoding, no draft model: the most frequent continuation of the context's suffix in this request "
         "and in earlier answers (kept per process), as long as the match supports; k is the most per step"))
