"""The Gated DeltaNet families' benchmarks (kernels_src/gdn_conv.cu, gdn_delta_rule.cu, gdn_chunked_split.cu),
registered in benches.BENCHES and used by tools/bench_gdn.py.

A case is one sequence over a state-slot pool of LAYERS layers; launch i runs layer i % LAYERS, so a graph
of LAYERS launches touches distinct layer states as a real step does and the recurrent update streams its
state from HBM, not L2. The geometry is the shape's linear_* fields where it has them, else the
Qwen3.6-27B layer (16 key heads, 48 value heads of 128).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from ninfer_rt.cuda import gdn_split_plan
from ninfer_rt.cuda import linear_attn_ops as ops
from ninfer_rt.cuda.benchmark import BenchSession, Measurement
from ninfer_rt.cuda.linear_attn_ops import DeltaRuleArgs, GdnHeads, GdnStep, StateLayer
from ninfer_rt.kv.states import StateSpec

LAYERS = 48  # the 27B model's linear-attention layers
QWEN3_6_27B = GdnHeads(key_heads=16, value_heads=48, key_dim=128, value_dim=128, norm_eps=1e-6)
RECURRENT_CASES = ((1, 1), (4, 1), (4, 4))  # (rows, states kept): decode; a verify pass keeping one / every state
CHUNKED_ROWS = (531,)  # an agent turn's new tokens

Shape = dict[str, int]


def gdn_heads(shape: Shape) -> GdnHeads:
    if "linear_num_value_heads" not in shape:
        return QWEN3_6_27B
    return GdnHeads(
        shape["linear_num_key_heads"], shape["linear_num_value_heads"], shape["linear_key_head_dim"],
        shape["linear_value_head_dim"], 1e-6,
    )


def state_bytes(heads: GdnHeads) -> int:
    """One layer's recurrent state (f32 [Hv, dk, dv])."""
    return heads.value_heads * heads.key_dim * heads.value_dim * 4


class DeltaRuleCase:
    """One sequence of `rows` rows from slot 0, keeping `targets` states (slots 1.., the last one slot 0 in
    place), over random inputs."""

    def __init__(self, session: BenchSession, heads: GdnHeads, rows: int, targets: int) -> None:
        self.session, self.heads, self.rows = session, heads, rows
        spec = StateSpec(LAYERS, heads.key_heads, heads.value_heads, heads.key_dim, heads.value_dim)
        pool = session.filled(targets * spec.slot_bytes, "state slots")  # random bf16 bytes: finite as f32 too
        self.layers = [StateLayer(pool, spec.layer_offset(layer), spec.slot_bytes, spec.conv_bytes) for layer in range(LAYERS)]
        self.step = GdnStep(
            session.upload(np.array([0, rows], np.int32), "query_start"), session.upload(np.zeros(1, np.int32), "state_slots"),
            session.upload(np.array([[*range(1, targets), 0]], np.int32), "state_targets"), (rows,), targets,
        )
        self.x = session.filled(rows * heads.projection_stride * 2, "projection rows")
        self.conv = session.filled(rows * heads.conv_channels * 2, "conv out")
        self.conv_weight = session.upload(np.full((heads.conv_channels, ops.CONV_KERNEL), 0.25, np.float32), "conv weight")
        self.norm = session.upload(np.ones(heads.value_dim, np.float32), "norm")
        self.out = session.filled(rows * heads.value_size * 2, "out")
        a_log = np.log(np.linspace(1.0, 16.0, heads.value_heads)).astype(np.float32)
        self.args = DeltaRuleArgs(
            self.conv, self.x, session.upload(a_log, "A_log"), session.upload(np.zeros(heads.value_heads, np.float32), "dt_bias"),
            session.filled(rows * heads.value_size * 4, "o"),
        )

    def conv_silu(self) -> Callable[[int], None]:
        s = self.session
        return lambda i: ops.conv_silu(s.lib, s.stream, self.step, self.heads, self.x, self.conv_weight, self.conv, self.layers[i % LAYERS])

    def delta_rule(self, columns: int, split: bool = False, passes: tuple[str, ...] = ops.SPLIT_PASSES) -> Callable[[int], None]:
        """The delta rule; `split`: the chunked form's passes (`columns` per carry block) over a workspace."""
        s, workspace = self.session, self.split_workspace if split else None
        return lambda i: ops.delta_rule(
            s.lib, s.stream, self.step, self.heads, self.args, self.layers[i % LAYERS], columns, workspace, passes
        )

    @functools.cached_property
    def split_workspace(self) -> ops.SplitWorkspace:
        """Made once per case: a pass timed alone runs over what the whole form left there."""
        h, step = self.heads, self.step
        chunks = gdn_split_plan.chunk_bases(step.query_lens, step.num_targets)[-1]
        shape = gdn_split_plan.SplitWorkspace(self.rows, chunks, h.key_heads, h.value_heads, h.key_dim, h.value_dim)
        return ops.SplitWorkspace(*(self.session.filled(n, f"split {name}") for name, n in shape.sizes().items()))

    def gated_norm(self) -> Callable[[int], None]:
        s = self.session
        return lambda _: ops.gated_norm(s.lib, s.stream, self.heads, self.args.out, self.x, self.norm, self.out, self.rows)

    def layer(self) -> Callable[[int], None]:
        """The whole decode op of a layer: conv + SiLU, the delta rule, the gated norm."""
        parts = (self.conv_silu(), self.delta_rule(ops.RECURRENT_COLUMNS), self.gated_norm())
        return lambda i: [part(i) for part in parts]

    def conv_bytes(self) -> int:
        """The conv's projection columns read, its output written, one window read and written."""
        heads = self.heads
        return self.rows * heads.conv_channels * 4 + 2 * heads.conv_channels * (ops.CONV_KERNEL - 1) * 2


