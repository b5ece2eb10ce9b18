#!/usr/bin/env bash
# The replay harness on a GPU, in five modes; each fits one 10-minute device command.
#
#   tools/replay_gpu.sh replay OUT_DIR [SHAPE|MODEL_DIR]     (default qwen3-8b)
#     Writes a random-weight checkpoint of SHAPE to /tmp/ninfer-shaped/SHAPE (tools/make_shaped_model.py;
#     reused while the machine stays warm), starts `serve --device cuda --kv-dtype int8 --max-concurrency 2
#     --verify-ordering`, replays PROFILE (agent) at SCALE (1) with a time limit that ends the whole command
#     within BUDGET_S seconds, and appends the results line to OUT_DIR/results/replay.jsonl, to be copied
#     into bench/results/replay.jsonl. Exits non-zero unless at least MIN_REQUESTS requests went through
#     with no error, the server alive, no ordering violation, its KV pages idle at the end and its exit
#     status 0 after SIGTERM.
#     SHAPE qwen3.6-27b (the hybrid) is written int4 g128 (--bits 4). A hybrid (a qwen3_5 config) is served
#     with the agent workload's own flags, --max-context 262144 (MAX_CONTEXT) --kv-capacity auto --spec mtp
#     --draft-tokens 3 --lm-head-draft --preserve-thinking, and the replay must also skip MIN_SKIPPED (0.99)
#     of the ideal prefix tokens from turn 2, no turn recomputing more than its new tokens + 64, and leave
#     the state slots and snapshots idle.
#   tools/replay_gpu.sh memcheck|racecheck OUT_DIR
#     A short agent replay (scale 0.02) against a tiny hybrid (head_dim 64, linear heads of 64, one MTP
#     layer: the smallest the CUDA kernels take) served with the agent flags under compute-sanitizer
#     --tool memcheck or racecheck (10-100x slower, hence tiny); OUT_DIR/replay.txt ends with its ERROR SUMMARY.
#   tools/replay_gpu.sh soak OUT_DIR [SHAPE|MODEL_DIR]       (default: the tiny hybrid)
#     All seven profiles mixed (tools/traces.py mixed), replayed round after round over both lanes against a
#     server with the agent flags until BUDGET_S runs out (the last round stops at its time limit); the
#     device memory and the server's host RSS are sampled every SAMPLE_S (5) seconds into OUT_DIR/memory.tsv.
#     tools/soak_report.py totals the rounds (OUT_DIR/soak.json) and fails on an error, fewer than
#     MIN_REQUESTS requests or memory growing by more than GROWTH (5%) from the first tenth to the last.
#   tools/replay_gpu.sh fault OUT_DIR
#     The fault drill (rule 6): the tiny hybrid served with the agent flags and --debug-fault-after
#     FAULT_AFTER (400) ops (NINFER_ALLOW_FAULT_DRILL=1), a short agent replay into the fault. Passes when
#     requests failed with a 500 (an error event, once streaming) naming a crash-context file (copied to
#     OUT_DIR/crash-context.json), /health stopped answering 200, the server exited non-zero, and a fresh
#     process can still generate on the device.
# DEVICE=cpu runs replay, soak and fault on the numpy executor (the harness's own check, on a tiny model).
#
# OUT_DIR gets replay.txt (this output: phases with elapsed seconds, the replay's table), server.log,
# trace.jsonl, requests.jsonl and replay_summary.json. NINFER_BENCH_COMMIT=<sha> names the commit in the
# results line where the tree is an export without .git.
set -u
mode=${1:-} out=${2:-} target=${3:-qwen3-8b} target_given=${3:+yes}
profile=${PROFILE:-agent} scale=${SCALE:-1} budget=${BUDGET_S:-570} min_requests=${MIN_REQUESTS:-120}
device=${DEVICE:-cuda} min_skipped=${MIN_SKIPPED:-0.99}
tail_s=30  # after the time limit: the turns in flight, the idle wait, stopping the server, the results line
hybrid_shape=qwen3.6-27b
# The agent workload's serve flags, for the hybrid and its tiny stand-in (each with one MTP layer).
agent_flags=(--kv-capacity auto --spec mtp --draft-tokens 3 --lm-head-draft --preserve-thinking)
case "$mode" in replay|memcheck|racecheck|soak|fault) ;; *) mode=; esac
[ -n "$out" ] && [ -n "$mode" ] \
  || { echo "usage: tools/replay_gpu.sh replay|memcheck|racecheck|soak|fault OUT_DIR [SHAPE|MODEL_DIR]" >&2; exit 2; }
