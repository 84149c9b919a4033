#!/usr/bin/env bash
# Set up (once) and run the whole test suite on the CPU, 8 forced devices for the multi-device tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# (XLA:CPU without its expensive LLVM passes and with its older fusion emitters: the suite is mostly compiling tiny
# programs; ~25% and ~20% less compile time; and layers under lax.scan, see tests/conftest.py)
export PDECODE_UNROLL_MAX_LAYERS="${PDECODE_UNROLL_MAX_LAYERS:-0}"
export XLA_FLAGS="${XLA_FLAGS:---xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false}"
# Two pytest workers: most of the suite's time is XLA compiling (single-threaded), so two processes keep both cores
# busy. PDECODE_TEST_WORKERS=0 runs everything in this one process. `bash scripts/test.sh -m fast`: the unit tier only.
# One compilation cache on disk for the whole run (JAX's persistent cache, a fresh directory): the servers, CLI runs
# and multi-process workers the tests start, and both workers, load a program another process already compiled.
if [ -z "${JAX_COMPILATION_CACHE_DIR:-}" ]; then
  export JAX_COMPILATION_CACHE_DIR="$(mktemp -d "${TMPDIR:-/tmp}/pdecode-test-xla.XXXXXX")"
  export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0}"
  trap 'rm -rf "$JAX_COMPILATION_CACHE_DIR"' EXIT
fi
# A worker that dies (a crash in native code) is not replaced: pytest-xdist 3.8's loadgroup scheduler hangs after
# replacing one (pytest-dev/pytest-xdist#1323, #1378; a CI run sat there until its 90-minute limit): the run ends at
# once instead, naming the test the worker died in.
python3 -m pytest -q -n "${PDECODE_TEST_WORKERS:-2}" --dist loadgroup --max-worker-restart=0 --durations=30 "$@"
