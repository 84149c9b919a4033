#!/usr/bin/env bash
# The benchmark suite: our AR (float32, and mixed precision: bf16 weights, float32 activations) vs transformers
# (float32 and bfloat16) on the same weights, batch 1 and 8. Results under bench_out/ar.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec pdecode bench --model code-target --methods ar "ar:dtype=bfloat16,activation_dtype=float32" \
  --peer transformers transformers-bf16 --batch 1 8 --out bench_out/ar "$@"
