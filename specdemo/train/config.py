"""TrainConfig: every setting of a distill run and its default, in one frozen dataclass (the CLI's flags mirror it),
and the shapes every stage shares (Sample, LogFn). No torch; it knows nothing of how the settings are used.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

Sample = dict  # one training sequence: {"ids": prompt + answer ids, "prompt_len": int, "stage": str}, and, where the
#                answering passes recorded its features, "recorded": [file in work/recorded, row, fused layers]
LogFn = Callable[[dict], None]  # receives each progress record (a line of train_log.jsonl)


@dataclass(frozen=True)
class TrainConfig:
    """One distill run. The fields follow the command line's flags one for one, in their order (`--max-new-tokens`
    is `max_new_tokens`), so a run's logged settings read like its command; cli.py holds each flag's help."""

    target: str  # model id or folder
    out: str  # asset folder to write
    work: str | None = None  # cache folder for generated data (None: OUT/cache)
    device: str = "auto"
    seed: int = 0
    # Stage 1: the target's answers
    scale: float = 1.6  # multiplies the number of templated answers
    max_new_tokens: int = 128
    gen_batch_size: int = 128
    max_sequences: int = 0  # 0: all
    data_minutes: float = 0  # 0: no time budget for answering
    gen_dtype: str = "bf16"  # the copy of the target that writes instructions and answers
    self_instruct: int = 0
    steered_instruct: int = 0
    features: str = "writer"  # "writer" (recorded while answering) or "target" (a pass of the fp32 target)
    instructions: str = "written,written2"  # comma-separated files or names (instructions.NAMED); "": none
    # Stage 3: the head (an EAGLE-3 head, specdemo.models.eagle3) and its training
    subset_size: int = 8192
    steps: int = 4000
    train_minutes: float = 0  # 0: no time budget for training
    total_minutes: float = 0  # 0: no time budget for the whole run
    batch_size: int = 8
    max_len: int = 320
    fuse_layers: str = ""  # comma-separated target layers the head reads (EAGLE-3 aux; "": vLLM's default); see
    # `layers`
    train_dtype: str = "fp32"  # or "bf16" (autocast)
    depth: int = 2  # draft steps unrolled in training
    decay: float = 0.8
    lr: float = 2e-3
    init_layer: int | None = None
    weight_decay: float = 0.0
    train_fraction: float = 1.0
    noise: float = 0.05
    feat_weight: float = 0.5
    soft_weight: float = 0.0
    skip: int = 0  # leading positions without loss; 0: the samples' shared prefix (the CLI fills it in)
    min_confidence: float = 0.0  # written into the asset's config
    log_every: int = 20
    eval_every: int = 500
    data_only: bool = False

    @property
    def layers(self) -> tuple[int, ...]:
        """fuse_layers as a tuple of layer indices."""
        return tuple(int(x) for x in self.fuse_layers.split(",") if x.strip())
