"""EAGLE-3 heads in the speculators format (`speculators` 0.9.0's Eagle3SpeculatorConfig, as vLLM 0.32.0 reads it in
transformers_utils/configs/speculators/): a config.json whose `speculators_config` names the verifier (the target) and
the proposal (k), so `vllm serve HEAD` starts both. Plain dicts both ways; the `speculators` package is not imported
(its wheel pulls datasets, openai, torchvision and torchaudio for what is a JSON layout here).
"""

from __future__ import annotations

from pathlib import Path

import torch

FORMAT_VERSION = "0.9.0"  # the speculators release whose schema this writes
ARCHITECTURE = "Eagle3Speculator"
# the raw EAGLE-3 config.json keys that live at the top level of a speculators config, not in transformer_layer_config
_HEAD_KEYS = ("draft_vocab_size", "target_hidden_size", "norm_before_residual", "eagle_aux_hidden_state_layer_ids")
_VARIANT_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")  # speculators' EAGLE-3 variants; ours are all false
RAW_LAYER, SPECULATORS_LAYER = "midlayer.", "layers.0."  # the decoder layer's weight prefix in each format


def is_speculators_eagle3(config: dict | None) -> bool:
    """Whether a config.json dict is a speculators-format EAGLE-3 head (its model type and its speculators_config)."""
    return bool(config) and config.get("speculators_model_type") == "eagle3" and "speculators_config" in config


def to_raw(config: dict) -> dict:
    """The speculators config as the raw EAGLE-3 config.json eagle3.Eagle3Config reads. Defaults as vLLM applies
    them (algos.update_eagle3): norm_before_residual true when absent."""
    raw = {**config.get("transformer_layer_config", {}), "architectures": ["Eagle3LlamaForCausalLM"]}
    raw.update({k: config[k] for k in (*_HEAD_KEYS, *_VARIANT_FLAGS) if config.get(k) is not None})
    raw.setdefault("norm_before_residual", True)
    raw["num_hidden_layers"] = raw.get("num_hidden_layers", 1)
    return raw


def from_raw(raw: dict, k: int, verifier: str, verifier_architectures: list[str]) -> dict:
    """A raw EAGLE-3 config.json (eagle3.Eagle3Config.to_json) as a speculators config: greedy proposals of k tokens
    verified by `verifier` (a hub id or folder, what vLLM then loads as the target)."""
    eagle = raw.get("eagle_config") or {}
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
    layer = {k_: v for k_, v in raw.items() if k_ not in (*_HEAD_KEYS, "architectures", "eagle_config")}
    out = {"architectures": [ARCHITECTURE], "speculators_model_type": "eagle3", "speculators_version": FORMAT_VERSION,
           "draft_vocab_size": raw["draft_vocab_size"], "target_hidden_size": raw.get("target_hidden_size"),
           "norm_before_residual": bool(raw.get("norm_before_residual", False)),
           **{flag: False for flag in _VARIANT_FLAGS}, "transformer_layer_config": layer,
           "speculators_config": {
               "algorithm": "eagle3", "default_proposal_method": "greedy",
               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k, "verifier_accept_k": 1,
                                     "accept_tolerance": 0.0}],
               "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)}},
           "torch_dtype": raw.get("torch_dtype")}
    if ids:
        out["eagle_aux_hidden_state_layer_ids"] = list(ids)
    return out


def recorded_k(config: dict | None) -> int | None:
    """speculative_tokens of the first proposal method (what vLLM serves as num_speculative_tokens), or None."""
    if not is_speculators_eagle3(config):
        return None
    methods = config["speculators_config"].get("proposal_methods") or [{}]
    k = methods[0].get("speculative_tokens")
    return k if isinstance(k, int) and k > 0 else None


def to_raw_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A speculators checkpoint's tensors under the raw EAGLE-3 names (layers.0. -> midlayer.), without the
    verifier's copies some training checkpoints carry (verifier_norm, verifier_lm_head)."""
    return {(RAW_LAYER + k[len(SPECULATORS_LAYER):] if k.startswith(SPECULATORS_LAYER) else k): v
            for k, v in tensors.items() if not k.startswith("verifier_")}


def to_speculators_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Raw EAGLE-3 tensors under speculators' names (midlayer. -> layers.0.; vLLM maps either)."""
    return {(SPECULATORS_LAYER + k[len(RAW_LAYER):] if k.startswith(RAW_LAYER) else k): v for k, v in tensors.items()}


def verifier_architectures(verifier: str) -> list[str]:
    """The verifier's own architectures from its config.json (a folder, or the local hub cache); [] if unknown."""
    import json

    from ..models.loading import cached_hub_config

    try:
        config = json.loads((Path(verifier) / "config.json").read_text()) if Path(verifier).is_dir() else (
            cached_hub_config(verifier))
    except (OSError, ValueError):
        config = None
    return list((config or {}).get("architectures") or [])
