#!/usr/bin/env bash
# The replay harness on a GPU: profile PROFILE at SCALE against a `serve --device cuda --kv-dtype int8
# --max-concurrency 2 --verify-ordering` server, then a short replay with the server under
# compute-sanitizer memcheck. Usage: tools/replay_gpu.sh MODEL_DIR OUT_DIR [PROFILE] [SCALE] [SECONDS]
set -u
model=$1 out=$2 profile=${3:-agent} scale=${4:-1} seconds=${5:-270} device=${DEVICE:-cuda}
serve() {  # serve PORT [wrapper...]: start a server in the background, wait for /health
  local port=$1; shift
  "$@" python3 -c 'from ninfer_rt.cli import main; main()' serve --model "$model" --device "$device" --kv-dtype int8 \
    --max-concurrency 2 --max-context 131072 --verify-ordering --port "$port" &
  server=$!
  for _ in $(seq 240); do python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/health')" 2>/dev/null && return 0; sleep 0.5; done
  echo "server on port $port did not become healthy"; return 1
}
# TERM goes to the server itself (under compute-sanitizer: its child), so it drains and the sanitizer
# lives to print its error summary.
stop() { pkill -TERM -P "$server" 2>/dev/null || kill -TERM "$server"; wait "$server"; echo "server exit $?"; }

python3 tools/traces.py "$profile" --scale "$scale" -o /tmp/full.jsonl
[ "$seconds" -gt 0 ] && serve 8000 > "$out/server.log" 2>&1 && {
  timeout "$seconds" python3 -c 'from ninfer_rt.cli import main; main()' replay /tmp/full.jsonl \
    --url http://127.0.0.1:8000 --min-cached-ratio 0.9 --out "$out/replay.jsonl" \
    --summary-json "$out/replay_summary.json" --no-progress
  echo "replay exit $?"
  stop
} > "$out/replay.txt" 2>&1

command -v compute-sanitizer >/dev/null || { echo "no compute-sanitizer: memcheck replay skipped" >> "$out/replay.txt"; exit 0; }
python3 tools/traces.py "$profile" --scale 0.02 -o /tmp/short.jsonl
serve 8001 compute-sanitizer --tool memcheck > "$out/memcheck.log" 2>&1 && {
  timeout 100 python3 -c 'from ninfer_rt.cli import main; main()' replay /tmp/short.jsonl \
    --url http://127.0.0.1:8001 --no-progress --timeout 600
  echo "short replay exit $?"
  stop
} >> "$out/replay.txt" 2>&1
grep -E "ERROR SUMMARY" "$out/memcheck.log" >> "$out/replay.txt"
