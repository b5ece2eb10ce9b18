"""The CUDA executor's linear dispatch (exec/cuda_linear.py) on the CPU, through a recording library: the GEMV
up to 8 rows, cuBLASLt above, and for quantized weights NINFER_QUANT_GEMM's form, `dequant` (the default:
the scratch matrix, then cuBLASLt) or `fused` (gemm_quant, no scratch); a split-format weight (quantized rows,
then bf16 rows) in one GEMV launch, or two GEMMs into the column ranges of one output."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from ninfer_rt.cuda.blas import GemmShape
from ninfer_rt.cuda.memory import DeviceBuffer
from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.exec.cuda_linear import QUANT_GEMM_ENV, LinearOps, quant_gemm_from_env
from ninfer_rt.exec.cuda_tensors import DeviceTensor
from ninfer_rt.exec.cuda_weights import SplitFormatWeight
from test_attention_compile import RecordingLibrary
from test_gemm_quant_compile import weight


@dataclass
class RecordingBlas:
    gemms: list[tuple[object, object]] = field(default_factory=list)  # (weight buffer, shape)
    outs: list[object] = field(default_factory=list)

    def gemm(self, stream: object, x: object, w: object, out: object, shape: object, *, label: str, lane: object) -> None:
        self.gemms.append((w, shape))
        self.outs.append(out)


@dataclass
class RecordingWeights:
    scratch: DeviceBuffer
    dequantized_weights: list[object] = field(default_factory=list)

    def dequantized(self, weight: object, label: str, lane: object) -> DeviceBuffer:
        self.dequantized_weights.append(weight)
        return self.scratch


def run(form: str, rows: int, quantized: bool = True, out_dtype: str = "bf16") -> tuple[RecordingLibrary, RecordingBlas, RecordingWeights]:
    streams, lib, blas = StreamSet(verify=False), RecordingLibrary(), RecordingBlas()
    weights = RecordingWeights(DeviceBuffer(streams, 304 * 512 * 2, "dequant_scratch"))
    ops = LinearOps(lib, streams.create("compute"), blas, weights, form)  # type: ignore[arg-type]
    w = weight(streams, rows=304) if quantized else DeviceTensor(DeviceBuffer(streams, 304 * 512 * 2, "w.dense"), 304, 512)
    x = DeviceTensor(DeviceBuffer(streams, rows * 512 * 2, "x"), rows, 512)
    out = DeviceTensor(DeviceBuffer(streams, rows * w.rows * 4, "out"), rows, w.rows, out_dtype)
    ops.matmul(x, w, out, None)
    return lib, blas, weights


def test_the_form_comes_from_the_environment_and_defaults_to_dequant(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(QUANT_GEMM_ENV, raising=False)
    assert quant_gemm_from_env() == "dequant"
    monkeypatch.setenv(QUANT_GEMM_ENV, "fused")
    assert quant_gemm_from_env() == "fused"
    monkeypatch.setenv(QUANT_GEMM_ENV, "wgmma")
    with pytest.raises(ValueError, match="NINFER_QUANT_GEMM='wgmma'"):
        quant_gemm_from_env()
    with pytest.raises(ValueError, match="quant_gemm='cutlass'"):
        LinearOps(None, None, None, None, "cutlass")  # type: ignore[arg-type]


def test_dequant_widens_the_weight_into_the_scratch_for_cublaslt() -> None:
    lib, blas, weights = run("dequant", 45)
    assert not lib.launches and len(weights.dequantized_weights) == 1
    [(w, shape)] = blas.gemms
    assert w is weights.scratch and (shape.m, shape.n, shape.k, shape.out_dtype) == (45, 304, 512, "bf16")


@pytest.mark.parametrize(("rows", "out_dtype", "kernel", "epilogue"), [
    (45, "bf16", "gemm_int4_t64", 0), (9, "f32", "gemm_int4_t32", 3),
])
def test_fused_launches_the_quantized_gemm_and_makes_no_scratch(rows: int, out_dtype: str, kernel: str, epilogue: int) -> None:
    lib, blas, weights = run("fused", rows, out_dtype=out_dtype)
    [launch] = lib.launches
    assert launch.name == kernel and launch.args[5] == rows and launch.args[-2:] == (epilogue, 304)  # y rows 304 apart
    assert not blas.gemms and not weights.dequantized_weights


@pytest.mark.parametrize("form", ["dequant", "fused"])
def test_decode_widths_take_the_gemv_and_dense_weights_cublaslt_in_either_form(form: str) -> None:
    lib, blas, _ = run(form, 8)
    assert [launch.name for launch in lib.launches] == ["gemv_int4_b8_w16"] and not blas.gemms
    lib, blas, weights = run(form, 45, quantized=False)
    assert not lib.launches and len(blas.gemms) == 1 and not weights.dequantized_weights


def run_split(form: str, rows: int) -> tuple[RecordingLibrary, RecordingBlas, RecordingWeights, DeviceTensor]:
    """A quantized Gated DeltaNet projection's shape at the GPU tiny hybrid: [q|k|v|z] 768 rows int4, [b|a] 8 bf16."""
    streams, lib, blas = StreamSet(verify=False), RecordingLibrary(), RecordingBlas()
    weights = RecordingWeights(DeviceBuffer(streams, 768 * 512 * 2, "dequant_scratch"))
    ops = LinearOps(lib, streams.create("compute"), blas, weights, form)  # type: ignore[arg-type]
    w = SplitFormatWeight(weight(streams, rows=768), DeviceTensor(DeviceBuffer(streams, 8 * 512 * 2, "w.dense"), 8, 512))
    x = DeviceTensor(DeviceBuffer(streams, rows * 512 * 2, "x"), rows, 512)
    out = DeviceTensor(DeviceBuffer(streams, rows * 776 * 2, "out"), rows, 776)
    ops.matmul(x, w, out, None)
    return lib, blas, weights, out


