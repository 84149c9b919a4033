#!/usr/bin/env bash
# guidellm (a load tester; `pip install guidellm`, not a pdecode extra) against `pdecode serve`, with guidellm's
# defaults (streaming, its OpenAI HTTP backend): concurrency 1, 4 and 16, synthetic prompts of 128 tokens asking
# for 64, 32 requests per level. Tables go to the console and to $OUT (benchmarks.json / .csv).
#   bash scripts/guidellm_run.sh                 # code-target, ar
#   METHOD=sd ARGS="--draft code-draft" bash scripts/guidellm_run.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-code-target}
METHOD=${METHOD:-ar}
PORT=${PORT:-8741}
OUT=${OUT:-bench_out/guidellm-$METHOD}
command -v guidellm >/dev/null || { echo "guidellm is not installed: pip install guidellm" >&2; exit 2; }
mkdir -p "$OUT"
python3 -m infer.cli serve --model "$MODEL" --method "$METHOD" ${ARGS:-} --port "$PORT" > "$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  # up, and every program compiled (the default warm-up goes on in the background while the server takes requests)
  curl -sf "http://127.0.0.1:$PORT/health" 2>/dev/null | grep -q '"programs_pending": 0' && break
  kill -0 $SERVER 2>/dev/null || { echo "the server exited:" >&2; tail -5 "$OUT/serve.log" >&2; exit 1; }
  sleep 1
done
TOKENIZER=$(python3 -c "import pdecode; print(pdecode.api.resolve_path('$MODEL'))")
cd "$OUT"
guidellm run --backend "kind=openai_http,target=http://127.0.0.1:$PORT" --profile kind=concurrent \
  --override profile.streams 1,4,16 --data "kind=synthetic_text,prompt_tokens=128,output_tokens=64" \
  --tokenizer "kind=hf_auto,model=$TOKENIZER" --constraint kind=max_requests,count=32 --disable-progress 2>&1 \
  | tee run.log | grep -E "completed \||^\| concurrent|Benchmark|Strategy" || true
