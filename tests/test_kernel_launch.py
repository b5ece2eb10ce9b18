"""Typed kernel launches and the op wrappers: bad arguments and default streams fail before any enqueue."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from cuda.bindings import driver as cu

from ninfer_rt.cuda import ops
from ninfer_rt.cuda.kernels import Arg, Kernel, KernelSpec
from ninfer_rt.cuda.memory import DeviceBuffer, PinnedBuffer, StagingRing
from ninfer_rt.cuda.streams import DefaultStreamError, StreamSet

DEFAULT_STREAMS = [None, 0, cu.CUstream(0), cu.CU_STREAM_LEGACY, cu.CU_STREAM_PER_THREAD]
DEFAULT_STREAM_IDS = ["None", "0", "CUstream(0)", "CU_STREAM_LEGACY", "CU_STREAM_PER_THREAD"]

SPEC = KernelSpec("test", "scale_kernel", (Arg.PTR, Arg.I32, Arg.I64, Arg.U32, Arg.F32))


@pytest.fixture
def streams() -> StreamSet:
    return StreamSet()  # logical: no device, declarations still checked


@pytest.fixture
def kernel() -> Kernel:
    return Kernel(SPEC, function=None)  # never reaches the driver in these tests


def device_address_buffer(streams: StreamSet, address: int) -> PinnedBuffer:
    """A buffer standing in for device memory at `address` (logical buffers have none)."""
    buffer = PinnedBuffer(streams, 64, "stand_in")
    buffer.ptr = address
    return buffer


@pytest.mark.parametrize("stream", DEFAULT_STREAMS, ids=DEFAULT_STREAM_IDS)
def test_launch_rejects_default_streams(kernel: Kernel, stream: object) -> None:
    with pytest.raises(DefaultStreamError):
        kernel.launch(stream, 1, 32, 0x1000, 1, 2, 3, 1.0)


def test_launch_on_a_logical_stream_is_refused_before_it_is_declared(streams: StreamSet, kernel: Kernel) -> None:
    stream = streams.create("compute")
    with pytest.raises(DefaultStreamError, match="logical"):
        kernel.launch(stream, 1, 32, 0x1000, 1, 2, 3, 1.0)
    assert stream.ring.seq == 0


def test_pack_gives_cuda_bindings_kernel_params(streams: StreamSet, kernel: Kernel) -> None:
    values, types = kernel.pack((device_address_buffer(streams, 0x7000), 7, -(2**40), 2**32 - 1, 0.5))
    assert values == (0x7000, 7, -(2**40), 2**32 - 1, 0.5)
    assert types == (ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_uint, ctypes.c_float)


def test_pack_accepts_numpy_scalars(kernel: Kernel) -> None:
    values, _ = kernel.pack((np.uint64(0x1000), np.int32(5), np.int64(6), np.uint32(7), np.float32(0.25)))
    assert values == (0x1000, 5, 6, 7, 0.25)


def test_float_for_a_pointer_is_a_type_error_naming_kernel_and_argument(streams: StreamSet, kernel: Kernel) -> None:
    stream = streams.create("compute")
    with pytest.raises(TypeError, match=r"scale_kernel, argument 0 \(PTR\).*float"):
        kernel.launch(stream, 1, 32, 1.5, 1, 2, 3, 1.0)
    assert stream.ring.seq == 0


@pytest.mark.parametrize(
    ("index", "bad"),
    [(1, 2.0), (1, True), (2, "3"), (3, None), (4, "1.0"), (4, False)],
    ids=["float-for-i32", "bool-for-i32", "str-for-i64", "none-for-u32", "str-for-f32", "bool-for-f32"],
)
def test_wrong_argument_kind_is_a_type_error_naming_the_argument(kernel: Kernel, index: int, bad: object) -> None:
    args = [0x1000, 1, 2, 3, 1.0]
    args[index] = bad
    with pytest.raises(TypeError, match=rf"scale_kernel, argument {index}"):
        kernel.pack(tuple(args))


@pytest.mark.parametrize("count", [4, 6])
def test_wrong_argument_count_is_a_type_error(kernel: Kernel, count: int) -> None:
    with pytest.raises(TypeError, match="scale_kernel takes 5 arguments"):
        kernel.pack(tuple([0x1000, 1, 2, 3, 1.0, 9][:count]))


@pytest.mark.parametrize(("index", "value"), [(1, 2**31), (3, -1), (0, -8)], ids=["i32-overflow", "negative-u32", "negative-ptr"])
def test_integer_out_of_range_is_rejected(kernel: Kernel, index: int, value: int) -> None:
    args = [0x1000, 1, 2, 3, 1.0]
    args[index] = value
    with pytest.raises(ValueError, match="out of range"):
        kernel.pack(tuple(args))


def test_buffer_without_device_address_is_rejected(streams: StreamSet, kernel: Kernel) -> None:
    logical = DeviceBuffer(streams, 64, "logical_x")
    with pytest.raises(TypeError, match="logical_x"):
        kernel.pack((logical, 1, 2, 3, 1.0))


@pytest.mark.parametrize(("grid", "block"), [(0, 32), ((1, 1, 1, 1), 32), (1, (32, -1)), (1.0, 32)])
def test_bad_launch_shape_is_rejected(streams: StreamSet, kernel: Kernel, grid: object, block: object) -> None:
    buffer = device_address_buffer(streams, 0x1000)
    with pytest.raises(ValueError, match="grid|block"):
        kernel.launch(streams.create("compute"), grid, block, buffer, 1, 2, 3, 1.0)


def test_too_much_dynamic_shared_memory_is_rejected(streams: StreamSet, kernel: Kernel) -> None:
    with pytest.raises(ValueError, match="shared memory"):
        kernel.launch(streams.create("compute"), 1, 32, 0x1000, 1, 2, 3, 1.0, smem=kernel.max_dynamic_smem + 1)


@pytest.mark.parametrize("stream", DEFAULT_STREAMS, ids=DEFAULT_STREAM_IDS)
def test_rmsnorm_wrapper_rejects_default_streams(streams: StreamSet, stream: object) -> None:
    x, w, out = (DeviceBuffer(streams, 64, name) for name in ("x", "w", "out"))
    with pytest.raises(DefaultStreamError):
        ops.rmsnorm(None, stream, x, w, out, rows=2, hidden=16, eps=1e-6)
    with pytest.raises(DefaultStreamError):
        ops.rmsnorm(None, stream, x, w, out, rows=2, hidden=16, eps=1e-6, residual=DeviceBuffer(streams, 64, "r"))


@pytest.mark.parametrize("stream", DEFAULT_STREAMS, ids=DEFAULT_STREAM_IDS)
def test_silu_mul_wrapper_rejects_default_streams(streams: StreamSet, stream: object) -> None:
    gate_up, out = DeviceBuffer(streams, 64, "gate_up"), DeviceBuffer(streams, 32, "out")
    with pytest.raises(DefaultStreamError):
        ops.silu_mul(None, stream, gate_up, out, rows=2, inter=8)


@pytest.mark.parametrize("stream", DEFAULT_STREAMS, ids=DEFAULT_STREAM_IDS)
def test_staging_publish_rejects_default_streams(streams: StreamSet, stream: object) -> None:
    ring = StagingRing(streams, slots=2, slot_bytes=64)
    dst = DeviceBuffer(streams, 64, "block_table")
    with pytest.raises(DefaultStreamError):
        ring.publish(stream, dst, np.arange(4, dtype=np.int32), label="publish block table")


def test_rmsnorm_wrapper_rejects_an_undersized_buffer(streams: StreamSet) -> None:
    x, w = DeviceBuffer(streams, 2 * 16 * 2, "x"), DeviceBuffer(streams, 16 * 2, "w")
    small_out = DeviceBuffer(streams, 16 * 2, "small_out")
    with pytest.raises(ValueError, match="out \\(small_out\\) holds 32 bytes, needs 64"):
        ops.rmsnorm(None, streams.create("compute"), x, w, small_out, rows=2, hidden=16, eps=1e-6)


def test_silu_mul_wrapper_rejects_an_undersized_gate_up(streams: StreamSet) -> None:
    gate_up, out = DeviceBuffer(streams, 2 * 8 * 2, "gate_up"), DeviceBuffer(streams, 2 * 8 * 2, "out")
    with pytest.raises(ValueError, match="gate_up"):
        ops.silu_mul(None, streams.create("compute"), gate_up, out, rows=2, inter=8)


@pytest.mark.parametrize("rows", [0, -1, 2.0])
def test_wrappers_reject_non_positive_sizes(streams: StreamSet, rows: object) -> None:
    x = DeviceBuffer(streams, 64, "x")
    with pytest.raises(ValueError, match="rows must be a positive integer"):
        ops.rmsnorm(None, streams.create("compute"), x, x, x, rows=rows, hidden=16, eps=1e-6)


def test_wrappers_take_buffers_not_raw_addresses(streams: StreamSet) -> None:
    out = DeviceBuffer(streams, 64, "out")
    with pytest.raises(TypeError, match="gate_up must be a Buffer"):
        ops.silu_mul(None, streams.create("compute"), 0x1000, out, rows=1, inter=8)