extra_flags=() server_exit=
mkdir -p "$out/results"

log() { echo "[${SECONDS}s] $*"; }
ninfer() { python3 -c 'from ninfer_rt.cli import main; main()' "$@"; }
healthy() {
  python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$1/health', timeout=2)" 2>/dev/null
}

# serve MODEL MAX_CONTEXT PORT WAIT_S [WRAPPER...]: a verifying int8 two-lane server in the background,
# with extra_flags
serve() {
  local model=$1 context=$2 port=$3 until=$((SECONDS + $4)); shift 4
  healthy "$port" && { log "another server already answers on port $port"; return 1; }
  "$@" python3 -c 'from ninfer_rt.cli import main; main()' serve --model "$model" --device "$device" \
    --kv-dtype int8 --max-concurrency 2 --max-context "$context" --verify-ordering --port "$port" "${extra_flags[@]}" \
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
  wait "$server"; server_exit=$?; log "server exit $server_exit"
}

model_dir() {  # a shape name -> its checkpoint under /tmp, written unless already complete; a directory as is
  if [ -d "$target" ]; then model=$target; return 0; fi
  model=/tmp/ninfer-shaped/$target
  if [ -f "$model/config.json" ]; then log "reusing $model"; return 0; fi
  local bits=()
  [ "$target" = "$hybrid_shape" ] && bits=(--bits 4)  # int4 g128, written directly: 17.9 GB
  python3 tools/make_shaped_model.py --shape "$target" --out "$model" "${bits[@]}"
}

tiny_hybrid() {  # the smallest hybrid the CUDA kernels take: head_dim 64, linear key and value heads of 64
  model=/tmp/ninfer-tiny-hybrid-d64
  [ -f "$model/config.json" ] && return 0
  python3 tools/make_tiny_model.py --arch qwen3_5 --out "$model" --hidden 128 --heads 4 --kv-heads 2 \
    --head-dim 64 --linear-key-heads 2 --linear-value-heads 4 --linear-head-dim 64 --intermediate 256 \
    --layers 4 --max-positions 262144 > /dev/null
}

replay_mode() {
  log "replay: $target, profile $profile at scale $scale, budget ${budget}s, at least $min_requests requests"
  python3 tools/traces.py "$profile" --scale "$scale" -o "$out/trace.jsonl" || return 1
  model_dir || return 1
  local context=131072 reuse=()
  if grep -q '"model_type": *"qwen3_5' "$model/config.json"; then  # the hybrid: the agent workload's flags
    context=${MAX_CONTEXT:-262144} extra_flags=("${agent_flags[@]}") reuse=(--min-skipped-of-ideal "$min_skipped")
  fi
  serve "$model" "$context" 8000 $((budget - tail_s - SECONDS - 60)) || return 1
  local limit=$((budget - tail_s - SECONDS))
  log "replaying; no turn starts after ${limit}s"
  ninfer replay "$out/trace.jsonl" --url http://127.0.0.1:8000 --time-limit "$limit" \
    --min-requests "$min_requests" --min-cached-ratio 0.9 "${reuse[@]}" --out "$out/requests.jsonl" \
    --summary-json "$out/replay_summary.json" --no-progress
  local code=$?
  log "replay exit $code"
  stop
  [ -f "$out/replay_summary.json" ] || return 1
  local gpu commit=${NINFER_BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  python3 tools/replay_result.py "$out/replay_summary.json" --model "$target" --profile "$profile" \
    --scale "$scale" --kv-dtype int8 --lanes 2 --replay-exit "$code" --server-exit "$server_exit" \
    --gpu "${gpu:-unknown}" \
    --commit "${commit:-unknown}" | tee -a "$out/results/replay.jsonl"
  log "results line appended to $out/results/replay.jsonl"
  [ "$server_exit" = 0 ] || { log "the server exited $server_exit after SIGTERM, not 0"; return 1; }
  return "$code"
}

sanitizer_mode() {  # sanitizer_mode TOOL
  command -v compute-sanitizer >/dev/null || { log "no compute-sanitizer on PATH"; return 1; }
  tiny_hybrid || return 1
  extra_flags=("${agent_flags[@]}")
  python3 tools/traces.py "$profile" --scale 0.02 -o "$out/trace.jsonl" || return 1
  serve "$model" 32768 8001 300 compute-sanitizer --tool "$1" || return 1
  ninfer replay "$out/trace.jsonl" --url http://127.0.0.1:8001 --time-limit 200 --timeout 300 \
    --out "$out/requests.jsonl" --summary-json "$out/replay_summary.json" --no-progress
  local code=$?
  log "short replay exit $code"
  stop wrapped
  grep -E "ERROR SUMMARY" "$out/server.log" || { log "no ERROR SUMMARY from compute-sanitizer"; return 1; }
  grep -qE "ERROR SUMMARY: 0 errors" "$out/server.log" || return 1
  return "$code"
}

memcheck_mode() { sanitizer_mode memcheck; }
racecheck_mode() { sanitizer_mode racecheck; }

# sample_memory PID FILE: device MiB in use and the server's RSS KiB, every SAMPLE_S seconds until PID exits
sample_memory() {
  local device_mib
  echo -e "elapsed_s\tdevice_mib\thost_rss_kib" > "$2"
  while kill -0 "$1" 2>/dev/null; do
    device_mib=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1)
    echo -e "$SECONDS\t${device_mib:-0}\t$(awk '/^VmRSS/ {print $2}' "/proc/$1/status" 2>/dev/null)" >> "$2"
    sleep "${SAMPLE_S:-5}"
  done
}