@pytest.mark.parametrize("form", ["dequant", "fused"])
@pytest.mark.parametrize("rows", [1, 4, 8])
def test_a_split_format_weight_is_one_gemv_launch_at_decode_widths(form: str, rows: int) -> None:
    lib, blas, _, _ = run_split(form, rows)
    [launch] = lib.launches
    assert launch.name.startswith("gemv_int4_b") and launch.grid == 48 + 1  # 48 quantized tiles, one tail tile
    assert launch.args[-1] == 8 and launch.args[-2].name == "w.dense" and not blas.gemms


def test_a_split_format_weight_above_the_gemv_fills_its_column_ranges_dequant() -> None:
    lib, blas, weights, out = run_split("dequant", 45)
    assert not lib.launches and len(weights.dequantized_weights) == 1
    [(quantized, head), (dense, tail)] = blas.gemms
    assert quantized is weights.scratch and (head.m, head.n, head.k, head.ldc) == (45, 768, 512, 776)
    assert dense.name == "w.dense" and (tail.m, tail.n, tail.k, tail.ldc) == (45, 8, 512, 776)
    head_out, tail_out = blas.outs
    assert head_out is out.buffer and tail_out.resource is out.buffer.resource
    assert tail_out.nbytes == out.buffer.nbytes - 768 * 2  # the view starts at column 768


def test_a_split_format_weight_above_the_gemv_fills_its_column_ranges_fused() -> None:
    lib, blas, weights, out = run_split("fused", 45)
    [launch] = lib.launches
    assert launch.name == "gemm_int4_t64" and launch.args[0] is out.buffer and launch.args[-1] == 776
    [(dense, tail)] = blas.gemms
    assert dense.name == "w.dense" and (tail.n, tail.ldc) == (8, 776) and not weights.dequantized_weights


def test_a_strided_gemm_output_spans_to_its_last_rows_columns() -> None:
    shape = GemmShape(45, 8, 512, out_stride=776)
    assert shape.ldc == 776 and shape.out_bytes == (44 * 776 + 8) * 2
    assert GemmShape(45, 8, 512).ldc == 8 and GemmShape(45, 8, 512).out_bytes == 45 * 8 * 2
    with pytest.raises(ValueError, match="multiples of 8"):
        GemmShape(45, 8, 512, out_stride=780)
    with pytest.raises(ValueError, match="cannot hold"):
        GemmShape(45, 16, 512, out_stride=8)
