"""Gated DeltaNet delta rule at the Qwen3.6-27B layer shape (16 key heads, 48 value heads of 128), beside fla-core.

Ours (kernels_src/gdn_delta_rule.cu through ninfer_rt.cuda.linear_attn_ops; the cases are
ninfer_rt.kernel_dev.bench_gdn's, also `ninfer-rt kernels bench gdn_delta_rule`):
- recurrent: one sequence of T = 1 (decode) and T = 4 rows (verification, keeping only the final state as
  fla does, and keeping all four states as a k=3 verify pass does), the state updated in place in its slot;
- layer: the whole decode op of a layer (conv + SiLU, recurrent delta rule, gated norm);
- chunked: prefill of T = 531 and 8192 rows from an initial state to a final one, with the column group the
  device takes (32 on an H200) and the portable one sm_120 takes (16); with --split also the chunked form
  split in three passes (kernels_src/gdn_chunked_split.cu, the executor's NINFER_GDN_CHUNKED=split) with
  carry blocks of 32 and 16 columns, whole and each pass alone.
Every graph replays one launch per layer over 48 distinct layer states (a 48-layer state slot, 144 MiB), as
a real step touches them, so the recurrent update streams its 3 MiB state from HBM rather than L2. The
recurrent fraction is of the copy bandwidth measured in the same run (ninfer_rt.cuda.benchmark), counting the
state bytes read and written. With `import fla` working (fla-core on the GPU machine), fla's
`fused_recurrent_gated_delta_rule` and `chunk_gated_delta_rule` run on the same shapes (q/k repeated to the
48 value heads as transformers does, L2 norm in the kernel, 48 distinct initial states), captured in CUDA
graphs too. Prints a table and appends JSON lines to bench/results/gdn.jsonl.

    python tools/bench_gdn.py [--recurrent 1,4] [--chunked 531,8192] [--split] [--no-fla]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

from bench_decode import append_results, print_table, run_info
from ninfer_rt.cuda import linear_attn_ops as ops
from ninfer_rt.cuda.benchmark import BenchSession, copy_bandwidth
from ninfer_rt.cuda.driver import open_device
from ninfer_rt.kernel_dev.bench_gdn import LAYERS, QWEN3_6_27B, DeltaRuleCase, state_bytes

HEADS = QWEN3_6_27B
STATE_BYTES = state_bytes(HEADS)


def our_rows(session: BenchSession, recurrent: list[int], chunked: list[int], split: bool) -> list[dict[str, object]]:
    rows = []
    for t in recurrent:
        for targets in sorted({1, t}):
            case = DeltaRuleCase(session, HEADS, t, targets)
            seconds = session.time(case.delta_rule(ops.RECURRENT_COLUMNS), LAYERS)
            rows.append(row("ninfer recurrent", t, targets, seconds, (1 + targets) * STATE_BYTES))
            if t == 1:
                rows.append(row("ninfer layer (conv+rule+norm)", t, targets, session.time(case.layer(), LAYERS), 2 * STATE_BYTES))
            session.release()
    optin = session.device.max_shared_memory_per_block_optin
    for t in chunked:
        for columns in sorted({ops.chunk_columns(HEADS.key_dim, HEADS.value_dim, optin), 16}, reverse=True):
            case = DeltaRuleCase(session, HEADS, t, 1)
            seconds = session.time(case.delta_rule(columns), LAYERS)
            rows.append(row(f"ninfer chunked c{columns}", t, 1, seconds, 2 * STATE_BYTES))
            session.release()
        for columns in (32, 16) if split else ():
            case = DeltaRuleCase(session, HEADS, t, 1)
            seconds = session.time(case.delta_rule(columns, split=True), LAYERS)
            rows.append(row(f"ninfer split c{columns}", t, 1, seconds, 2 * STATE_BYTES))
            for name in ops.SPLIT_PASSES:  # each pass alone, over the workspace the whole run left
                seconds = session.time(case.delta_rule(columns, split=True, passes=(name,)), LAYERS)
                rows.append(row(f"  {name} c{columns}", t, 1, seconds, 2 * STATE_BYTES))
            session.release()
    return rows


def row(kernel: str, t: int, targets: int, seconds: float, state_bytes: int) -> dict[str, object]:
    return {"kernel": kernel, "T": t, "states_kept": targets, "us": seconds * 1e6, "state_bytes": state_bytes}


def fla_rows(recurrent: list[int], chunked: list[int], repeats: int) -> list[dict[str, object]]:
    """fla-core's kernels on the same shapes, each call captured in a torch CUDA graph of 48 calls."""
    try:
        import torch
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError as err:
        print(f"fla-core not measured: {err}")
        return []
    rows = []
    for kernel, fn, lengths in (("fla fused_recurrent", fused_recurrent_gated_delta_rule, recurrent), ("fla chunk", chunk_gated_delta_rule, chunked)):
        for t in lengths:
            call = fla_call(torch, fn, t)
            rows.append(row(kernel, t, 1, time_torch_graph(torch, call, repeats), 2 * STATE_BYTES))
    return rows


