"""Llama-style RMSNorms as torch's rms_norm: on CUDA one fused kernel (aten._fused_rms_norm) where transformers' eager
norm launches five, so a norm is two kernels with its weight's product (four in bf16, with the casts) instead of
six (eight): 8 fewer a layer of about 40. A captured pass replays every kernel, so fewer of them is what a graph's
replay costs less by. On the CPU rms_norm decomposes into transformers' own ops, bit for bit
(tests/test_kernels_norm.py), so it is installed on CUDA only (models.loading).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

# norms whose forward is LlamaRMSNorm's: weight * (x / rms(x)).to(input dtype), x in float32, eps `variance_epsilon`
LLAMA_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})


def _forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    normed = F.rms_norm(hidden_states.float(), self.weight.shape, eps=self.variance_epsilon)
    return self.weight * normed.to(hidden_states.dtype)


def fuse_norms(model: torch.nn.Module) -> int:
    """Every Llama-style RMSNorm of `model` (LLAMA_NORMS) computed by torch's rms_norm; returns how many. A norm under
    one of accelerate's hooks (a device map: its weight may stream in at each pass) keeps the hook, which calls the
    new forward."""
    count = 0
    for module in model.modules():
        if type(module).__name__ in LLAMA_NORMS and hasattr(module, "variance_epsilon") and module.weight is not None:
            fused = types.MethodType(_forward, module)
            if getattr(module, "_hf_hook", None) is not None and hasattr(module, "_old_forward"):
                module._old_forward = fused  # what accelerate's forward calls between its hook's two halves
            else:
                module.forward = fused
            count += 1
    return count
