"""The kernel developer's tools behind `ninfer-rt kernels`: the edit-compile-test loop (loop.py) and each
kernel family's benchmark on a model's shapes (benches.py and the bench_*.py it registers)."""
