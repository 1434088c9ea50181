"""Every host value a decode step sends to the device goes through models.placement.to_device or staged, which stage
it in pinned memory on CUDA: a copy from pageable memory may make the host wait for the work already queued on the
stream (CUDA's API synchronization behaviour), and a step's graphs run at the chip's pace only while the host runs
ahead of them. Counted on the CPU as the tensors made from Python data (aten.lift_fresh: torch.tensor, list
indexing) anywhere else, in decodes down the paths a captured target takes (engine.loop.ONE_READ and
eagle3_device_tree.DEVICE_TREES "always", the static runner uncaptured): every registered drafter's greedy chains,
sampled chains, the head's greedy trees, and plain decoding. On CUDA (scripts/gpu_check.sh) a CUDA-only test checks
that to_device does not wait behind queued work."""

import time
import traceback

import pytest
import torch
from conftest import TEST_DEVICE, case, drafter_cases
from test_draft_graphs import PROMPTS
from torch.utils._python_dispatch import TorchDispatchMode

from specdemo.config import GenerationConfig, SamplingConfig
from specdemo.drafters import ModelDrafter, eagle3_device_tree
from specdemo.drafters.eagle3 import Eagle3Drafter
from specdemo.drafters.eagle3_static import HeadRunner
from specdemo.engine import decode, graphs, loop
from specdemo.models.placement import to_device


class HostTensors(TorchDispatchMode):
    """The specdemo functions that made a tensor from Python data outside placement's helpers, with counts."""

    def __init__(self):
        super().__init__()
        self.where: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.lift_fresh.default and args[0].dim() > 0:  # a Python scalar is a fill, not a copy
            frames = [f for f in traceback.extract_stack() if "/specdemo/" in f.filename]
            if frames and not any(f.filename.endswith("models/placement.py") for f in frames):
                at = f"{frames[-1].filename.split('specdemo/')[-1]}:{frames[-1].lineno} {frames[-1].name}"
                self.where[at] = self.where.get(at, 0) + 1
        return func(*args, **(kwargs or {}))


def steps_made_host_tensors(tiny, tiny_tok, kind: str | None, config: GenerationConfig, monkeypatch) -> dict:
    """Where the decode's steps (prefill and warm-up aside) made tensors from host data outside placement's helpers."""
    monkeypatch.setattr(loop, "ONE_READ", "always")
    monkeypatch.setattr(eagle3_device_tree, "DEVICE_TREES", "always")
    target, drafter = case(kind).build(tiny) if kind else (tiny.target, None)
    if drafter is not None:
        drafter.pass_costs = {n: 1.0 + 0.02 * n for n in range(1, 17)}
    inner = getattr(drafter, "model", None) if kind and kind.startswith("hybrid") else drafter  # a hybrid's draft
    runners = {target: graphs.Runner}
    if isinstance(inner, Eagle3Drafter):
        runners[inner.head] = HeadRunner
    elif isinstance(inner, ModelDrafter):
        runners[inner.model] = graphs.Runner
    for m, kind_of in runners.items():
        graphs.attach(m, "on", kind_of)
    seen = HostTensors()
    for name in ("_spec_step", "_ar_step"):
        step = getattr(loop, name)

        def watched(*args, _step=step):
            with seen:
                return _step(*args)

        monkeypatch.setattr(loop, name, watched)
    try:
        with torch.inference_mode():
            steps = list(decode(target, tiny_tok, PROMPTS[:3], config, drafter))
    finally:
        for m in runners:
            graphs.detach(m)
    assert len(steps) > 4
    return seen.where


@pytest.mark.parametrize("kind", [None] + [c.id for c in drafter_cases()])
def test_greedy_steps_send_host_values_through_pinned_staging(tiny, tiny_tok, kind, monkeypatch, load_time_costs):
    """Plain decoding and every drafter's greedy chains at k = 3."""
    config = GenerationConfig(max_new_tokens=20, num_draft_tokens=3, tree="off")
    assert steps_made_host_tensors(tiny, tiny_tok, kind, config, monkeypatch) == {}


@pytest.mark.parametrize("kind", ["eagle3", "model", "ngram"])
def test_sampled_steps_send_host_values_through_pinned_staging(tiny, tiny_tok, kind, monkeypatch, load_time_costs):
    """Sampled chains (the head's and a draft LM's drawn on the device, prompt lookup's on the host)."""
    config = GenerationConfig(max_new_tokens=20, num_draft_tokens=3, tree="off",
                              sampling=SamplingConfig(temperature=0.8))
    assert steps_made_host_tensors(tiny, tiny_tok, kind, config, monkeypatch) == {}


@pytest.mark.parametrize("tree", ["8", "auto"])
def test_tree_steps_send_host_values_through_pinned_staging(tiny, tiny_tok, tree, monkeypatch, load_time_costs):
    """The head's greedy trees, grown on the device and verified there."""
    config = GenerationConfig(max_new_tokens=20, num_draft_tokens=3, tree=tree)
    assert steps_made_host_tensors(tiny, tiny_tok, "eagle3", config, monkeypatch) == {}


@pytest.mark.skipif(TEST_DEVICE.type != "cuda", reason="pinned staging is CUDA's")
def test_to_device_does_not_wait_for_queued_work():
    """With half a second of work queued on the stream, to_device returns at once and its values arrive after that
    work, in order."""
    device = TEST_DEVICE
    torch.cuda.synchronize(device)
    torch.cuda._sleep(1 << 30)  # on the order of a second of GPU clock cycles
    start = time.perf_counter()
    moved = to_device([3, 1, 2], device)
    returned = time.perf_counter() - start
    assert moved.tolist() == [3, 1, 2]
    assert returned < 0.05, f"to_device waited {returned:.3f}s for queued work"
