#!/usr/bin/env bash
# The replay harness on a GPU, in two modes; each fits one 10-minute device command.
#
#   tools/replay_gpu.sh replay OUT_DIR [SHAPE|MODEL_DIR]     (default qwen3-8b)
#     Writes a random-weight checkpoint of SHAPE to /tmp/ninfer-shaped/SHAPE (tools/make_shaped_model.py;
#     reused while the machine stays warm), starts `serve --device cuda --kv-dtype int8 --max-concurrency 2
#     --verify-ordering`, replays PROFILE (agent) at SCALE (1) with a time limit that ends the whole command
#     within BUDGET_S seconds, and appends the results line to OUT_DIR/results/replay.jsonl, to be copied
#     into bench/results/replay.jsonl. Exits non-zero unless at least MIN_REQUESTS requests went through
#     with no error, the server alive, no ordering violation and its KV pages idle at the end.
#   tools/replay_gpu.sh memcheck OUT_DIR
#     A short agent replay (scale 0.02) against a tiny head_dim-64 model served under compute-sanitizer
#     memcheck (10-100x slower, hence a tiny model); OUT_DIR/replay.txt ends with its ERROR SUMMARY.
#
# OUT_DIR gets replay.txt (this output: phases with elapsed seconds, the replay's table), server.log,
# trace.jsonl, requests.jsonl and replay_summary.json. NINFER_BENCH_COMMIT=<sha> names the commit in the
# results line where the tree is an export without .git.
set -u
mode=${1:-} out=${2:-} target=${3:-qwen3-8b}
profile=${PROFILE:-agent} scale=${SCALE:-1} budget=${BUDGET_S:-570} min_requests=${MIN_REQUESTS:-120}
device=${DEVICE:-cuda}
tail_s=30  # after the time limit: the turns in flight, the idle wait, stopping the server, the results line
[ -n "$out" ] && { [ "$mode" = replay ] || [ "$mode" = memcheck ]; } \
  || { echo "usage: tools/replay_gpu.sh replay|memcheck OUT_DIR [SHAPE|MODEL_DIR]" >&2; exit 2; }
mkdir -p "$out/results"

log() { echo "[${SECONDS}s] $*"; }
ninfer() { python3 -c 'from ninfer_rt.cli import main; main()' "$@"; }
healthy() {
  python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$1/health', timeout=2)" 2>/dev/null
}

# serve MODEL MAX_CONTEXT PORT WAIT_S [WRAPPER...]: a verifying int8 two-lane server in the background
serve() {
  local model=$1 context=$2 port=$3 until=$((SECONDS + $4)); shift 4
  healthy "$port" && { log "another server already answers on port $port"; return 1; }
  "$@" python3 -c 'from ninfer_rt.cli import main; main()' serve --model "$model" --device "$device" \
    --kv-dtype int8 --max-concurrency 2 --max-context "$context" --verify-ordering --port "$port" \
    > "$out/server.log" 2>&1 &
  server=$!
  while [ "$SECONDS" -lt "$until" ]; do
    kill -0 "$server" 2>/dev/null || { log "the server exited while starting:"; tail -20 "$out/server.log"; return 1; }
    healthy "$port" && { log "server healthy on port $port"; return 0; }
    sleep 1
  done
  log "the server was not healthy in time:"; tail -20 "$out/server.log"
  pkill -KILL -P "$server"; kill -KILL "$server"; wait "$server"; return 1
}

# stop [WRAPPED]: TERM to the server so it drains and exits; under compute-sanitizer to the sanitizer's
# children, so the sanitizer lives to print its ERROR SUMMARY (it also prints "couldn't find exit code"
# for the server: seen on the H200, harmless). KILL after 30 s.
stop() {
  if [ "${1:-}" = wrapped ]; then pkill -TERM -P "$server"; else kill -TERM "$server"; fi
  for _ in $(seq 30); do kill -0 "$server" 2>/dev/null || break; sleep 1; done
  kill -0 "$server" 2>/dev/null && { log "server still up after 30 s: KILL"; kill -KILL "$server"; }
  wait "$server"; log "server exit $?"
}

model_dir() {  # a shape name -> its checkpoint under /tmp, written unless already complete; a directory as is
  if [ -d "$target" ]; then model=$target; return 0; fi
  model=/tmp/ninfer-shaped/$target
  if [ -f "$model/config.json" ]; then log "reusing $model"; return 0; fi
  python3 tools/make_shaped_model.py --shape "$target" --out "$model"
}

replay_mode() {
  log "replay: $target, profile $profile at scale $scale, budget ${budget}s, at least $min_requests requests"
  python3 tools/traces.py "$profile" --scale "$scale" -o "$out/trace.jsonl" || return 1
  model_dir || return 1
  serve "$model" 131072 8000 $((budget - tail_s - SECONDS - 60)) || return 1
  local limit=$((budget - tail_s - SECONDS))
  log "replaying; no turn starts after ${limit}s"
  ninfer replay "$out/trace.jsonl" --url http://127.0.0.1:8000 --time-limit "$limit" \
    --min-requests "$min_requests" --min-cached-ratio 0.9 --out "$out/requests.jsonl" \
    --summary-json "$out/replay_summary.json" --no-progress
  local code=$?
  log "replay exit $code"
  stop
  [ -f "$out/replay_summary.json" ] || return 1
  local gpu commit=${NINFER_BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  python3 tools/replay_result.py "$out/replay_summary.json" --model "$target" --profile "$profile" \
    --scale "$scale" --kv-dtype int8 --lanes 2 --replay-exit "$code" --gpu "${gpu:-unknown}" \
    --commit "${commit:-unknown}" | tee -a "$out/results/replay.jsonl"
  log "results line appended to $out/results/replay.jsonl"
  return "$code"
}

memcheck_mode() {
  command -v compute-sanitizer >/dev/null || { log "no compute-sanitizer on PATH"; return 1; }
  model=/tmp/ninfer-tiny-d64
  python3 tools/make_tiny_model.py --out "$model" --hidden 128 --heads 4 --kv-heads 2 --head-dim 64 \
    --intermediate 256 --layers 2 --max-positions 32768 || return 1
  python3 tools/traces.py "$profile" --scale 0.02 -o "$out/trace.jsonl" || return 1
  serve "$model" 32768 8001 300 compute-sanitizer --tool memcheck || return 1
  ninfer replay "$out/trace.jsonl" --url http://127.0.0.1:8001 --time-limit 200 --timeout 300 \
    --out "$out/requests.jsonl" --summary-json "$out/replay_summary.json" --no-progress
  local code=$?
  log "short replay exit $code"
  stop wrapped
  grep -E "ERROR SUMMARY" "$out/server.log" || { log "no ERROR SUMMARY from compute-sanitizer"; return 1; }
  grep -qE "ERROR SUMMARY: 0 errors" "$out/server.log" || return 1
  return "$code"
}

"${mode}_mode" 2>&1 | tee "$out/replay.txt"
exit "${PIPESTATUS[0]}"
