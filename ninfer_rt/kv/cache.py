"""Paged K/V storage for every layer (and the MTP layer).

Layout per layer (docs/ARCHITECTURE.md, "KV pages"): K and V are [num_pages, page_size, n_kv_heads, head_dim],
bf16 or int8; int8 pages carry a float32 scale per (page, slot, kv_head): symmetric, absmax / 127, quantized
after k-norm and RoPE. Page ids are shared by all layers, so one page id is one verifier resource: ("kv", id).

`write_tokens` / `read_tokens` are the host (numpy) path of the K/V write and the paged gather; they do
not declare anything themselves because they run inside the executor's attention op, which declares the
pages it reads and writes. `copy_page` is stream work of its own (the copy-on-write of a tail page) and
declares the two pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ninfer_rt.cuda.memory import DeviceBuffer
from ninfer_rt.cuda.streams import Stream, StreamSet
from ninfer_rt.model.kv_dtype import KVDtype


def page_resource(page: int) -> tuple[str, int]:
    return ("kv", int(page))


def quantize_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[tokens, heads, head_dim] float -> (int8 values, float32 scale [tokens, heads]); symmetric absmax/127."""
    absmax = np.abs(x.astype(np.float32)).max(axis=-1)
    scale = np.where(absmax > 0, absmax / 127.0, 1.0).astype(np.float32)  # an all-zero row stays exact
    values = np.clip(np.rint(x / scale[..., None]), -127, 127).astype(np.int8)
    return values, scale


def dequantize_int8(values: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return values.astype(np.float32) * scale[..., None]


@dataclass(frozen=True)
class KVSpec:
    num_layers: int  # main layers + MTP layers: the MTP layer is index num_layers
    num_pages: int
    n_kv_heads: int
    head_dim: int
    dtype: KVDtype = KVDtype.BF16
    page_size: int = 64

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, KVDtype):
            raise TypeError(f"KVSpec.dtype is a KVDtype (KVDtype.parse reads a flag's text), got {self.dtype!r}")

    @property
    def element_dtype(self) -> np.dtype:
        return self.dtype.element_dtype

    @property
    def page_shape(self) -> tuple[int, int, int]:
        return (self.page_size, self.n_kv_heads, self.head_dim)

    def bytes_per_page_per_layer(self) -> int:
        values = 2 * self.page_size * self.n_kv_heads * self.head_dim * self.dtype.itemsize
        scales = 2 * self.page_size * self.n_kv_heads * 4 if self.dtype.has_scales else 0
        return values + scales


@dataclass
class KVLayer:
    """One layer's pages. Scales are None for bf16."""

    k: DeviceBuffer
    v: DeviceBuffer
    k_scale: DeviceBuffer | None
    v_scale: DeviceBuffer | None

    def buffers(self) -> list[DeviceBuffer]:
        return [b for b in (self.k, self.v, self.k_scale, self.v_scale) if b is not None]


class KVCache:
    """The K/V buffers of all layers, allocated once at start-up."""

    def __init__(self, streams: StreamSet, spec: KVSpec) -> None:
        self.spec = spec
        shape = (spec.num_pages, *spec.page_shape)
        values = int(np.prod(shape)) * spec.dtype.itemsize
        scales = spec.num_pages * spec.page_size * spec.n_kv_heads * 4
        scaled = spec.dtype.has_scales
        self.layers = [
            KVLayer(
                k=DeviceBuffer(streams, values, f"k[{i}]"),
                v=DeviceBuffer(streams, values, f"v[{i}]"),
                k_scale=DeviceBuffer(streams, scales, f"k_scale[{i}]") if scaled else None,
                v_scale=DeviceBuffer(streams, scales, f"v_scale[{i}]") if scaled else None,
            )
            for i in range(spec.num_layers)
        ]

    def page_resource(self, page: int) -> tuple[str, int]:
        """What an op on page `page` of every layer declares."""
        return page_resource(page)

    def copy_page(self, src: int, dst: int, stream: Stream, *, lane: object = None) -> None:
        """Enqueue on `stream` the copy of page `src` into page `dst` for every layer (values and scales)."""
        reads, writes = (page_resource(src),), (page_resource(dst),)
        for index, layer in enumerate(self.layers):
            for buf in layer.buffers():
                page_bytes = buf.nbytes // self.spec.num_pages
                stream.copy(
                    buf, buf, page_bytes, dst * page_bytes, src * page_bytes,
                    label=f"kv copy page {src}->{dst} ({buf.name})", lane=lane, reads=reads, writes=writes,
                )

    def write_tokens(self, layer: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Host path: store K/V [tokens, n_kv_heads, head_dim] (after k-norm and RoPE) at `slots`."""
        pages, offsets = np.divmod(np.asarray(slots, np.int64), self.spec.page_size)
        kv = self.layers[layer]
        for values, buf, scale_buf in ((k, kv.k, kv.k_scale), (v, kv.v, kv.v_scale)):
            if scale_buf is None:
                self._values(buf)[pages, offsets] = values.astype(self.spec.element_dtype)
            else:
                quantized, scale = quantize_int8(values)
                self._values(buf)[pages, offsets] = quantized
                self._scales(scale_buf)[pages, offsets] = scale

    def read_tokens(self, layer: int, pages: list[int], num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """Host path: the first `num_tokens` K and V of a block table, float32 [tokens, n_kv_heads, head_dim]."""
        kv = self.layers[layer]
        index = np.asarray(pages, np.int64)
        return tuple(  # type: ignore[return-value]
            self._gather(buf, scale_buf, index, num_tokens) for buf, scale_buf in ((kv.k, kv.k_scale), (kv.v, kv.v_scale))
        )

    def _gather(self, buf: DeviceBuffer, scale_buf: DeviceBuffer | None, pages: np.ndarray, num_tokens: int) -> np.ndarray:
        values = self._values(buf)[pages].reshape(-1, self.spec.n_kv_heads, self.spec.head_dim)[:num_tokens]
        if scale_buf is None:
            return values.astype(np.float32)
        scales = self._scales(scale_buf)[pages].reshape(-1, self.spec.n_kv_heads)[:num_tokens]
        return dequantize_int8(values, scales)

    def _values(self, buf: DeviceBuffer) -> np.ndarray:
        return buf.view(self.spec.element_dtype, (self.spec.num_pages, *self.spec.page_shape))

    def _scales(self, buf: DeviceBuffer) -> np.ndarray:
        return buf.view(np.dtype(np.float32), (self.spec.num_pages, self.spec.page_size, self.spec.n_kv_heads))

    def free(self) -> None:
        for layer in self.layers:
            for buf in layer.buffers():
                buf.free()
