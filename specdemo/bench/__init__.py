"""`python -m specdemo bench`: our autoregressive and speculative decoders on a prompt set, against transformers.

For each prompt: autoregressive, then speculative at each k (greedy unless told otherwise), one after the other;
with --anchors also transformers' generate (plain, assisted, prompt lookup) at the same k on the same input ids, and
with --anchors vllm (or hf,vllm) vLLM's plain, ngram and eagle3 decoding in its own venv and process, after ours.
Writes bench.json, bench.md and bench.html. Forward passes are timed by hooks, so the per-step cost outside the
model (drafting logic, acceptance, rollback, detokenization) is reported too.
"""

from .cli import main

__all__ = ["main"]