def bench_gdn_conv(s: BenchSession, shape: Shape) -> list[Measurement]:
    heads, results = gdn_heads(shape), []
    for rows in (1, 4096):
        case = DeltaRuleCase(s, heads, rows, 1)
        results.append(Measurement(ops.CONV_SILU.name, f"rows={rows}", s.time(case.conv_silu(), LAYERS), case.conv_bytes()))
        s.release()
    return results


def bench_gdn_delta_rule(s: BenchSession, shape: Shape) -> list[Measurement]:
    """The recurrent cases (bytes: the states read and written), the chunked prefill (bytes: one state in,
    one out) with the device's column group, and the gated norm of a decode row."""
    heads, results = gdn_heads(shape), []
    for rows, targets in RECURRENT_CASES:
        case = DeltaRuleCase(s, heads, rows, targets)
        seconds = s.time(case.delta_rule(ops.RECURRENT_COLUMNS), LAYERS)
        results.append(Measurement(ops.recurrent_spec(heads.key_dim).name, f"rows={rows} kept={targets}", seconds, (1 + targets) * state_bytes(heads)))
        if rows == 1:
            seconds = s.time(case.gated_norm())
            results.append(Measurement(ops.GATED_NORM.name, "rows=1", seconds, heads.value_size * (4 + 2 + 2)))
        s.release()
    columns = ops.chunk_columns(heads.key_dim, heads.value_dim, s.device.max_shared_memory_per_block_optin)
    for rows in CHUNKED_ROWS:
        case = DeltaRuleCase(s, heads, rows, 1)
        seconds = s.time(case.delta_rule(columns), LAYERS)
        results.append(Measurement(ops.chunked_spec(heads.key_dim, columns).name, f"rows={rows}", seconds, 2 * state_bytes(heads)))
        s.release()
    return results


def bench_gdn_chunked_split(s: BenchSession, shape: Shape) -> list[Measurement]:
    """The chunked prefill split in three passes: whole (bytes: one state in, one out) and each pass alone."""
    heads, results = gdn_heads(shape), []
    specs = ops.split_specs(heads.key_dim, ops.SPLIT_CARRY_COLUMNS)
    for rows in CHUNKED_ROWS:
        case = DeltaRuleCase(s, heads, rows, 1)
        seconds = s.time(case.delta_rule(ops.SPLIT_CARRY_COLUMNS, split=True), LAYERS)
        results.append(Measurement("gdn_split (three passes)", f"rows={rows}", seconds, 2 * state_bytes(heads)))
        for spec, name in zip(specs, ops.SPLIT_PASSES):
            seconds = s.time(case.delta_rule(ops.SPLIT_CARRY_COLUMNS, split=True, passes=(name,)), LAYERS)
            results.append(Measurement(spec.name, f"rows={rows}", seconds, 2 * state_bytes(heads)))
        s.release()
    return results
