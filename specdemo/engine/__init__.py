"""The engine: one batched decoder (batch size 1 is the ordinary case, autoregressive decoding is the engine with no
drafter), its KV cache and rollback, the acceptance rules, step events and clocks. Knows drafters only through
drafters.base's seam; knows nothing of the UI.
"""

from .events import (
                     BatchEvent,
                     GenerationError,
                     StepEvent,
                     encode_prompt,
                     eos_ids,
                     generated_ids,
                     row_outputs,
)
from .loop import autoregressive, decode, speculative

__all__ = ["BatchEvent", "GenerationError", "StepEvent", "encode_prompt", "eos_ids", "generated_ids", "row_outputs",
           "autoregressive", "decode", "speculative"]
