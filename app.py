"""Launch the speculative decoding demo: `python app.py`. Environment variables are read here and nowhere else.

SPECDEMO_MAX_NEW_TOKENS  cap on max new tokens (default 256)
SPECDEMO_MODEL_ALLOWLIST comma-separated model ids users may load (default: any; the bundled model is always allowed)
SPECDEMO_DEVICE          cpu, cuda, ... (default: CUDA when present)
SPECDEMO_CONCURRENCY     concurrent handlers (default 4; timed runs still take turns on the hardware)
SPECDEMO_QUEUE_SIZE      requests waiting in the queue (default 32)
SPECDEMO_CACHE, SPECDEMO_FAST_LINEAR, SPECDEMO_CUDNN_SDPA, HF_HUB_OFFLINE, HF_ENDPOINT: the loading Runtime, read by
                         config.runtime_from_env(os.environ) here and passed to the handlers, which give it to load_pair
GRADIO_SERVER_NAME / GRADIO_SERVER_PORT are read by Gradio itself. trust_remote_code is never enabled.
"""

from __future__ import annotations

import logging
import os

from specdemo.config import runtime_from_env
from specdemo.handlers import AppLimits
from specdemo.ui import build_demo, launch_options


def limits_from_env(env=os.environ) -> AppLimits:
    """The public-deployment guards."""
    allow = tuple(s.strip() for s in env.get("SPECDEMO_MODEL_ALLOWLIST", "").split(",") if s.strip())
    return AppLimits(max_new_tokens=int(env.get("SPECDEMO_MAX_NEW_TOKENS", "256")), allowlist=allow,
                     device=env.get("SPECDEMO_DEVICE") or None)


def zero_gpu():
    """spaces.GPU on Hugging Face ZeroGPU hardware, else None (the `spaces` package is optional)."""
    try:
        import spaces
    except ImportError:
        return None
    return spaces.GPU(duration=120)


def make_app(env=os.environ):
    """The queued Blocks, ready to launch."""
    demo = build_demo(limits_from_env(env), runtime_from_env(env), gpu=zero_gpu())
    return demo.queue(default_concurrency_limit=int(env.get("SPECDEMO_CONCURRENCY", "4")),
                      max_size=int(env.get("SPECDEMO_QUEUE_SIZE", "32")))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    make_app().launch(**launch_options())
