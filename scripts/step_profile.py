"""Where a decode step's time goes: one steady decode of the bundled pair under torch.profiler, autoregressive and
speculative, per step: the wall time, the kernels launched eagerly (outside captured graphs), the graph replays, the
copies and synchronisations with the host, and the GPU's busy time; on a CPU, the wall time and the aten calls per
step (nested calls counted too). What a GPU session needs to see whether the engine's per-step glue, not the
passes, holds a step back (docs/gpu.md, "Not yet graphed").

    python scripts/step_profile.py --device cuda --graphs on [--drafter model] [--k 2] [--temperature 0]
        [--tree off] [--max-new-tokens 64] [--out FILE]

Prints (and writes) JSON: for "ar" and "sd", the steps, tokens, wall ms a step, and each counter a step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from specdemo.cliargs import add_runtime_args, runtime_args  # noqa: E402
from specdemo.config import GenerationConfig, SamplingConfig  # noqa: E402
from specdemo.engine import decode, encode_prompt, graphs  # noqa: E402
from specdemo.measure.compare import load_pair  # noqa: E402

PROMPT = "Write a short story about a robot who learns to paint."
# CUDA runtime and driver calls by what they do (the profiler's CPU-side names)
CALLS = {"eager_kernels": ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx"),
         "graph_replays": ("cudaGraphLaunch", "cuGraphLaunch"),
         "copies": ("cudaMemcpyAsync", "cudaMemcpy", "cuMemcpyAsync"),
         "host_syncs": ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
                        "cuStreamSynchronize")}


def profiled(model, tokenizer, ids: list[int], config: GenerationConfig, drafter, cuda: bool) -> dict:
    """One warm decode, then one under the profiler: per step figures (a step: the prefill or an engine step)."""
    list(decode(model, tokenizer, [ids], config, drafter))  # captures and first-use costs stay out
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        events = list(decode(model, tokenizer, [ids], config, drafter))
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    steps = len(events)
    tokens = sum(len(t) for e in events for t in e.tokens)
    averages = prof.key_averages()
    counts = {e.key: e.count for e in averages}
    out = {"steps": steps, "tokens": tokens, "tokens_per_step": round(tokens / steps, 3),
           "wall_ms_per_step": round(wall / steps * 1e3, 3), "tokens_per_s": round(tokens / wall, 1)}
    if cuda:
        for what, names in CALLS.items():
            out[f"{what}_per_step"] = round(sum(counts.get(n, 0) for n in names) / steps, 1)
        busy = sum(getattr(e, "self_device_time_total", 0.0) for e in averages
                   if e.device_type == torch.autograd.DeviceType.CUDA)
        out["gpu_busy_ms_per_step"] = round(busy / 1e3 / steps, 3)  # microseconds in the profiler
        out["gpu_busy_share"] = round(busy / 1e6 / wall, 3)
    out["aten_calls_per_step"] = round(sum(n for k, n in counts.items() if k.startswith("aten::")) / steps, 1)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    add_runtime_args(ap)  # --graphs, every mode config.GRAPH_MODES has
    ap.add_argument("--drafter", default="model")
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--tree", default="off")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    runtime = runtime_args(args, os.environ)
    pair = load_pair("smollm2-135m", args.drafter, None, args.device, runtime=runtime)
    target, tokenizer = pair.target.model, pair.target.tokenizer
    cuda = pair.target.device.type == "cuda"
    ids = encode_prompt(tokenizer, PROMPT)
    base = GenerationConfig(max_new_tokens=args.max_new_tokens, num_draft_tokens=args.k, tree=args.tree,
                            sampling=SamplingConfig(temperature=args.temperature))
    report = {"device": str(pair.target.device), "graphs": runtime.graphs, "drafter": args.drafter, "k": args.k,
              "temperature": args.temperature, "tree": args.tree, "runner": graphs.describe(target),
              "ar": profiled(target, tokenizer, ids, base, None, cuda),
              "sd": profiled(target, tokenizer, ids, base, pair.drafter, cuda)}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
