"""linear_attn_ops' constants are the Gated DeltaNet kernels' own: each is read from kernels_src/gdn_*.cu (the
`constexpr int`s, the instantiated kernels, the chunked kernels' shared-memory formulas), so a kernel change
that is not mirrored in the launch wrappers fails here, on the CPU."""

from __future__ import annotations

import itertools
import re

import pytest

from kernel_source import KERNELS, constexpr_int

from ninfer_rt.cuda import linear_attn_ops as ops
from ninfer_rt.exec import numpy_delta_rule

# (source file, constexpr name, the Python constant it must equal)
MIRRORED = [
    ("gdn_conv.cu", "kConvThreads", ops.CONV_THREADS),
    ("gdn_delta_rule_common.cuh", "kRecurrentMaxRows", ops.RECURRENT_MAX_ROWS),
    ("gdn_delta_rule_common.cuh", "kRecurrentMaxRows", numpy_delta_rule.RECURRENT_MAX_ROWS),
    ("gdn_delta_rule.cu", "kRecurrentThreads", ops.RECURRENT_THREADS),
    ("gdn_delta_rule.cu", "kRecurrentColumns", ops.RECURRENT_COLUMNS),
    ("gdn_delta_rule_common.cuh", "kChunk", ops.CHUNK),
    ("gdn_delta_rule_common.cuh", "kChunk", numpy_delta_rule.CHUNK),
    ("gdn_delta_rule.cu", "kChunkThreads", ops.CHUNK_THREADS),
    ("gdn_split_common.cuh", "kSplitThreads", ops.SPLIT_THREADS),
    ("gdn_split_common.cuh", "kOutputColumns", ops.SPLIT_OUTPUT_COLUMNS),
]


@pytest.mark.parametrize(("source", "name", "value"), MIRRORED, ids=[f"{s}:{n}" for s, n, _ in MIRRORED])
def test_python_constant_equals_the_kernel_constexpr(source: str, name: str, value: int) -> None:
    assert constexpr_int(source, name) == value


def test_the_instantiated_delta_rule_kernels_are_the_ones_the_wrappers_name() -> None:
    text = (KERNELS / "gdn_delta_rule.cu").read_text()
    recurrent = {int(d) for d in re.findall(r"^RECURRENT_KERNEL\((\d+)\)", text, flags=re.MULTILINE)}
    chunked = {(int(d), int(c)) for d, c in re.findall(r"^CHUNKED_KERNEL\((\d+), (\d+)\)", text, flags=re.MULTILINE)}
    assert recurrent == set(ops.KEY_DIMS)
    assert chunked == set(itertools.product(ops.KEY_DIMS, ops.CHUNK_COLUMN_GROUPS))


def test_the_conv_kernel_is_the_instantiated_width() -> None:
    text = (KERNELS / "gdn_conv.cu").read_text()
    assert re.search(rf"__launch_bounds__\(kConvThreads\) {ops.CONV_SILU.name}\(", text)
    assert re.search(rf"conv_silu<{ops.CONV_KERNEL}>\(", text)
    assert ops.CONV_SILU.name.endswith(f"_k{ops.CONV_KERNEL}")
    assert ops.CONV_ROWS_PER_SPLIT >= ops.CONV_KERNEL - 1  # a split's rows cover the window it reads


def test_the_gated_norm_block_size_is_the_kernels() -> None:
    text = (KERNELS / "gdn_delta_rule.cu").read_text()
    bounds = re.findall(rf"__launch_bounds__\((\d+)\) {ops.GATED_NORM.name}\(", text)
    assert [int(b) for b in bounds] == [ops.GATED_NORM_THREADS]


def test_every_column_group_divides_the_value_dim_multiple() -> None:
    groups = (*ops.CHUNK_COLUMN_GROUPS, ops.RECURRENT_COLUMNS)
    assert all(ops.VALUE_DIM_MULTIPLE % columns == 0 for columns in groups)


