"""Paged K/V storage for every layer (and the MTP layer).

Layout per layer (DESIGN.md): K and V are [num_pages, page_size, n_kv_heads, head_dim], bf16 or int8;
int8 pages carry a float32 scale per (page, slot, kv_head): symmetric, absmax / 127, quantized after
k-norm and RoPE. Page ids are shared by all layers, so one page id is one verifier resource: ("kv", id).
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ninfer_rt.cuda.memory import DeviceBuffer
from ninfer_rt.cuda.streams import StreamSet

KV_DTYPES = ("bf16", "int8", "f32")  # f32: golden tests against float32 references only
_ELEMENT_DTYPES = {"bf16": np.dtype(ml_dtypes.bfloat16), "int8": np.dtype(np.int8), "f32": np.dtype(np.float32)}


def page_resource(page: int) -> tuple[str, int]:
    return ("kv", int(page))


@dataclass(frozen=True)
class KVSpec:
    num_layers: int  # main layers + MTP layers: the MTP layer is index num_layers
    num_pages: int
    n_kv_heads: int
    head_dim: int
    dtype: str = "bf16"
    page_size: int = 64

    def __post_init__(self) -> None:
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"kv dtype must be one of {KV_DTYPES}, got {self.dtype!r}")

    @property
    def element_dtype(self) -> np.dtype:
        return _ELEMENT_DTYPES[self.dtype]

    @property
    def page_shape(self) -> tuple[int, int, int]:
        return (self.page_size, self.n_kv_heads, self.head_dim)

    def bytes_per_page_per_layer(self) -> int:
        values = 2 * self.page_size * self.n_kv_heads * self.head_dim * self.element_dtype.itemsize
        scales = 2 * self.page_size * self.n_kv_heads * 4 if self.dtype == "int8" else 0
        return values + scales


@dataclass
class KVLayer:
    """One layer's pages. Scales are None for bf16."""

    k: DeviceBuffer
    v: DeviceBuffer
    k_scale: DeviceBuffer | None
    v_scale: DeviceBuffer | None


class KVCache:
    """The K/V buffers of all layers, allocated once at start-up."""

    def __init__(self, streams: StreamSet, spec: KVSpec) -> None:
        self.spec = spec
        shape = (spec.num_pages, *spec.page_shape)
        values = int(np.prod(shape)) * spec.element_dtype.itemsize
        scales = spec.num_pages * spec.page_size * spec.n_kv_heads * 4
        self.layers = [
            KVLayer(
                k=DeviceBuffer(streams, values, f"k[{i}]"),
                v=DeviceBuffer(streams, values, f"v[{i}]"),
                k_scale=DeviceBuffer(streams, scales, f"k_scale[{i}]") if spec.dtype == "int8" else None,
                v_scale=DeviceBuffer(streams, scales, f"v_scale[{i}]") if spec.dtype == "int8" else None,
            )
            for i in range(spec.num_layers)
        ]

    def free(self) -> None:
        for layer in self.layers:
            for buf in (layer.k, layer.v, layer.k_scale, layer.v_scale):
                if buf is not None:
                    buf.free()
