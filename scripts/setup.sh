#!/usr/bin/env bash
# Installs pdecode and its test/bench extras into the current Python, once. Safe to run again.
# CPU torch 2.13.0 first (a CPU build lies on this machine's disk; an unpinned torch would pull a CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.setup.stamp
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && $PY -c "import pdecode, torch, transformers, pytest, xdist" 2>/dev/null; then
  exit 0
fi
echo "setup: installing pdecode with test and bench extras (first run only) ..." >&2
$PY -m pip install -q --disable-pip-version-check "torch==2.13.0"
$PY -m pip install -q --disable-pip-version-check -e ".[test,bench]"
touch "$stamp"
