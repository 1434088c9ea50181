#!/usr/bin/env bash
# The prepared GPU check (one short script, about 3 minutes on an H200): tiny-model engine tests on CUDA,
# then losslessness and timing in bf16 at SmolLM2-135M's shapes. Run on a lent device from the repo root.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 SPECDEMO_TEST_DEVICE=cuda
OUT=${OUT:-.}
python3 -m pytest -q -p no:cacheprovider tests/test_engine.py tests/test_verify.py 2>&1 | tee "$OUT/gpu_pytest.log" | tail -5
python3 scripts/gpu_check.py "$@" 2>&1 | tee "$OUT/gpu_check.log"
