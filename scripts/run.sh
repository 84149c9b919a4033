#!/usr/bin/env bash
# The main job on the shipped default model: code-target continues two Python prompts in one batch, greedily, by
# autoregressive decoding and by two parallel methods (speculative decoding with code-draft, prompt lookup), and
# prints tokens per forward and tok/s side by side; at greedy both must give AR's text token for token.
# Installs only the runtime package. Extra arguments go to `pdecode generate` (e.g. --temperature 0.7 --top-p 0.9).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh runtime
exec pdecode generate --model code-target --draft code-draft --compare sd lookup --max-new-tokens 96 \
  --prompt "import os
import sys


def main():" --prompt 'def read_lines(path):
    """Return the lines of the file at path."""
' "$@"
