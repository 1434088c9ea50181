"""EAGLE-3 draft heads in the checkpoint format vLLM and SGLang load: the config and the files (save, read, find,
recorded k). The module itself, fresh or loaded, is models.eagle3_head; the drafter is drafters.eagle3.Eagle3Drafter.

The format is vLLM 0.32's vllm/model_executor/models/llama_eagle3.py (Eagle3LlamaForCausalLM) checked against
SGLang's python/sglang/srt/models/llama_eagle3.py (LlamaForCausalLMEagle3); docs/eagle3.md lists each name and default.
The config's keys here, the module's parameter names there and the files' layout are one contract with those
engines: a change to one is a change to all three.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..config import Runtime
from . import speculators
from .loading import hub_folder

if TYPE_CHECKING:
    from .eagle3_head import Eagle3Head

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")  # SGLang's name, vLLM's name
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
META_FILE = "specdemo.json"  # our extras (training metrics, k); engines ignore it
SPEC_FILE = "speculative_config.json"  # written by `python -m specdemo export`; its k is the head's recorded k
# config.json flags of variants this module does not implement (each changes the computation when true)
UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output", "attention_bias", "mlp_bias", "bias",
                     "parallel_drafting")


class Eagle3FormatError(ValueError):
    """A checkpoint is not an EAGLE-3 head this module can run, or not one for the given target."""


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """vLLM's SupportsEagle3 default (and SGLang's): (2, L // 2, L - 3)."""
    return (2, num_target_layers // 2, num_target_layers - 3)


@dataclass(frozen=True)
class Eagle3Config:
    """The head's config.json. vocab_size and target_hidden_size are the target's; aux_layer_ids None means the
    engines' default for the target. Ids index HF's output_hidden_states (vLLM: hidden + residual before layer i)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict | None = None
    aux_layer_ids: tuple[int, ...] | None = None
    norm_before_residual: bool = False
    architecture: str = ARCHITECTURES[0]
    extra: dict = field(default_factory=dict, compare=False)  # other config.json keys, written back unchanged

    def __post_init__(self):
        if self.aux_layer_ids is not None:
            object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))

    @property
    def num_aux(self) -> int:
        """How many target hidden states `fc` reads (vLLM: len(ids), else 3)."""
        return len(self.aux_layer_ids) if self.aux_layer_ids else 3

    def resolve_aux(self, num_target_layers: int) -> tuple[int, ...]:
        """The target layers read, sorted as vLLM captures them; refuses ids the target does not have."""
        ids = self.aux_layer_ids or default_aux_layer_ids(num_target_layers)
        resolved = tuple(sorted(set(ids)))
        if len(resolved) != self.num_aux or not all(0 <= i < num_target_layers for i in resolved):
            source = "its eagle_aux_hidden_state_layer_ids" if self.aux_layer_ids else "the default (2, L//2, L-3)"
            raise Eagle3FormatError(
                f"the head reads target hidden states {list(ids)} ({source}), but a target with {num_target_layers} "
                f"layers has {self.num_aux} distinct ones only among 0..{num_target_layers - 1}: it is for another "
                f"target")
        return resolved

    @classmethod
    def for_target(cls, target_config, draft_vocab_size: int, aux_layer_ids: tuple[int, ...] | None = None,
                   norm_before_residual: bool = False) -> Eagle3Config:
        """A head shaped like one decoder layer of the target (HF config), over the given draft vocabulary size."""
        rope = dict(getattr(target_config, "rope_parameters", None) or {})
        theta = float(rope.pop("rope_theta", getattr(target_config, "rope_theta", 10000.0)))
        scaling = rope if rope.get("rope_type", "default") != "default" else None
        num_layers = target_config.num_hidden_layers
        if aux_layer_ids is not None and tuple(sorted(set(aux_layer_ids))) == default_aux_layer_ids(num_layers):
            aux_layer_ids = None  # the engines' default: written as no ids, which vLLM and SGLang read the same
        h = target_config.hidden_size
        c = cls(h, target_config.intermediate_size, target_config.num_attention_heads,
                target_config.num_key_value_heads,
                getattr(target_config, "head_dim", None) or h // target_config.num_attention_heads,
                float(target_config.rms_norm_eps), target_config.vocab_size, draft_vocab_size, h,
                target_config.max_position_embeddings, theta, scaling, aux_layer_ids, norm_before_residual)
        c.resolve_aux(num_layers)
        return c

    @classmethod
    def from_json(cls, d: dict) -> Eagle3Config:
        """Parse a config.json; raises Eagle3FormatError for anything but a one-layer llama EAGLE-3 head."""
        arch = next((a for a in d.get("architectures") or [] if a in ARCHITECTURES), None)
        if arch is None:
            raise Eagle3FormatError(f"not an EAGLE-3 head: architectures {d.get('architectures')} names none of "
                                    f"{', '.join(ARCHITECTURES)}")
        eagle = d.get("eagle_config") or {}
        problems = [f"{k}: true" for k in UNSUPPORTED_FLAGS if d.get(k) or eagle.get(k)]
        if d.get("num_hidden_layers", 1) != 1:
            problems.append(f"num_hidden_layers {d['num_hidden_layers']} (only one-layer heads are supported)")
        if not eagle.get("use_aux_hidden_state", True):
            problems.append("use_aux_hidden_state: false (an EAGLE-1 style head)")
        if d.get("hidden_act", "silu") != "silu":
            problems.append(f"hidden_act {d['hidden_act']}")
        if problems:
            raise Eagle3FormatError("unsupported EAGLE-3 variant: " + "; ".join(problems))
        rope = dict(d.get("rope_parameters") or {})
        theta = float(d.get("rope_theta") or rope.pop("rope_theta", 10000.0))
        rope.pop("rope_theta", None)
        scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        ids = d.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
        h = d["hidden_size"]
        known = set(cls.__dataclass_fields__) | {"architectures", "eagle_config", "rope_parameters",
                                                  "eagle_aux_hidden_state_layer_ids", "num_hidden_layers"}
        return cls(h, d["intermediate_size"], d["num_attention_heads"], d.get("num_key_value_heads") or
                   d["num_attention_heads"], d.get("head_dim") or h // d["num_attention_heads"],
                   float(d.get("rms_norm_eps", 1e-6)), d["vocab_size"], d.get("draft_vocab_size") or d["vocab_size"],
                   d.get("target_hidden_size") or h, d.get("max_position_embeddings", 2048), theta, scaling,
                   tuple(ids) if ids else None, bool(d.get("norm_before_residual", False)), arch,
                   {k: v for k, v in d.items() if k not in known})

    def to_json(self, dtype: torch.dtype = torch.float16) -> dict:
        """The checkpoint's config.json (tie_word_embeddings false: SGLang would tie lm_head to embed_tokens)."""
        eagle = {"use_aux_hidden_state": True}
        if self.aux_layer_ids:
            eagle["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layer_ids)
        return {**self.extra, "architectures": [self.architecture], "model_type": "llama",
                "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
                "head_dim": self.head_dim, "num_hidden_layers": 1, "hidden_act": "silu",
                "rms_norm_eps": self.rms_norm_eps, "vocab_size": self.vocab_size,
                "draft_vocab_size": self.draft_vocab_size, "target_hidden_size": self.target_hidden_size,
                "max_position_embeddings": self.max_position_embeddings, "rope_theta": self.rope_theta,
                "rope_scaling": self.rope_scaling, "tie_word_embeddings": False, "attention_bias": False,
                "mlp_bias": False, "norm_before_residual": self.norm_before_residual, "eagle_config": eagle,
                "torch_dtype": str(dtype).removeprefix("torch.")}


def save_eagle3(head: Eagle3Head, path: str | Path, meta: dict | None = None,
                dtype: torch.dtype = torch.float16) -> None:
    """config.json + model.safetensors that vLLM and SGLang load unchanged (d2t int64, t2d bool as EAGLE's own
    checkpoints ship it; borrowed embeddings are not saved), and `meta` in specdemo.json."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.long() if k == "d2t" else v.detach().to(dtype)).contiguous().cpu()
               for k, v in head.state_dict().items()}
    t2d = torch.zeros(head.c.vocab_size, dtype=torch.bool)
    t2d[head.subset.cpu()] = True
    save_file({**tensors, "t2d": t2d}, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    (path / CONFIG_FILE).write_text(json.dumps(head.c.to_json(dtype), indent=2) + "\n")
    if meta:
        (path / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def read_config(folder: str | Path) -> dict | None:
    """config.json of a folder (a speculators-format head's as the raw EAGLE-3 one), or None when it has none (or it
    is not JSON)."""
    try:
        config = json.loads((Path(folder) / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return None
    return speculators.to_raw(config) if speculators.is_speculators_eagle3(config) else config


def is_eagle3(spec_or_config: str | Path | dict | None) -> bool:
    """Whether a config dict, or a folder's config.json, names an EAGLE-3 architecture (never guessed from a name)."""
    config = spec_or_config if isinstance(spec_or_config, dict) else (
        read_config(spec_or_config) if spec_or_config else None)
    if speculators.is_speculators_eagle3(config):
        return True
    return bool(config) and any(a in ARCHITECTURES for a in config.get("architectures") or [])


def not_a_draft(draft: str, why: str) -> str:
    """What a draft that is neither an EAGLE-3 head nor a causal LM is told (`why`: what the folder lacks)."""
    return (f"'{draft}' is not an EAGLE-3 head (a config.json with architectures {' or '.join(ARCHITECTURES)}) nor a "
            f"causal LM: {why}")


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if files:  # a speculators-format head names its layer layers.0., ours midlayer.
        return speculators.to_raw_tensors({k: v for f in files for k, v in load_file(str(f)).items()})
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if bins:
        return {k: v for f in bins for k, v in torch.load(f, map_location="cpu", weights_only=True).items()}
    raise Eagle3FormatError(f"{folder} has a config.json but no model.safetensors (or pytorch_model.bin)")


def recorded_k(folder: str | Path) -> int | None:
    """The head's own k: num_speculative_tokens in its speculative_config.json (export writes it), else in
    specdemo.json; None if neither (the EAGLE-3 config.json has no such field)."""
    for name in (SPEC_FILE, META_FILE):
        try:
            k = json.loads((Path(folder) / name).read_text()).get("num_speculative_tokens")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(k, int) and k > 0:
            return k
    try:  # a speculators-format head records its k in its config.json
        return speculators.recorded_k(json.loads((Path(folder) / CONFIG_FILE).read_text()))
    except (OSError, ValueError):
        return None


HUB_PATTERNS = ("config.json", "*.safetensors", "pytorch_model*.bin", SPEC_FILE, META_FILE)


def locate_eagle3(spec: str, runtime: Runtime = Runtime()) -> Path | None:
    """The local folder of the EAGLE-3 head `spec` names (a folder, or a hub id whose config.json says so; its
    weights are downloaded once), or None when it is not one (or the hub is unreachable: the caller's usual loading
    then says so)."""
    if Path(spec).is_dir():
        return Path(spec) if is_eagle3(Path(spec)) else None
    return hub_folder(spec, is_eagle3, HUB_PATTERNS, runtime)


def eagle3_export(path: str | Path | None) -> bool:
    """A folder holding an EAGLE-3 checkpoint vLLM can load: `python -m specdemo export` writes speculative_config.json
    beside it; a checkpoint from elsewhere names an Eagle3 architecture in config.json."""
    if not path or not Path(path).is_dir():
        return False
    folder = Path(path)
    for name, key in (("speculative_config.json", "method"), ("config.json", "architectures")):
        try:
            value = json.loads((folder / name).read_text()).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if "eagle3" in json.dumps(value).lower():
            return True
    return False
