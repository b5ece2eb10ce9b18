#!/usr/bin/env bash
# Every GPU check and benchmark the open issues ask for, in one device command (~9 minutes on an H200),
# most needed first:
# the GPU test suite, decode (bf16/int8 KV; through the engine with and without overlap; a host profile;
# int8/int4 weights; qwen3-32b), prefill, prefill attention and the agent turn,
# speculative steps (qwen3-8b and the shipped model), start-up with a warm kernel cache. Each step has its
# own time limit, so one slow step cannot eat the others. Logs and the bench/results lines they appended are
# packed into OUT_DIR/gpu_check.tar.gz (one file: the device tool returns at most eight).
# Usage: NINFER_BENCH_COMMIT=<sha> tools/gpu_check.sh OUT_DIR        (8B replay: tools/replay_gpu.sh)
set -u
out=$1
deadline=${DEADLINE_S:-560}  # seconds from the start: a step gets what is left of this, at most its own limit
logs=$(mktemp -d)
step() {  # step NAME SECONDS COMMAND...: run, keep the log, print its tail, re-pack the tarball
  local name=$1 limit=$2; shift 2
  local left=$((deadline - SECONDS))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 20 ]; then echo "$name skipped: past the deadline" | tee -a "$logs/summary.txt"; return; fi
  echo "== $name ($(date +%T), limit ${limit}s)"
  timeout "$limit" "$@" > "$logs/$name.txt" 2>&1
  echo "$name exit $? after $((SECONDS))s" | tee -a "$logs/summary.txt"
  tail -n 12 "$logs/$name.txt"
  cp bench/results/*.jsonl "$logs/"
  tar -czf "$out/gpu_check.tar.gz" -C "$logs" .  # after every step: a command cut short still returns
}
step gpu_tests 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests
step decode 120 python3 tools/bench_decode.py --contexts 256,114812 --kv bf16,int8 --steps 30
step agent_turn 60 python3 tools/bench_prefill.py --cached 114281 --tokens 531 --chunk 531 --kv int8
step engine 150 bash -c 'python3 tools/make_shaped_model.py --shape qwen3-8b --out /tmp/ninfer-shaped/qwen3-8b \
  && for o in "" --no-overlap; do python3 tools/bench_engine.py --model /tmp/ninfer-shaped/qwen3-8b \
  --context 256,114812 --kv-dtype int8 --max-tokens 96 $o; done'
step attention 90 python3 tools/bench_attention.py --prefill
step spec_demo 120 python3 tools/bench_spec_demo.py
# Start-up: the second start finds every kernel in the cache; its "ready in" line splits the time by phase.
step startup 60 bash -c 'for i in 1 2; do python3 -c "from ninfer_rt.cli import main; main()" generate \
  --prompt "def fibonacci(n):" --max-tokens 16 --temperature 0 --device cuda 2>&1 >/dev/null | grep -E "ready in|compiled"; done'
step host_profile 60 python3 tools/bench_decode.py --contexts 256 --kv bf16 --steps 200 --profile-host
step decode_quant 90 python3 tools/bench_decode.py --contexts 256 --kv bf16 --weights int8,int4 --steps 30
step prefill 60 python3 tools/bench_prefill.py --tokens 8192
step spec 60 python3 tools/bench_spec.py
step decode_32b 90 python3 tools/bench_decode.py --shape qwen3-32b --contexts 256,32768 --kv bf16 --steps 20
cat "$logs/summary.txt"
