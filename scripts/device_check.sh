#!/usr/bin/env bash
# The accelerator check (scripts/device_check.py says what it measures): run it from any directory on a lent GPU or
# TPU host whose Python has jax for that accelerator (jax[cuda12] / jax[tpu]) and pdecode's requirements; it
# finishes within 10 minutes and records its figures in docs/results.md ("Accelerator check").
#   bash scripts/device_check.sh           the device run
#   bash scripts/device_check.sh --quick   the CPU smoke run (tiny shapes; what the tests run)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
exec timeout 600 python scripts/device_check.py "$@"
