#!/usr/bin/env bash
# The main job on the shipped default model: code-target continues two Python prompts in one batch.
# Extra arguments go to `pdecode generate` (e.g. --method, --temperature, --json).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec pdecode generate --model code-target --prompt "def fibonacci(n):" --prompt "import os
import sys


def main():" --max-new-tokens 96 "$@"