def fla_call(torch: object, fn: Callable[..., object], t: int) -> Callable[[int], None]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    hv, d = HEADS.value_heads, HEADS.key_dim

    def randn(*shape: int, dtype: object = torch.bfloat16) -> object:
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)

    q, k, v = (randn(1, t, hv, d) for _ in range(3))  # q, k already repeated from 16 key heads to 48
    g = -torch.nn.functional.softplus(randn(1, t, hv, dtype=torch.float32))
    beta = torch.sigmoid(randn(1, t, hv, dtype=torch.float32)).to(torch.bfloat16)
    states = [randn(1, hv, d, d, dtype=torch.float32) * 0.1 for _ in range(LAYERS)]

    def call(i: int) -> None:
        fn(q, k, v, g, beta, scale=d**-0.5, initial_state=states[i % LAYERS], output_final_state=True, use_qk_l2norm_in_kernel=True)

    return call


def time_torch_graph(torch: object, call: Callable[[int], None], repeats: int) -> float:
    """Median seconds per call over replays of a graph of LAYERS calls (Triton's autotuning runs first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            call(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(LAYERS):
            call(i)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / LAYERS)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recurrent", default="1,4", help="rows of the recurrent cases")
    parser.add_argument("--chunked", default="531,8192", help="rows of the chunked cases")
    parser.add_argument("--repeats", type=int, default=30, help="timed replays (median)")
    parser.add_argument("--split", action="store_true", help="also time the split chunked form (three passes)")
    parser.add_argument("--no-fla", action="store_true", help="skip fla-core even where it imports")
    args = parser.parse_args()
    recurrent, chunked = ([int(n) for n in text.split(",") if n] for text in (args.recurrent, args.chunked))

    session = BenchSession.open(open_device(0), repeats=args.repeats)
    info = run_info(session.device)
    bandwidth = copy_bandwidth(session.streams)
    measured = our_rows(session, recurrent, chunked, args.split)
    session.close()
    if not args.no_fla:
        measured += fla_rows(recurrent, chunked, args.repeats)
    rows = [
        {**info, **m, "GB/s": m["state_bytes"] / m["us"] / 1e3, "of_copy_bw": m["state_bytes"] / (m["us"] * 1e-6) / bandwidth,
         "copy_GB/s": bandwidth / 1e9}
        for m in measured
    ]
    print(f"{info['gpu']}, commit {info['commit']}, copy bandwidth {bandwidth / 1e12:.2f} TB/s; 48 value heads of 128, 48 layer states")
    print_table(rows, ["kernel", "T", "states_kept", "us", "GB/s", "of_copy_bw"])
    print(f"appended to {append_results('gdn', rows)}")


if __name__ == "__main__":
    main()
