"""The bench with the trained head's tree shape changed: TOP candidates per expanded node and FRONTIER nodes expanded
per depth (drafters/eagle3_tree.py), the rest of the arguments as `python -m specdemo bench` takes them. What it
answers: how many tokens per pass a wider tree shape would draft (greedy, so the count is the machine's and the
sitting's own only in its timings).

    python scripts/head_tree_shape.py 8 8 --drafter model --k 6 --tree 16,32,64 --limit 10 --max-new-tokens 64 \
        --out bench/trees/head-k6-wide/top8       # about 6 minutes on 2 cores
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file from a clone

import specdemo.drafters.eagle3_tree as eagle3_tree  # noqa: E402
from specdemo.measure.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    eagle3_tree.TOP, eagle3_tree.FRONTIER = int(sys.argv[1]), int(sys.argv[2])
    sys.exit(main(sys.argv[3:]))