def chunk_smem_floats(key_dim: int, columns: int) -> int:
    """gdn_delta_rule.cu's ChunkSmem<DK, CV>::kFloats, evaluated from the kernel's own expressions."""
    text = (KERNELS / "gdn_delta_rule.cu").read_text()
    names = {"kChunk": constexpr_int("gdn_delta_rule_common.cuh", "kChunk"), "DK": key_dim, "CV": columns}
    for name in ("kRowStride", "kQRegion", "kFloats"):
        (expression,) = re.findall(rf"static constexpr int {name} = (.+);", text)
        ternary = re.fullmatch(r"(.+) \? (.+) : (.+)", expression)
        if ternary:  # C's `c ? a : b`, as Python reads it
            expression = f"({ternary[2]}) if ({ternary[1]}) else ({ternary[3]})"
        names[name] = eval(expression, {}, dict(names))  # noqa: S307 - integer arithmetic from our own source
    return names["kFloats"]


@pytest.mark.parametrize(("key_dim", "columns"), list(itertools.product(ops.KEY_DIMS, ops.CHUNK_COLUMN_GROUPS)))
def test_chunked_shared_memory_is_the_kernels(key_dim: int, columns: int) -> None:
    assert ops.chunked_smem_bytes(key_dim, columns) == 4 * chunk_smem_floats(key_dim, columns)


def test_the_instantiated_split_kernels_are_the_ones_the_wrappers_name() -> None:
    text = (KERNELS / "gdn_chunked_split.cu").read_text()
    per_chunk = {int(d) for d in re.findall(r"^SPLIT_KERNELS\((\d+)\)", text, flags=re.MULTILINE)}
    carry = {(int(d), int(c)) for d, c in re.findall(r"^CARRY_KERNEL\((\d+), (\d+)\)", text, flags=re.MULTILINE)}
    assert per_chunk == set(ops.KEY_DIMS)
    assert ops.SPLIT_CARRY_COLUMNS in ops.CHUNK_COLUMN_GROUPS
    assert carry == set(itertools.product(ops.KEY_DIMS, ops.CHUNK_COLUMN_GROUPS))


@pytest.mark.parametrize(("key_dim", "columns"), list(itertools.product(ops.KEY_DIMS, ops.CHUNK_COLUMN_GROUPS)))
def test_split_shared_memory_is_the_kernels(key_dim: int, columns: int) -> None:
    """Each pass's `static constexpr int kFloats = ...;`, read from gdn_chunked_split.cu and evaluated at (dk, cv)."""
    text = (KERNELS / "gdn_chunked_split.cu").read_text() + (KERNELS / "gdn_split_common.cuh").read_text()
    (padding,) = re.findall(r"constexpr int operand_stride\(int columns\) \{\s*return columns \+ (\d+);", text)
    (plane_padding,) = re.findall(r"constexpr int plane_stride\(int depth\) \{\s*return depth \+ (\d+);", text)
    names = {"DK": key_dim, "CV": columns, "kChunk": ops.CHUNK, "kOutputStride": ops.SPLIT_OUTPUT_COLUMNS + int(padding),
             "kStride": columns + int(padding), "kKeyStride": key_dim + int(padding),
             "kKeyPlane": key_dim + int(plane_padding), "kRowPlane": ops.CHUNK + int(plane_padding),
             "kValuePlane": ops.SPLIT_OUTPUT_COLUMNS + int(plane_padding), "kOutputColumns": ops.SPLIT_OUTPUT_COLUMNS,
             "plane_stride": lambda depth: depth + int(plane_padding)}
    floats = []
    for struct in ("TermsSmem", "CarrySmem", "OutputSmem"):
        (expression,) = re.findall(rf"struct {struct} {{[^}}]*?static constexpr int kFloats =\s*([^;]+);", text)
        floats.append(eval(" ".join(expression.split()), {}, dict(names)))  # noqa: S307 - integer arithmetic from our own source
    assert ops.split_smem_bytes(key_dim, columns) == tuple(4 * n for n in floats)
