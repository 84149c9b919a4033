#!/usr/bin/env bash
# The benchmark suite: our AR vs transformers on the same weights, batch 1 and 8. Results under bench_out/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec pdecode bench --model code-target --methods ar --peer transformers --batch 1 8 --out bench_out/ar "$@"
