"""argparse flags that `generate` and `bench` share: where the target's parts go (accelerate's device map, memory
limits, offload folder), the draft's device and how passes run (--graphs), parsed into config.Placement and
config.Runtime once, here. Each drafter kind's own flags come from the registry (drafters.registry.add_flags)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import replace

from .config import DEVICE_MAPS, GRAPH_MODES, Placement, Runtime, placement_from, runtime_from_env, tree_defaults_help

TREE_HELP = ("draft trees, verified in one target pass: 'auto' adds the branches that pay for the wider pass, by the "
             "target's pass costs timed at load (a chain where none does); 'off': chains; N: up to N nodes per step "
             "(prompt lookup, suffix decoding, the hybrid and an EAGLE-3 head draft trees; block verification and "
             "drafters without trees verify chains). Default: each drafter's best measured setting on the bundled "
             "pair: " + tree_defaults_help())


def add_placement_args(p: argparse.ArgumentParser) -> None:
    """--device-map, --max-memory, --offload-folder and --draft-device."""
    p.add_argument("--device-map", choices=DEVICE_MAPS, default=None,
                   help="load the target through accelerate's device map (transformers' from_pretrained device_map): "
                        "'auto' and 'balanced' spread it over the GPUs, then CPU memory, then disk; 'sequential' "
                        "fills one device after the other")
    p.add_argument("--max-memory", default=None, metavar="0=20GiB,cpu=60GiB",
                   help="with --device-map: the most memory per device (GPU index, cpu, disk), accelerate's max_memory")
    p.add_argument("--offload-folder", default=None, metavar="DIR",
                   help="with --device-map: where weights that fit nowhere else go (read back at every pass)")
    p.add_argument("--draft-device", default=None,
                   help="the draft model's device, e.g. cpu beside a cuda target, or cuda:1 (default: the target's "
                        "device; an EAGLE-3 head, the shipped draft among them, computes where the target's "
                        "embeddings are)")


def add_runtime_args(p: argparse.ArgumentParser) -> None:
    """--graphs."""
    p.add_argument("--graphs", choices=GRAPH_MODES, default=None,
                   help="how the target's and a draft model's passes run: 'auto' (the default, or SPECDEMO_GRAPHS) "
                        "captures them as CUDA graphs over a static KV cache on a GPU and runs the eager engine "
                        "elsewhere; 'on' runs the static cache on a CPU too (uncaptured); 'off' always eager; "
                        "'compiled' as 'on', each pass compiled by torch.compile (fused kernels) before capture")


def runtime_args(args: argparse.Namespace, env: Mapping[str, str]) -> Runtime:
    """The environment's Runtime (config.runtime_from_env) with --graphs where given."""
    runtime = runtime_from_env(env)
    return replace(runtime, graphs=args.graphs) if args.graphs else runtime


def placement_args(args: argparse.Namespace) -> Placement:
    """The flags as a checked Placement (ValueError says what is wrong)."""
    return placement_from(args.device_map, args.max_memory, args.offload_folder)
