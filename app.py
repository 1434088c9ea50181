"""Launch the speculative decoding demo: `python app.py`. Environment variables are read here and nowhere else.

SPECDEMO_MAX_NEW_TOKENS     cap on max new tokens (default 256)
SPECDEMO_MAX_PROMPT_TOKENS  cap on prompt tokens, chat template included (default: the target's context,
                            max_position_embeddings, minus max new tokens, and at most 4096). Checked before any model
                            work: first by characters (16 per allowed token), then with the target's tokenizer alone
SPECDEMO_MODEL_ALLOWLIST    comma-separated model ids users may load (the bundled model and its trained draft are
                            always allowed). Default: any id, except on a Hugging Face Space (SPACE_ID set), where
                            only the presets' ids may load
SPECDEMO_ALLOW_LOCAL_PATHS  1: model ids may be folders on this machine (default 0: refused)
SPECDEMO_DEVICE             cpu, cuda, ... (default: CUDA when present)
SPECDEMO_DEVICE_MAP         auto, balanced or sequential: load every target through accelerate's device map (default:
                            none; the presets that need one, such as the 32B pair, use "auto" anyway)
SPECDEMO_MAX_MEMORY         the device map's limits, e.g. 0=20GiB,cpu=60GiB (default: what the devices have free);
                            checked against each pair's size before it loads
SPECDEMO_OFFLOAD_FOLDER     where the device map may put weights that fit in no memory (default: none, so such a
                            pair is refused before loading)
SPECDEMO_DRAFT_DEVICE       the draft's device, e.g. cpu beside a GPU target (default: the target's)
SPECDEMO_WORKER             1 (default): the timed work runs in a process of its own, so the server's threads never
                            hold the interpreter lock while a decoder is timed; 0: in the server's process (ZeroGPU
                            always runs it there, under spaces.GPU)
SPECDEMO_THREADS            torch threads for the timed work (default: torch's own choice, as in the CLI)
SPECDEMO_CONCURRENCY        concurrent handlers (default 4; timed runs still take turns on the hardware)
SPECDEMO_QUEUE_SIZE         requests waiting in the queue (default 32)
SPACE_ID                    set by Hugging Face Spaces; makes the presets the default allowlist
SPECDEMO_CACHE, SPECDEMO_FAST_LINEAR, SPECDEMO_CUDNN_SDPA, HF_HUB_OFFLINE, HF_ENDPOINT: the loading Runtime, read by
                            config.runtime_from_env(os.environ) here and passed to the handlers, which give it to
                            load_pair
GRADIO_SERVER_NAME / GRADIO_SERVER_PORT are read by Gradio itself. trust_remote_code is never enabled.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

from specdemo.app.race import AppLimits, preset_ids
from specdemo.app.ui import build_demo, launch_options
from specdemo.app.worker import Worker
from specdemo.config import placement_from, runtime_from_env


def _int(env, name: str, default: int | None) -> int | None:
    value = env.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"{name} must be a whole number, got {value!r}") from None


def limits_from_env(env=os.environ) -> AppLimits:
    """The public-deployment guards."""
    allow = tuple(s.strip() for s in env.get("SPECDEMO_MODEL_ALLOWLIST", "").split(",") if s.strip())
    if not allow and env.get("SPACE_ID"):
        allow = preset_ids()
    memory = env.get("SPECDEMO_MAX_MEMORY") or env.get("SPECDEMO_OFFLOAD_FOLDER")
    try:  # memory limits alone keep "no map" for other targets, and give the presets that need a map their limits
        placement = placement_from(env.get("SPECDEMO_DEVICE_MAP") or ("auto" if memory else None),
                                   env.get("SPECDEMO_MAX_MEMORY"), env.get("SPECDEMO_OFFLOAD_FOLDER"))
    except ValueError as exc:
        raise SystemExit(f"SPECDEMO_DEVICE_MAP / SPECDEMO_MAX_MEMORY / SPECDEMO_OFFLOAD_FOLDER: {exc}") from None
    if not env.get("SPECDEMO_DEVICE_MAP") and placement.active:
        placement = replace(placement, device_map=None)
    return AppLimits(max_new_tokens=_int(env, "SPECDEMO_MAX_NEW_TOKENS", 256), allowlist=allow,
                     device=env.get("SPECDEMO_DEVICE") or None,
                     max_prompt_tokens=_int(env, "SPECDEMO_MAX_PROMPT_TOKENS", None),
                     allow_local_paths=env.get("SPECDEMO_ALLOW_LOCAL_PATHS", "").strip() == "1",
                     placement=placement, draft_device=env.get("SPECDEMO_DRAFT_DEVICE") or None)


def zero_gpu():
    """spaces.GPU on Hugging Face ZeroGPU hardware, else None (the `spaces` package is optional)."""
    try:
        import spaces
    except ImportError:
        return None
    return spaces.GPU(duration=120)


def compute_wrapper(env=os.environ):
    """What runs the compute steps: spaces.GPU on ZeroGPU, else a Worker process (unless SPECDEMO_WORKER=0), else
    None (the handler's own thread)."""
    gpu = zero_gpu()
    if gpu is not None or env.get("SPECDEMO_WORKER", "1").strip() == "0":
        return gpu
    worker = Worker(threads=_int(env, "SPECDEMO_THREADS", None))
    worker.start()
    return worker.wrap


def make_app(env=os.environ, compute=None):
    """The queued Blocks, ready to launch; `compute` wraps the compute steps (compute_wrapper's, for a server)."""
    demo = build_demo(limits_from_env(env), runtime_from_env(env), gpu=compute)
    return demo.queue(default_concurrency_limit=_int(env, "SPECDEMO_CONCURRENCY", 4),
                      max_size=_int(env, "SPECDEMO_QUEUE_SIZE", 32))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    make_app(compute=compute_wrapper()).launch(**launch_options())
