#!/usr/bin/env bash
# The GPU checks and benchmarks of the Qwen3.5 hybrid at the 27B shape, in one device command (~9 minutes on
# an H200), most needed first: the GPU test suite, the Gated DeltaNet kernels beside fla-core (where it
# imports) and the split chunked form, the quantized prefill GEMM (fused against dequantize + cuBLASLt over the
# 27B's matrices at 531 and 8192 tokens), prefill of the 27B shape (8,192 tokens, bf16 and int4; the agent
# turn's 531 over 114,281 cached), the 27B int4 checkpoint written directly, decode through the engine
# (plain and MTP k=3 over a 32,768-row draft head) and the agent turn (114,281 cached + 531 new tokens, resumed
# from a state snapshot), the graphed step at 27B for bf16/int8/int4 weights, start-up with a warm kernel cache,
# the 27B as a NInfer `.ninfer` artifact, and the dense qwen3-8b step as the regression check. Each step has
# its own time limit, so one slow step cannot eat the others. Logs and the bench/results lines they appended
# are packed into OUT_DIR/gpu_check.tar.gz (one file: the device tool returns at most eight).
# Usage: NINFER_BENCH_COMMIT=<sha> [STEPS="gpu_tests engine_27b ..."] tools/gpu_check.sh OUT_DIR
# STEPS, when given, names the steps to run (the others are skipped; build_27b runs when a 27B step does).
# The full-scale replay, the sanitizers, the soak and the fault drill: tools/replay_gpu.sh (one command each).
set -u
out=$1
deadline=${DEADLINE_S:-560}  # seconds from the start: a step gets what is left of this, at most its own limit
logs=$(mktemp -d)
step() {  # step NAME SECONDS COMMAND...: run, keep the log, print its tail, re-pack the tarball
  local name=$1 limit=$2; shift 2
  if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then
    [[ $name == build_27b && $STEPS == *27b* ]] || return 0
  fi
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
parallel=$(python3 -c "import xdist" 2>/dev/null && echo "-n 6")
q27=/tmp/ninfer-shaped/qwen3.6-27b-int4
# ~1,200 tests on 6 workers: 125-140 s until 2026-12-05, cut at 96% by a 240 s limit at 5b74b37 (fresh machine)
step gpu_tests 330 python3 -m pytest -m gpu -q -p no:cacheprovider $parallel tests
step gdn 150 python3 tools/bench_gdn.py --chunked 531,8192,114812 --repeats 10
# the chunked delta rule split in three passes (NINFER_GDN_CHUNKED=split), whole and pass by pass
step gdn_split 60 python3 tools/bench_gdn.py --recurrent "" --chunked 531,8192 --split --no-fla --repeats 10
# prefill attention at the 27B's gated-attention heads (head_dim 256): the sm_90a wgmma kernel beside the mma.sync one
step attention_27b 60 python3 tools/bench_attention.py --prefill --shape qwen3.6-27b --cases 531x114812,8192x8192 --kv bf16,int8
# the 27B's quantized decode GEMVs on their own (int4 target: 0.80 of the copy bandwidth over a step's mix)
step gemv_27b 60 python3 tools/bench_quant.py --shape qwen3.6-27b --bits 4,8 --rows 1,4
# the quantized prefill GEMM: NINFER_QUANT_GEMM=fused (gemm_quant.cu) against the default dequantize + cuBLASLt
step quant_gemm 90 python3 tools/bench_quant.py --gemm --bits 4,8 --rows 531,8192
# prefill at the 27B shape: 8,192 tokens with bf16 and int4 weights (fraction of the GEMM rate counting GEMM +
# attention + delta-rule FLOPs), and the agent turn's 531 new tokens over 114,281 cached ones (int4, int8 KV)
step prefill_27b 180 bash -c "python3 tools/bench_prefill.py --shape qwen3.6-27b --tokens 8192 --weights bf16,int4 && \
  python3 tools/bench_prefill.py --shape qwen3.6-27b --cached 114281 --tokens 531 --chunk 531 --kv int8 --weights int4"
step build_27b 60 bash -c "[ -d $q27 ] || python3 tools/make_shaped_model.py --shape qwen3.6-27b --bits 4 --out $q27"
step engine_27b 180 python3 tools/bench_engine.py --model $q27 --context 256,7680 --kv-dtype int8 --max-tokens 64 \
  --draft-tokens 0,3 --lm-head-draft 32768 --agent-turn 114281,531
# where the agent turn's time to first token and an MTP round's time go on the GPU, kernel by kernel, and how
# long the GPU waits for the host (the rows are marked traced)
step trace_27b 150 python3 tools/bench_engine.py --model $q27 --context 7680 --kv-dtype int8 --max-tokens 48 \
  --draft-tokens 0,3 --lm-head-draft 32768 --agent-turn 114281,531 --trace
step decode_27b 120 python3 tools/bench_decode.py --shape qwen3.6-27b --contexts 256,7680 --kv int8 --weights int4,int8,bf16 --steps 30
# where the int4 27B step's time goes, kernel by kernel (CUPTI marginal times)
step profile_27b 90 python3 tools/profile_decode.py --shape qwen3.6-27b --context 256 --kv int8 --weights int4 --steps 20
# Start-up: the second start finds every kernel in the cache; its "ready in" line splits the time by phase.
step startup 90 bash -c "for i in 1 2; do python3 -c 'from ninfer_rt.cli import main; main()' generate --model $q27 \
  --prompt 'def fibonacci(n):' --max-tokens 4 --temperature 0 --device cuda --kv-dtype int8 2>&1 >/dev/null | grep -E 'ready in|compiled'; done"
# The user's NInfer artifact format at the 27B shape (random codes, Q4/Q5/Q6G64 + W8G32): written, started
# (its "ready in" and memory lines), decoded at 7,680 tokens beside engine_27b's int4 g128 figure.
a27=/tmp/ninfer-shaped/qwen3.6-27b.ninfer
step artifact_27b 240 bash -c "[ -f $a27 ] || python3 tools/make_shaped_model.py --shape qwen3.6-27b --format ninfer --out $a27; \
  python3 -c 'from ninfer_rt.cli import main; main()' generate --model $a27 --prompt 'def f(n):' --max-tokens 4 \
  --temperature 0 --device cuda --kv-dtype int8 2>&1 >/dev/null | grep -E 'ready in|memory'; \
  python3 tools/bench_engine.py --model $a27 --context 7680 --kv-dtype int8 --max-tokens 64"
step engine_27b_long 120 python3 tools/bench_engine.py --model $q27 --context 114812,262112 --kv-dtype int8 --max-tokens 32
step decode_8b 60 python3 tools/bench_decode.py --contexts 256 --kv bf16 --weights bf16,int4 --steps 30
cat "$logs/summary.txt"
