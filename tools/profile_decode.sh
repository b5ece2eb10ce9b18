#!/usr/bin/env bash
# Per-kernel GPU time inside a graphed decode step (nsys traces graph nodes): which kernels of the step
# are off their roofline. Usage: tools/profile_decode.sh OUT_DIR [bench_decode.py args...]
# Needs Nsight Systems (nsys) on the GPU machine.
set -u
out=$1; shift
command -v nsys >/dev/null || { echo "nsys not found: no per-kernel profile"; exit 0; }
nsys profile --cuda-graph-trace=node --trace=cuda --force-overwrite=true -o "$out/decode" \
  python3 tools/bench_decode.py --steps 20 "$@" > "$out/profile_run.txt" 2>&1
nsys stats --report cuda_gpu_kern_sum --format csv --output "$out/kernels" "$out/decode.nsys-rep" > /dev/null 2>&1
python3 - "$out/kernels_cuda_gpu_kern_sum.csv" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
total = sum(float(r["Total Time (ns)"]) for r in rows)
print(f"{'kernel':60s} {'calls':>7s} {'avg us':>9s} {'share':>6s}")
for r in sorted(rows, key=lambda r: -float(r["Total Time (ns)"]))[:25]:
    print(f"{r['Name'][:60]:60s} {r['Instances']:>7s} {float(r['Avg (ns)'])/1e3:9.2f} {float(r['Total Time (ns)'])/total:6.1%}")
PY
