"""argparse flags that `generate`, `bench` and `serve-config` share: where the target's parts go (accelerate's device
map, memory limits, offload folder), the draft's device, and suffix decoding's options. Parsed into config.Placement
and config.SuffixConfig once, here."""

from __future__ import annotations

import argparse

from collections.abc import Mapping
from dataclasses import replace

from .config import (
    DEVICE_MAPS,
    GRAPH_MODES,
    VLLM_SUFFIX,
    Placement,
    Runtime,
    SuffixConfig,
    placement_from,
    runtime_from_env,
)


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
                        "elsewhere; 'on' runs the static cache on a CPU too (uncaptured); 'off' always eager")


def runtime_args(args: argparse.Namespace, env: Mapping[str, str]) -> Runtime:
    """The environment's Runtime (config.runtime_from_env) with --graphs where given."""
    runtime = runtime_from_env(env)
    return replace(runtime, graphs=args.graphs) if args.graphs else runtime


def placement_args(args: argparse.Namespace) -> Placement:
    """The flags as a checked Placement (ValueError says what is wrong)."""
    return placement_from(args.device_map, args.max_memory, args.offload_folder)


def add_suffix_args(p: argparse.ArgumentParser) -> None:
    """--suffix-max-tree-depth, --suffix-max-cached-requests, --suffix-max-spec-factor, --suffix-min-token-prob:
    vLLM's suffix_decoding_* options, with our measured defaults (config.SuffixConfig); and --suffix-cost-aware, ours."""
    d = SuffixConfig()
    p.add_argument("--suffix-max-tree-depth", type=int, default=d.max_tree_depth,
                   help="--drafter suffix: the longest match plus draft the trees hold (vLLM's "
                        "suffix_decoding_max_tree_depth; default %(default)s)")
    p.add_argument("--suffix-max-cached-requests", type=int, default=d.max_cached_requests,
                   help="--drafter suffix: earlier answers kept for drafting, oldest evicted first; 0: none "
                        "(suffix_decoding_max_cached_requests; default %(default)s)")
    p.add_argument("--suffix-max-spec-factor", type=float, default=d.max_spec_factor,
                   help="--drafter suffix: a match of L tokens drafts at most this x L tokens "
                        f"(suffix_decoding_max_spec_factor; default %(default)s, vLLM's {VLLM_SUFFIX.max_spec_factor})")
    p.add_argument("--suffix-min-token-prob", type=float, default=d.min_token_prob,
                   help="--drafter suffix: the least estimated probability of a drafted token "
                        "(suffix_decoding_min_token_prob; default %(default)s)")
    p.add_argument("--suffix-cost-aware", action="store_true",
                   help="--drafter suffix: cut each draft where its expected accepted tokens stop paying for a wider "
                        "verify pass (pass costs timed at load, acceptance learned as it runs; ours, not vLLM's)")


def suffix_args(args: argparse.Namespace) -> SuffixConfig:
    """The flags as a checked SuffixConfig (ValueError with vLLM's option names)."""
    config = SuffixConfig(args.suffix_max_tree_depth, args.suffix_max_cached_requests, args.suffix_max_spec_factor,
                          args.suffix_min_token_prob, args.suffix_cost_aware)
    config.validate()
    return config
