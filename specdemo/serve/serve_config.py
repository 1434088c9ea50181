"""What a tuned setting looks like in a serving engine: vLLM's speculative_config, the `vllm serve` command line and
SGLang's flags. Pure functions of the method, k, draft folder and lookup window; nothing here imports vLLM or gradio.

Names: "ngram" is prompt lookup (our NgramDrafter), "suffix" suffix decoding (our SuffixDrafter, with vLLM's
suffix_decoding_* options), "eagle3" an EAGLE-3 head exported by `python -m specdemo export`, "draft_model" a separate
draft LLM. vLLM's k is `num_speculative_tokens`, drafted tokens per step (ours).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..config import BUNDLED_HUB_ID, BUNDLED_ID, VLLM_SUFFIX, Runtime, SuffixConfig, drafter_default
from ..drafters import NgramDrafter
from ..drafters.registry import check_draft, get, options_of

VLLM_METHODS = ("ngram", "suffix", "eagle3", "draft_model")
# each method's SGLang algorithm
SGLANG_METHODS = {"ngram": "NGRAM", "suffix": "SUFFIX", "eagle3": "EAGLE3", "draft_model": "STANDALONE"}


@dataclass(frozen=True)
class Lookup:
    """Prompt lookup's match window: the suffix lengths it tries (vLLM's prompt_lookup_min / prompt_lookup_max)."""

    min_ngram: int
    max_ngram: int

    @classmethod
    def of(cls, drafter=None) -> Lookup:
        """The window of an NgramDrafter (a hybrid's lookup part), else of NgramDrafter's defaults."""
        lookup = getattr(drafter, "lookup", drafter)
        if not isinstance(lookup, NgramDrafter):
            lookup = NgramDrafter()
        return cls(lookup.min_ngram, lookup.max_ngram)


VLLM_REJECTION = {"token": "standard", "block": "block"}  # our verification rule -> vLLM's rejection_sample_method


def vllm_speculative_config(method: str, k: int, draft_path: str | None = None, lookup: Lookup | None = None,
                            verification: str = "token", suffix: SuffixConfig | None = None) -> dict:
    """vLLM's --speculative-config for k drafted tokens per step (the same dict LLM(speculative_config=...) takes);
    suffix decoding's k is the most it drafts in one step, and `suffix` its options (None: the defaults); block
    verification adds rejection_sample_method "block" (token-wise is vLLM's default, "standard")."""
    if verification not in VLLM_REJECTION:
        raise ValueError(f"unknown verification '{verification}'; choose one of {', '.join(VLLM_REJECTION)}")
    spec = _vllm_method_config(method, k, draft_path, lookup, suffix)
    if verification != "token":
        spec["rejection_sample_method"] = VLLM_REJECTION[verification]
    return spec


def _vllm_method_config(method: str, k: int, draft_path: str | None, lookup: Lookup | None,
                        suffix: SuffixConfig | None) -> dict:
    if method not in VLLM_METHODS:
        raise ValueError(f"unknown vLLM speculative method '{method}'; use one of {', '.join(VLLM_METHODS)}")
    if k < 1:
        raise ValueError(f"k (num_speculative_tokens) must be at least 1, got {k}")
    if method == "ngram":
        window = lookup if isinstance(lookup, Lookup) else Lookup.of(lookup)
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": window.max_ngram,
                "prompt_lookup_min": window.min_ngram}
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": k, **(suffix or SuffixConfig()).vllm_options()}
    if not draft_path:
        raise ValueError(f"vLLM's '{method}' needs the draft's folder (for eagle3: the output of "
                         f"`python -m specdemo export`)")
    return {"method": method, "model": str(draft_path), "num_speculative_tokens": k}


def vllm_serve_command(target: str, spec_config: dict | None, extra: list[str] | tuple[str, ...] = ()) -> str:
    """`vllm serve TARGET [--speculative-config '{...}'] [extra...]`, quoted for a POSIX shell."""
    parts = ["vllm", "serve", str(target)]
    if spec_config:
        parts += ["--speculative-config", json.dumps(spec_config, separators=(",", ":"))]
    parts += list(extra)
    return " ".join(shlex.quote(p) for p in parts)


def sglang_flags(method: str, k: int, draft_path: str | None = None, lookup: Lookup | None = None,
                 algorithm: str | None = None, suffix: SuffixConfig | None = None) -> str:
    """SGLang's speculative flags for the same setting (`python -m sglang.launch_server --model-path T ...`).

    SGLang verifies a tree whose root is the last committed token, so k drafted tokens in a chain (top-k 1) is
    `--speculative-num-steps k --speculative-eagle-topk 1 --speculative-num-draft-tokens k+1`. Its NGRAM drafter is a
    different algorithm (a trie of earlier n-grams walked breadth-first); breadth 1 keeps it to one chain.
    `algorithm`: SGLang's name for it (a ServePlan's sglang_method); None: SGLANG_METHODS[method]. Its SUFFIX
    algorithm gets k + 1 draft tokens only: its option names for the tree differ from vLLM's between releases.
    """
    spec = vllm_speculative_config(method, k, draft_path, lookup, suffix=suffix)  # the same validation
    algorithm = algorithm or SGLANG_METHODS[method]
    if method == "ngram":
        flags = ["--speculative-algorithm", algorithm, "--speculative-num-draft-tokens", str(k + 1),
                 "--speculative-ngram-min-match-window-size", str(spec["prompt_lookup_min"]),
                 "--speculative-ngram-max-match-window-size", str(spec["prompt_lookup_max"]),
                 "--speculative-ngram-max-bfs-breadth", "1"]
    elif method == "suffix":
        flags = ["--speculative-algorithm", algorithm, "--speculative-num-draft-tokens", str(k + 1)]
    else:
        flags = ["--speculative-algorithm", algorithm, "--speculative-draft-model-path", spec["model"],
                 "--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
                 "--speculative-num-draft-tokens", str(k + 1)]
    return " ".join(shlex.quote(p) for p in flags)


def sglang_command(target: str, method: str, k: int, draft_path: str | None = None,
                   lookup: Lookup | None = None, algorithm: str | None = None,
                   suffix: SuffixConfig | None = None) -> str:
    """The whole SGLang launch line for the setting."""
    return (f"python -m sglang.launch_server --model-path {shlex.quote(str(target))} "
            + sglang_flags(method, k, draft_path, lookup, algorithm, suffix))


@dataclass(frozen=True)
class ServePlan:
    """A tuned setting as a serving engine sees it: what to load, which speculative method, notes for the user."""

    target: str  # a folder or hub id vLLM can load
    method: str  # vLLM's speculative method (registry: the kind's, or its draft's)
    k: int
    draft_path: str | None = None
    lookup: Lookup | None = None
    notes: tuple[str, ...] = ()
    sglang_method: str | None = None  # SGLang's --speculative-algorithm; None: SGLANG_METHODS[method]
    verification: str = "token"  # the rule for sampled drafts: vLLM's rejection_sample_method
    suffix: SuffixConfig | None = None  # suffix decoding's options (method "suffix")

    @property
    def speculative_config(self) -> dict:
        return vllm_speculative_config(self.method, self.k, self.draft_path, self.lookup, self.verification,
                                       self.suffix)


def serve_target(target: str, runtime: Runtime = Runtime()) -> tuple[str, str | None]:
    """What vLLM loads for one of our target names, and a note when that differs from the name."""
    from ..models.loading import BUNDLED_ALIASES, cache_root

    if target.strip().lower() not in BUNDLED_ALIASES:
        return target, None
    folder = cache_root(runtime) / BUNDLED_ID
    if (folder / "config.json").exists():
        return str(folder), f"{BUNDLED_ID} is served from its converted safetensors folder (made by specdemo)"
    return BUNDLED_HUB_ID, (f"{BUNDLED_ID}'s converted folder does not exist yet (any specdemo run makes it); this "
                            f"serves its hub original {BUNDLED_HUB_ID}")


BLOCK_NOTE = ("vLLM runs rejection_sample_method 'block' in its Model Runner V2 (GPU, Triton); sampled requests only, "
              "greedy ones are unchanged. The SGLang line verifies token-wise: specdemo knows no SGLang flag for block")


COST_AWARE_NOTE = ("vLLM's suffix method has no cost-aware cut (ours, on unless --no-suffix-cost-aware): it "
                   "drafts at the other settings shown")


def suffix_note(suffix: SuffixConfig) -> str | None:
    """Which suffix options differ from vLLM's own defaults (so the config above sets them), and where ours are from."""
    ours, theirs = suffix.vllm_options(), VLLM_SUFFIX.vllm_options()
    differ = [f"{name} {value} (vLLM's default {theirs[name]})" for name, value in ours.items()
              if value != theirs[name]]
    if not differ:
        return None
    measured = drafter_default("suffix")
    ours_by_default = ours == SuffixConfig().vllm_options()
    where = f"; specdemo's defaults, measured best in {measured.evidence}" if (
        measured and ours_by_default) else ""
    return f"set explicitly above, as vLLM's defaults differ: {', '.join(differ)}{where}"


def plan(target: str, drafter: str, draft: str | None, k: int, runtime: Runtime = Runtime(),
         verification: str = "token", drafter_options: Mapping | None = None) -> ServePlan:
    """Map our target, drafter kind (the registry's methods), draft (drafters.resolve.resolve_draft, from the local
    hub cache only), k, the verification rule and the kinds' options (registry.options_from; the kind of vLLM's
    suffix method takes SuffixConfig) to a vLLM method and speculative config (no model is loaded)."""
    served, note = serve_target(target, runtime)
    kind = get(drafter)
    check_draft(drafter, draft)
    suffix = options_of(drafter, drafter_options or {}) if kind.vllm_method == "suffix" else None
    cost_note = COST_AWARE_NOTE if suffix is not None and suffix.cost_aware else None
    notes = tuple(n for n in (note, kind.serve_note, BLOCK_NOTE if verification == "block" else None, cost_note,
                              suffix_note(suffix) if suffix is not None else None) if n)
    if not kind.needs_draft:
        lookup = Lookup.of() if kind.vllm_method == "ngram" else None
        return ServePlan(served, kind.vllm_method, k, lookup=lookup, notes=notes, sglang_method=kind.sglang_method,
                         verification=verification, suffix=suffix)
    from ..drafters.resolve import resolve_draft

    resolved = resolve_draft(draft, target, runtime, fetch=False)
    # a local head is served from its folder, a published one by its hub id; a causal LM by its name as given
    path = str(resolved.path.resolve()) if resolved.is_head and resolved.local else resolved.name
    return ServePlan(served, kind.vllm_method or resolved.vllm_method, k, path, notes=notes,
                     sglang_method=kind.sglang_method or resolved.sglang_method, verification=verification)


def k_from_report(path: str | Path) -> tuple[int, str]:
    """The tuned k in a bench.json or sweep JSON: its measured best k, and where in the file it was found."""
    data = json.loads(Path(path).read_text())
    for where, node in (("theory", data.get("theory")), ("config.calibration", (data.get("config") or {}).get(
            "calibration")), ("top level", data)):
        if isinstance(node, dict) and isinstance(node.get("best_measured_k"), int):
            return node["best_measured_k"], f"{where}.best_measured_k"
    by_k = data.get("by_k") or {}
    if by_k:
        best = max(by_k, key=lambda k: by_k[k].get("speedup", 0.0))
        return int(best), "the k with the best pooled speedup in by_k"
    raise ValueError(f"{path} holds no tuned k (no best_measured_k and no by_k); run `python -m specdemo bench "
                     f"--k 1,2,4,8` or the app's Tune-k tab first")
