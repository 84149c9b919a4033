#!/usr/bin/env bash
# Retrain the shipped masked-diffusion model zoo/code-dllm: code-target's weights adapted to masked diffusion (the AR
# shift kept, attention annealed from causal to bidirectional), 2800 steps of 8 x 384 tokens on the zoo corpus and
# the task set with its long kinds; about an hour on 2 CPU cores (python -m train.dllm --help).
#   bash scripts/train_dllm.sh            # the shipped model
#   bash scripts/train_dllm.sh --scratch  # the earlier from-scratch code-dllm, its four stages (about 2 hours)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "${1:-}" != "--scratch" ]; then
  exec python3 -m train.dllm "$@"
fi
OLD_KINDS=(add sub mul sort reverse copy brackets)
SHORT=(--recipe scratch --steps 2000 --seq 64 --batch 64 --response-lengths 16 24 32 48 --lr 1e-3 --warmup 50)
python3 -m train.dllm --recipe scratch --task-kinds "${OLD_KINDS[@]}"
python3 -m train.dllm --init-from zoo/code-dllm "${SHORT[@]}" --task-kinds "${OLD_KINDS[@]}"
python3 -m train.dllm --init-from zoo/code-dllm "${SHORT[@]}"
python3 -m train.dllm --recipe scratch --init-from zoo/code-dllm --steps 320 --seq 288 --batch 16 --lr 5e-4 --warmup 20
