#!/usr/bin/env bash
# Installs pdecode into the current Python, once; safe to run again.
#   bash scripts/setup.sh            the library with its test and bench extras (the test and bench commands)
#   bash scripts/setup.sh runtime    the library alone (jax, flax, optax, orbax, numpy, chex, safetensors, tokenizers)
# The extras pin CPU torch 2.13.0 first (a CPU build lies on this machine's disk; an unpinned torch would pull a
# multi-GB CUDA build); torch and transformers serve parity tests and benchmark peer rows only.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "${1:-}" = "runtime" ]; then
  stamp=.setup-runtime.stamp
  if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && $PY -c "import pdecode, jax, flax, tokenizers" 2>/dev/null; then
    exit 0
  fi
  echo "setup: installing pdecode (runtime only, first run only) ..." >&2
  $PY -m pip install -q --disable-pip-version-check -e .
  touch "$stamp"
  exit 0
fi
stamp=.setup.stamp
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && $PY -c "import pdecode, torch, transformers, pytest, xdist" 2>/dev/null; then
  exit 0
fi
echo "setup: installing pdecode with test and bench extras (first run only) ..." >&2
$PY -m pip install -q --disable-pip-version-check "torch==2.13.0"
$PY -m pip install -q --disable-pip-version-check -e ".[test,bench]"
touch "$stamp"
