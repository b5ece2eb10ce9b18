"""A stand-in for the Gated DeltaNet kernels over real state slots, for the state-cache tests.

The "model" keeps, per linear layer, a recurrent state that is a running hash of the token prefix (exact in
fp32) and a conv window holding the last kernel - 1 tokens (exact in bf16). A pass is a logical-stream op
that declares what a real verify/prefill kernel declares (StateRing.pass_reads / pass_writes) and writes
the state after each saved token, so a test can compare any slot with the state of decoding its prefix
plainly (`expected_state`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ninfer_rt.cuda.streams import Stream
from ninfer_rt.kv.states import StateSlotPool, StateSpec
from ninfer_rt.kv.states_verify import StateRing

TINY_SPEC = StateSpec(num_layers=2, key_heads=1, value_heads=2, key_head_dim=2, value_head_dim=2, conv_kernel=3)
_MODULUS = 65521  # running hash stays below 2**24: exact in fp32


def _step(value: float, window: np.ndarray, token: int) -> tuple[float, np.ndarray]:
    return (value * 31 + token + 1) % _MODULUS, np.concatenate([window[1:], [token]])


def expected_state(spec: StateSpec, tokens: Sequence[int]) -> list[tuple[float, np.ndarray]]:
    """Per layer: (recurrent value, conv window tokens) after decoding `tokens` from the empty state."""
    states = []
    for layer in range(spec.num_layers):
        value, window = float(layer), np.zeros(spec.conv_kernel - 1)
        for token in tokens:
            value, window = _step(value, window, token)
        states.append((value, window))
    return states


def read_state(pool: StateSlotPool, slot: int) -> list[tuple[float, np.ndarray]]:
    out = []
    for layer in range(pool.spec.num_layers):
        recurrent = pool.recurrent(slot, layer)
        assert np.all(recurrent == recurrent.flat[0]), "a state is one value across the recurrent tensor"
        out.append((float(recurrent.flat[0]), pool.conv_window(slot, layer)[0].astype(np.float64)))
    return out


def same_state(a: list[tuple[float, np.ndarray]], b: list[tuple[float, np.ndarray]]) -> bool:
    return all(va == vb and np.array_equal(wa, wb) for (va, wa), (vb, wb) in zip(a, b, strict=True))


def start_empty(ring: StateRing, stream: Stream) -> None:
    """Position 0: zero state, then the per-layer seed the hash starts from."""
    pool = ring.pool
    pool.zero(ring.live_slot, stream, lane=ring.lane)
    stream.host_op(lambda: _write(pool, ring.live_slot, [(float(layer), np.zeros(pool.spec.conv_kernel - 1)) for layer in range(pool.spec.num_layers)]),
                   label="state seed", writes=[pool.resource(ring.live_slot)], lane=ring.lane)


def run_pass(ring: StateRing, stream: Stream, tokens: Sequence[int], saved: int = 1, label: str = "state pass") -> list[int]:
    """Advance the live state over `tokens`, saving the states after the last `saved` of them."""
    targets = ring.begin(stream, saved)
    pool = ring.pool

    def compute() -> None:
        states = read_state(pool, targets[-1])  # the live slot, read before any target is written
        for index, token in enumerate(tokens):
            states = [_step(value, window, token) for value, window in states]
            keep = index - (len(tokens) - saved)
            if keep >= 0:
                _write(pool, targets[keep], states)

    stream.host_op(compute, label=label, reads=ring.pass_reads(), writes=ring.pass_writes(targets), lane=ring.lane)
    ring.end(targets)
    return targets


def _write(pool: StateSlotPool, slot: int, states: list[tuple[float, np.ndarray]]) -> None:
    for layer, (value, window) in enumerate(states):
        pool.recurrent(slot, layer)[...] = value
        pool.conv_window(slot, layer)[...] = window[None, :]
