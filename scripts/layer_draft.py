"""Write an early-exit draft: the target's first N decoder layers plus its own final norm and output head.

This is the cheapest draft *model* that shares the target's tokenizer offline (LayerSkip-style self-drafting without
the early-exit training), and it is a plain transformers checkpoint, so transformers' assisted generation can use
the very same pair. The benchmark uses it to compare our speculative loop with `generate(assistant_model=...)`.

    python scripts/layer_draft.py --layers 4 --out out/smollm2-135m-l4
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdemo.models.loading import load_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    loaded = load_model(args.target, device="cpu", dtype="fp32")
    model = loaded.model
    n = model.config.num_hidden_layers
    if not 1 <= args.layers < n:
        p.error(f"--layers must be between 1 and {n - 1}")
    model.model.layers = model.model.layers[: args.layers]
    model.config.num_hidden_layers = args.layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[: args.layers]
    out = Path(args.out)
    model.save_pretrained(out)
    loaded.tokenizer.save_pretrained(out)  # save_pretrained above wrote the config and generation_config
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"wrote {out}: {args.layers} of {n} layers, {millions:.1f}M parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