soak_mode() {
  if [ "$target_given" = yes ]; then model_dir || return 1; else tiny_hybrid || return 1; fi
  extra_flags=("${agent_flags[@]}")
  log "soak: $model, all seven profiles mixed at scale $scale, rounds until ${budget}s"
  python3 tools/traces.py mixed --scale "$scale" -o "$out/trace.jsonl" || return 1
  serve "$model" "${MAX_CONTEXT:-262144}" 8002 $((budget - tail_s - SECONDS - 60)) || return 1
  sample_memory "$server" "$out/memory.tsv" &
  local sampler=$! code=0 round=0 limit
  while [ "$code" = 0 ] && limit=$((budget - tail_s - SECONDS)) && [ "$limit" -gt 0 ]; do
    round=$((round + 1))
    ninfer replay "$out/trace.jsonl" --url http://127.0.0.1:8002 --time-limit "$limit" --lanes 2 \
      --out "$out/requests.$round.jsonl" --summary-json "$out/replay_summary.$round.json" --no-progress
    code=$?
    log "soak round $round exit $code"
  done
  stop
  wait "$sampler"
  python3 tools/soak_report.py "$out" --max-growth "${GROWTH:-0.05}" --min-requests "$min_requests" || return 1
  [ "$server_exit" = 0 ] || { log "the server exited $server_exit after SIGTERM, not 0"; return 1; }
  return "$code"
}

fault_mode() {
  tiny_hybrid || return 1
  extra_flags=("${agent_flags[@]}" --debug-fault-after "${FAULT_AFTER:-400}")
  python3 tools/traces.py "$profile" --scale 0.02 -o "$out/trace.jsonl" || return 1
  export NINFER_ALLOW_FAULT_DRILL=1 NINFER_CRASH_DIR="$out/crash"
  serve "$model" 32768 8003 300 || return 1
  ninfer replay "$out/trace.jsonl" --url http://127.0.0.1:8003 --timeout 120 --out "$out/requests.jsonl" \
    --summary-json "$out/replay_summary.json" --no-progress
  log "replay exit $? (expected non-zero)"
  healthy 8003 && { log "/health still 200 after the fault"; stop; return 1; }
  for _ in $(seq 30); do kill -0 "$server" 2>/dev/null || break; sleep 1; done
  kill -0 "$server" 2>/dev/null && { log "the server did not exit after the fault"; stop; return 1; }
  wait "$server"; local status=$?
  log "server exit $status (expected non-zero)"
  python3 - "$out" <<'PY' || return 1
import json, pathlib, re, shutil, sys
out = pathlib.Path(sys.argv[1])
summary = json.loads((out / "replay_summary.json").read_text())
named = summary["crash_files"]
# a 500, or a streamed request's error event (its 200 was already sent), naming the crash-context file
assert summary["errors"] and named and named[0] in summary["first_error"], summary["first_error"]
doc = json.loads(pathlib.Path(named[0]).read_text())
assert "ILLEGAL_ADDRESS" in doc["error"], doc["error"]
shutil.copy(named[0], out / "crash-context.json")
print(f"{summary['errors']} request(s) failed naming {named[0]}; error: {doc['error']}")
PY
  [ "$status" != 0 ] || return 1
  python3 -c "from ninfer_rt.cli import main; main()" generate --model "$model" --device "$device" \
    --prompt "after the fault" --max-tokens 8 > "$out/after.txt" 2>&1 || { log "the device is unusable after the fault"; return 1; }
  log "a fresh process generated on the device after the fault"
}

"${mode}_mode" 2>&1 | tee "$out/replay.txt"
exit "${PIPESTATUS[0]}"
