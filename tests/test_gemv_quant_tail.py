"""gemv_quant.cu's dense tail on the CPU: the launch quant_ops decides for a projection of quantized rows then
bf16 rows (a quantized Gated DeltaNet's [q|k|v|z] beside its [b|a]), the checks that refuse a tail before
anything is enqueued, and the kernel's tail tiles emulated in numpy (fragments, pointer walk, output offset)
beside the quantized tiles, against float64."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kernel_source import constexpr_int
from ninfer_rt.cuda import quant_ops
from ninfer_rt.cuda.linear_ops import Epilogue
from ninfer_rt.cuda.memory import DeviceBuffer
from ninfer_rt.cuda.quant_ops import DenseTail
from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.quantize.layouts import dequantize
from quant_fragments import G, T, mma_m16n8k16
from test_attention_compile import RecordingLibrary
from test_gemv_quant_compile import weight
from test_gemv_quant_layout import emulate_gemv, quantized

BF16 = np.dtype(ml_dtypes.bfloat16)
H200_SMS = 132
TAIL_RUNS = constexpr_int("gemv_quant.cu", "kTailRuns")


def test_the_27b_projection_is_one_grid_tail_tiles_first() -> None:
    """in_proj_qkvz 16384 x 5120 int4 g128 (1024 tiles) + [b|a] 96 x 5120 bf16 (6 tiles): 1030 blocks of 8
    warps, over two tiles per SM, as the quantized weight alone would get."""
    q = weight(rows=16384, cols=5120)
    tail = DenseTail(DeviceBuffer(StreamSet(), 96 * 5120 * 2, "tail"), 96)
    assert quant_ops.tail_tiles(tail) == 6 and quant_ops.tail_tiles(None) == 0
    for rows in (1, 2, 3, 4):
        spec, blocks, threads = quant_ops.gemv_launch(q, rows, Epilogue.STORE, H200_SMS, tail=tail)
        assert (spec.name, blocks, threads) == (f"gemv_int4_b{1 if rows == 1 else 2 if rows == 2 else 4}", 1030, 256)
    assert quant_ops.gemv_launch(q, 1, Epilogue.STORE, H200_SMS)[1] == 1024
    # a tail that tips a grid past two tiles per SM takes it from 16 warps to 8, as a wider weight would
    small = weight(rows=4128, cols=5120)  # 258 tiles
    assert quant_ops.gemv_launch(small, 1, Epilogue.STORE, H200_SMS)[2] == 512
    assert quant_ops.gemv_launch(small, 1, Epilogue.STORE, H200_SMS, tail=tail)[1:] == (264, 512)
    assert quant_ops.gemv_launch(small, 1, Epilogue.STORE, H200_SMS, tail=DenseTail(tail.weight, 97))[1:] == (265, 256)


def launch_args(rows: int, n: int, k: int, tail_rows: int, y_bytes: int | None = None) -> tuple[object, list]:
    """Runs quant_ops.gemv with a tail through a recording library: (stream, launches)."""
    streams = StreamSet(verify=False)
    stream, lib = streams.create("compute"), RecordingLibrary()
    w = weight(rows=n, cols=k)
    x = DeviceBuffer(streams, rows * k * 2, "x")
    y = DeviceBuffer(streams, y_bytes or rows * (n + tail_rows) * 2, "y")
    tail = DenseTail(DeviceBuffer(streams, tail_rows * k * 2, "tail"), tail_rows)
    quant_ops.gemv(lib, stream, x, w, y, rows, tail=tail)  # type: ignore[arg-type]
    return stream, lib.launches


def test_the_launch_passes_the_tail_and_reads_it() -> None:
    _, [launch] = launch_args(3, 768, 256, 8)
    assert launch.name == "gemv_int4_b4_w16" and launch.grid == 48 + 1
    *_, n, k, _, epilogue, tail, tail_rows = launch.args
    assert (n, k, epilogue, tail_rows) == (768, 256, 0, 8) and tail.name == "tail"
    assert any(resource is tail.resource for resource in launch.reads)


@pytest.mark.parametrize("epilogue", [Epilogue.SWIGLU, Epilogue.RESIDUAL, Epilogue.STORE_F32])
def test_a_tail_is_refused_with_any_epilogue_but_store(epilogue: Epilogue) -> None:
    streams = StreamSet()
    stream, buf = streams.create("compute"), DeviceBuffer(streams, 1 << 20, "b")
    tail = DenseTail(DeviceBuffer(streams, 16 * 256 * 2, "tail"), 16)
    residual = buf if epilogue is Epilogue.RESIDUAL else None
    with pytest.raises(ValueError, match="STORE epilogue only"):
        quant_ops.gemv(None, stream, buf, weight(rows=32), buf, 1, epilogue, residual, tail=tail)  # type: ignore[arg-type]
    assert stream.ring.seq == 0


def test_an_output_without_room_for_the_tails_columns_is_refused() -> None:
    with pytest.raises(ValueError, match="y"):
        launch_args(2, 768, 256, 8, y_bytes=2 * 768 * 2)  # room for the quantized columns only


# -- the kernel, emulated -------------------------------------------------------------------------------------


def emulate_tail(x: np.ndarray, tail: np.ndarray, rows: int, warps: int) -> dict[int, float]:
    """gemv_quant's tail tiles (tail_tile_sums, then the shared reduction and store), in float64: flat index
    of y -> value, y's rows n + tail_rows apart, the tail's outputs from column n (n: the caller's)."""
    tail_rows, k = tail.shape
    chunks, runs, step = k // 8, k // 32, warps * TAIL_RUNS
    tail_words = np.ascontiguousarray(tail.astype(BF16)).view("<u4").reshape(tail_rows, chunks, 4)
    x_words = np.ascontiguousarray(x.astype(BF16)).view("<u4").reshape(rows, chunks, 4)
    x_row = np.minimum(G, rows - 1)
    stores: dict[int, float] = {}
    for tile in range(-(-tail_rows // 16)):
        row_a, row_b = np.minimum(16 * tile + G, tail_rows - 1), np.minimum(16 * tile + 8 + G, tail_rows - 1)
        partial = np.zeros((warps, 32, 4))
        for warp in range(warps):
            for batch, run in enumerate(range(warp, runs, step)):
                for u in range(TAIL_RUNS):
                    if run + warps * u >= runs:
                        continue
                    chunk = 4 * warp + T + 4 * step * batch + 4 * warps * u  # the kernel's pointer walk
                    pa, pb = tail_words[row_a, chunk], tail_words[row_b, chunk]  # [32, 4]: the A fragments as loaded
                    xv = x_words[x_row, T + 4 * (run + warps * u)]
                    part = mma_m16n8k16(partial[warp], [pa[:, 0], pb[:, 0], pa[:, 1], pb[:, 1]], [xv[:, 0], xv[:, 1]])
                    partial[warp] = mma_m16n8k16(part, [pa[:, 2], pb[:, 2], pa[:, 3], pb[:, 3]], [xv[:, 2], xv[:, 3]])
        total = partial.sum(axis=0)
        for b in range(rows):
            for r in range(16):
                if 16 * tile + r < tail_rows:
                    stores[(b, 16 * tile + r)] = total[4 * (r & 7) + (b >> 1), (r >> 3) * 2 + (b & 1)]
    return stores


@pytest.mark.parametrize(("n", "tail_rows", "k", "rows"), [
    (768, 8, 256, 1),  # the GPU tiny hybrid's [q|k|v|z] and [b|a]: one tail tile, half of it padding rows
    (64, 96, 640, 3),  # the 27B's 96 tail rows (6 tiles); 20 runs: batches that leave warps idle
    (32, 21, 1024, 8),  # a partial last tail tile; all 8 batch rows
])
@pytest.mark.parametrize("warps", quant_ops.WARPS)
def test_emulated_fused_launch_is_x_times_both_parts(n: int, tail_rows: int, k: int, rows: int, warps: int) -> None:
    rng = np.random.default_rng(n + tail_rows + k + rows)
    w = quantized(n + k, n, k, 4, 128)
    tail = rng.standard_normal((tail_rows, k)).astype(BF16).astype(np.float64)
    x = rng.standard_normal((rows, k)).astype(BF16).astype(np.float64)
    y_cols = n + tail_rows
    y = np.full(rows * y_cols, np.nan)
    y.reshape(rows, y_cols)[:, :n] = emulate_gemv(x, w, rows, warps=warps)  # the quantized tiles: b * y_cols + row
    for (b, row), value in emulate_tail(x, tail, rows, warps).items():
        index = b * y_cols + n + row  # the kernel's store: row n + 16 * tile + r of a y_cols-wide row
        assert np.isnan(y[index]), "two stores to one output"
        y[index] = value
    expected = x @ np.concatenate([dequantize(w, np.float64), tail]).T
    np.testing.assert_allclose(y.reshape(rows, y_cols), expected, rtol=1e-9, atol=1e-9 * np.abs(expected).max())
