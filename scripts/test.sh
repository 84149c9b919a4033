#!/usr/bin/env bash
# Set up (once) and run the whole test suite on the CPU, 8 forced devices for the multi-device tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export XLA_FLAGS="${XLA_FLAGS:---xla_force_host_platform_device_count=8}"
# Two pytest workers: most of the suite's time is XLA compiling (single-threaded), so two processes keep both cores
# busy. PDECODE_TEST_WORKERS=0 runs everything in this one process.
exec python3 -m pytest -q -n "${PDECODE_TEST_WORKERS:-2}" --dist loadgroup --durations=30 "$@"
