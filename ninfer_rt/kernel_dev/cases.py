"""What every kernel family's benchmark shares: the step shapes the model launches at and the model dimensions
the cases are built from.

A bench function takes a `BenchSession` and a shape (ninfer_rt.model.shapes) and returns one `Measurement` per case
(median seconds per launch, the unique bytes a launch moves and its flops), timed by
`ninfer_rt.cuda.benchmark` (graph-replayed, inputs the model reads from HBM rotated past the L2).
`ninfer-rt kernels bench` and tools/bench_{kernels,attention,gdn}.py print them.
"""

from __future__ import annotations

from collections.abc import Callable

from ninfer_rt.cuda.benchmark import BenchSession, Measurement
from ninfer_rt.cuda.linear_ops import Epilogue
from ninfer_rt.model.executor import AttentionShape

DECODE_ROWS = (1, 8)  # batch-1 decode and the widest speculative verify step
PREFILL_TOKENS = 4096  # one prefill chunk
EPS = 1e-6
BF16, F32, I32 = 2, 4, 4

Shape = dict[str, int]
BenchFunction = Callable[[BenchSession, Shape], list[Measurement]]


def gemv_shapes(shape: Shape) -> dict[str, tuple[int, int, Epilogue]]:
    """label -> (n, k, epilogue) of a decoder layer's projections and the lm_head; n is the output width
    (SwiGLU reads 2n weight rows)."""
    h, i, d = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    return {
        "qkv": (q + 2 * kv, h, Epilogue.STORE),
        "o_proj": (h, q, Epilogue.STORE),
        "gate_up+swiglu": (i, h, Epilogue.SWIGLU),
        "down": (h, i, Epilogue.STORE),
        "lm_head(f32)": (shape["vocab_size"], h, Epilogue.STORE_F32),
    }


def attention_shape(shape: Shape) -> AttentionShape:
    return AttentionShape(shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"], EPS)


def row_cases() -> list[tuple[str, int]]:
    return [*((f"rows={r}", r) for r in DECODE_ROWS), (f"rows={PREFILL_TOKENS}", PREFILL_TOKENS)]
