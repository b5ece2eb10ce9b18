"""The KV dtype: one typed value, owned by the KV spec (kv/cache.py's KVSpec) and passed through the Executor
protocol (model/executor.py) unopened by the model. It sits here, below kv/, because the protocol names it."""

from __future__ import annotations

import enum

import ml_dtypes
import numpy as np


class KVDtype(enum.Enum):
    """What the K/V pages hold: bf16 values, or int8 values with a float32 scale per (page, slot, kv head).
    F32 serves golden tests against float32 references only (the CUDA kernels read bf16 or int8)."""

    BF16 = "bf16"
    INT8 = "int8"
    F32 = "f32"

    @classmethod
    def parse(cls, text: str) -> KVDtype:
        """The dtype a flag or config names ('bf16', 'int8', 'f32')."""
        try:
            return cls(text)
        except ValueError:
            raise ValueError(f"kv dtype must be one of {[d.value for d in cls]}, got {text!r}") from None

    @property
    def element_dtype(self) -> np.dtype:
        return _ELEMENT_DTYPES[self]

    @property
    def itemsize(self) -> int:
        """Bytes per K or V element."""
        return self.element_dtype.itemsize

    @property
    def has_scales(self) -> bool:
        return self is KVDtype.INT8


_ELEMENT_DTYPES = {KVDtype.BF16: np.dtype(ml_dtypes.bfloat16), KVDtype.INT8: np.dtype(np.int8), KVDtype.F32: np.dtype(np.float32)}
