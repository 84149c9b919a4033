#!/usr/bin/env bash
# Retrain the shipped masked-diffusion model zoo/code-dllm as it was trained: four stages on 2 CPU cores, each
# starting from the previous one (measured: 41 + 38 + 32 + 12 minutes).
#   1. 1000 steps of 16 x 288 tokens, 87.5% task SFT on the first seven task kinds, 12.5% corpus windows
#   2. 2000 steps of 64 x 64 tokens, short responses, the same seven kinds (more task examples per minute)
#   3. the same on all ten kinds (adds the digit-list kinds: copy_list, reverse_list, max)
#   4. 320 steps of 16 x 288 tokens, responses up to 256 tokens again, so long canvases close with EOS
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
OLD_KINDS=(add sub mul sort reverse copy brackets)
SHORT=(--steps 2000 --seq 64 --batch 64 --response-lengths 16 24 32 48 --lr 1e-3 --warmup 50)
python3 -m train.dllm --task-kinds "${OLD_KINDS[@]}"
python3 -m train.dllm --init-from zoo/code-dllm "${SHORT[@]}" --task-kinds "${OLD_KINDS[@]}"
python3 -m train.dllm --init-from zoo/code-dllm "${SHORT[@]}"
python3 -m train.dllm --init-from zoo/code-dllm --steps 320 --seq 288 --batch 16 --lr 5e-4 --warmup 20
