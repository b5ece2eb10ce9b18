"""The CUDA executor's weights: uploaded once through pinned staging, their roles kept for the ops.

Dense weights become bf16 device tensors; zero-centred norm gains are prepared as f32 1 + w and PARAMETER
weights (conv taps, A_log, dt_bias, the gated norm's gain) as f32, read at that precision by their kernels.
Groupwise-int weights keep their format on the device (QuantizedDeviceWeight), scale format included (bf16,
or a `.ninfer` artifact's fp16, uploaded as stored). Their codes travel as the checkpoint stores them, into a
device scratch, and quant_layout.cu rearranges them into the GPU layout there (numpy's rearrangement,
quantize.layouts.device_layout, is left to what the kernel cannot take: parts of different widths). A prefill
step wider than the decode GEMV dequantizes a weight into the same scratch, as bf16, for cuBLASLt; it is
sized for the largest before the KV cache (reserve_scratch), so it never grows once steps run.
A projection whose quantized parts are followed by dense ones (a quantized Gated DeltaNet's [q|k|v|z] rows,
then its in_proj_b / in_proj_a kept as stored) stays one weight, a SplitFormatWeight: the GEMV computes both
formats in one launch, the prefill GEMMs write their column ranges of one output (exec/cuda_linear.py).
Benchmarks may build weights on the device themselves and `adopt_weight` them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import ml_dtypes
import numpy as np

from ninfer_rt.cuda import quant_layout_ops, quant_ops
from ninfer_rt.cuda.attention_plan import rope_table
from ninfer_rt.cuda.kernels import KernelLibrary
from ninfer_rt.cuda.memory import DeviceBuffer, StagingRing
from ninfer_rt.cuda.quant_ops import DenseTail, QuantizedDeviceWeight
from ninfer_rt.cuda.streams import Stream, StreamSet
from ninfer_rt.exec.cuda_tensors import ITEMSIZE, DeviceTensor
from ninfer_rt.model.executor import WeightRole
from ninfer_rt.quantize.format import LAYOUT_OCTETS, LAYOUT_ROWS, Linear, QuantizedWeight
from ninfer_rt.quantize.layouts import check_fusable, concat_rows, octet_scales

BF16 = np.dtype(ml_dtypes.bfloat16)
F32_ROLES = (WeightRole.ZERO_CENTRED_NORM, WeightRole.PARAMETER)  # read at f32 by their kernels
UPLOAD_CHUNK_BYTES = 64 << 20


@dataclass(eq=False)
class SplitFormatWeight:
    """One projection [quantized rows; dense rows]: x @ W^T gives the quantized rows' outputs, then the dense
    rows' (bf16). The dense outputs start at column quantized.rows, kept a multiple of 8 so that they start on
    a 16-byte boundary of the output row (cuBLASLt's strided output)."""

    quantized: QuantizedDeviceWeight
    dense: DeviceTensor  # bf16 [dense rows, cols]

    def __post_init__(self) -> None:
        if self.dense.cols != self.quantized.cols or self.dense.dtype != "bf16":
            raise ValueError(
                f"a split-format weight needs bf16 dense rows of {self.quantized.cols} inputs, "
                f"not {self.dense.dtype} rows of {self.dense.cols}"
            )
        if self.quantized.rows % 8:
            raise ValueError(f"a split-format weight's {self.quantized.rows} quantized rows are not a multiple of 8")

    @property
    def buffer(self) -> DeviceBuffer:
        """The quantized codes: they name the weight (labels) and key its role, as for a quantized weight."""
        return self.quantized.buffer

    @property
    def rows(self) -> int:
        return self.quantized.rows + self.dense.rows

    @property
    def cols(self) -> int:
        return self.quantized.cols

    @property
    def tail(self) -> DenseTail:
        """The dense rows as the GEMV's tail."""
        return DenseTail(self.dense.buffer, self.dense.rows)


Weight = DeviceTensor | QuantizedDeviceWeight | SplitFormatWeight
W = TypeVar("W", DeviceTensor, QuantizedDeviceWeight, SplitFormatWeight)


class DeviceWeights:
    """A model's weights on one device, uploaded in the compute stream's order."""

    def __init__(self, streams: StreamSet, compute: Stream, library: KernelLibrary) -> None:
        self.streams = streams
        self.compute = compute
        self.library = library
        self.vocab = 0  # rows of the embedding table, for validating token ids
        self._roles: dict[DeviceBuffer, WeightRole] = {}  # by the buffer naming each prepared weight
        self._dequant_elements = 0  # of the largest quantized weight: the prefill's bf16 matrix
        self._scratch: DeviceBuffer | None = None
        self._upload_ring: StagingRing | None = None

    def role(self, weight: Weight) -> WeightRole | None:
        return self._roles.get(weight.buffer)

    def prepare(self, name: str, parts: Sequence[Linear], role: WeightRole) -> Weight:
        """The parts' rows as one weight: quantized parts first (stacked in the GPU layout), then dense ones."""
        quantized = list(itertools.takewhile(lambda part: isinstance(part, QuantizedWeight), parts))
        dense = parts[len(quantized) :]
        if any(isinstance(part, QuantizedWeight) for part in dense):
            raise ValueError(f"{name}: quantized rows after dense ones; a projection's dense parts must come last")
        if not quantized:
            return self._prepare_dense(name, dense, role)
        head = self._prepare_quantized(name, quantized, role)
        if not dense:
            return head
        return self.adopt(SplitFormatWeight(head, self._prepare_dense(f"{name}.dense", dense, role)), role)

    def _prepare_dense(self, name: str, parts: Sequence[np.ndarray], role: WeightRole) -> DeviceTensor:
        stacked = np.concatenate([np.atleast_2d(np.asarray(part)) for part in parts], axis=0)
        if role in F32_ROLES:
            # 1 + w in f32, never rounded to bf16 (it would lose the small w's precision)
            array = stacked.astype(np.float32) + (1.0 if role is WeightRole.ZERO_CENTRED_NORM else 0.0)
        else:
            array = stacked.astype(BF16)
        dtype = "f32" if role in F32_ROLES else "bf16"
        tensor = self.empty(name, *array.shape, dtype, role=role)
        self.upload(tensor.buffer, array, label=f"upload {name}")
        return tensor

    def rewrite(self, weight: DeviceTensor, parts: Sequence[np.ndarray]) -> None:
        """New values into the weight's own buffer: a fresh buffer would leak the old one (buffers are freed
        explicitly) and strand the graphs captured over its address."""
        array = np.concatenate([np.atleast_2d(np.asarray(part)) for part in parts], axis=0).astype(BF16)
        if array.shape != (weight.rows, weight.cols) or weight.dtype != "bf16":
            raise ValueError(f"rewrite_weight: {array.shape} values for a {weight.dtype} weight of {(weight.rows, weight.cols)}")
        self.upload(weight.buffer, array, label=f"rewrite {weight.buffer.name}")

    def _prepare_quantized(self, name: str, parts: Sequence[QuantizedWeight], role: WeightRole) -> QuantizedDeviceWeight:
        """The parts stacked along the rows, in the GPU layout: rearranged on the device when they share one
        width and come as the checkpoint stores them, else (or with no device: logical streams) on the host."""
        if len(parts) == 1 and parts[0].layout == LAYOUT_OCTETS:
            return self._upload_octets(name, parts[0], role)
        kernel_takes = len({part.bits for part in parts}) == 1 and all(part.layout == LAYOUT_ROWS for part in parts)
        if not kernel_takes or self.streams.logical:
            return self._upload_octets(name, concat_rows(parts), role)
        check_fusable(parts)
        bits, cols, rows = parts[0].bits, parts[0].shape[1], sum(part.shape[0] for part in parts)
        tensor = self._quantized_tensor(
            name, quant_layout_ops.octet_code_bytes(bits, rows, cols), octet_scales(np.concatenate([p.scales for p in parts])),
            rows, cols, parts[0],
        )
        staging = self._scratch_of(rows * cols * bits // 8)
        offset = 0
        for part in parts:
            self.upload(staging, part.qweight, label=f"upload {name} as stored", offset=offset)
            offset += part.qweight.nbytes
        quant_layout_ops.octets_from_rows(self.library, self.compute, staging, tensor.qweight, bits, rows, cols, label=f"octets {name}")
        return self.adopt(tensor, role)

    def _upload_octets(self, name: str, weight: QuantizedWeight, role: WeightRole) -> QuantizedDeviceWeight:
        tensor = self._quantized_tensor(name, weight.qweight.nbytes, weight.scales, *weight.shape, weight)
        self.upload(tensor.qweight, weight.qweight, label=f"upload {name}")
        return self.adopt(tensor, role)

    def _quantized_tensor(
        self, name: str, code_bytes: int, scales: np.ndarray, rows: int, cols: int, format_of: QuantizedWeight
    ) -> QuantizedDeviceWeight:
        """Device buffers for the codes (filled by the caller) and the scales (uploaded here, in the GPU layout)."""
        tensor = QuantizedDeviceWeight(
            DeviceBuffer(self.streams, code_bytes, f"w.{name}"), DeviceBuffer(self.streams, scales.nbytes, f"w.{name}.scales"),
            rows, cols, format_of.bits, format_of.group_size, format_of.scale_format,
        )
        self.upload(tensor.scales, scales, label=f"upload {name}.scales")
        return tensor

    def empty(self, name: str, rows: int, cols: int, dtype: str = "bf16", *, role: WeightRole) -> DeviceTensor:
        """An unpooled device tensor that lives as long as the model (benchmarks fill it on the device)."""
        return self.adopt(self.model_tensor(name, rows, cols, dtype), role)

    def adopt(self, weight: W, role: WeightRole) -> W:
        """Keep what the ops need to know of a weight's role (for weights made here, and for those a
        benchmark builds itself): an embedding's rows bound the token ids checked before every publish; a
        gate_up's decode GEMV is deferred into the SwiGLU that reads it."""
        self._roles[weight.buffer] = role
        if role is WeightRole.EMBEDDING:
            self.vocab = weight.rows
        quantized = weight.quantized if isinstance(weight, SplitFormatWeight) else weight
        if isinstance(quantized, QuantizedDeviceWeight):
            self._dequant_elements = max(self._dequant_elements, quantized.rows * quantized.cols)
        return weight

    def model_tensor(self, name: str, rows: int, cols: int, dtype: str) -> DeviceTensor:
        return DeviceTensor(DeviceBuffer(self.streams, rows * cols * ITEMSIZE[dtype], f"w.{name}"), rows, cols, dtype)

    def upload(self, buffer: DeviceBuffer, array: np.ndarray, *, label: str, offset: int = 0) -> None:
        """Host array -> device buffer (from byte `offset`) through pinned staging, in chunks, ordered on the
        compute stream."""
        raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        if self._upload_ring is None:
            # Two slots: the host fills one while the other's copy runs. publish() copies into the slot
            # before returning, so `array` may be dropped as soon as this returns.
            self._upload_ring = StagingRing(self.streams, 2, UPLOAD_CHUNK_BYTES, name="staging.weights")
        for start in range(0, raw.size, UPLOAD_CHUNK_BYTES):
            chunk = raw[start : start + UPLOAD_CHUNK_BYTES]
            self._upload_ring.publish(self.compute, buffer, chunk, offset + start, label=label)

    def rope(self, inv_freq: np.ndarray, attention_scaling: float, max_positions: int) -> DeviceTensor:
        """cos/sin table f32 [max_positions, 2, D/2], as rope_kv.cu reads it (row p: cos, then sin)."""
        table = rope_table(inv_freq, attention_scaling, max_positions)
        tensor = self.model_tensor("rope", max_positions, table.shape[1] * table.shape[2], "f32")
        self.upload(tensor.buffer, table, label="upload rope")
        return tensor

    def dequantized(self, weight: QuantizedDeviceWeight, label: str, lane: object) -> DeviceBuffer:
        """`weight` as bf16 in the scratch, for cuBLASLt. One scratch serves every layer: it is rewritten
        only by later ops of the same compute stream, ordered after the GEMM that read it."""
        scratch = self._scratch_of(self._dequant_elements * 2)
        quant_ops.dequantize(self.library, self.compute, weight, scratch, label=f"dequantize {label}", lane=lane)
        return scratch

    def reserve_scratch(self) -> None:
        """Size the scratch for the prefill's largest dequantized weight now, before the KV cache takes
        what is free, rather than at the first wide step."""
        if self._dequant_elements:
            self._scratch_of(self._dequant_elements * 2)

    def _scratch_of(self, nbytes: int) -> DeviceBuffer:
        """The weights' device scratch, at least `nbytes` long: it grows while weights load (and once in
        reserve_scratch), after the compute stream has finished every launch that read the smaller one."""
        if self._scratch is None or self._scratch.nbytes < nbytes:
            if self._scratch is not None:
                self.compute.synchronize()
                self._scratch.free()
            self._scratch = DeviceBuffer(self.streams, nbytes, "weights.scratch")
        return self._scratch
