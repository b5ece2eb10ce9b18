"""The Gated DeltaNet layer's numpy math: against a float64 token-loop oracle, chunked against recurrent,
states at requested row counts, per-row states for speculative rollback, and prefill speed."""

from __future__ import annotations


import numpy as np
import pytest

from ninfer_rt.model.executor import LinearAttentionShape
from ninfer_rt.exec import numpy_delta_rule
from ninfer_rt.exec.numpy_delta_rule import (
    CHUNK,
    DeltaRuleInputs,
    chunked_gated_delta_rule,
    plan_chunks,
    recurrent_gated_delta_rule,
)
from ninfer_rt.exec.numpy_hybrid_norms import sigmoid, softplus
from ninfer_rt.exec.numpy_linear_attn import (
    LinearAttnState,
    causal_conv_silu,
    gating,
    linear_attention_mix,
    normalize_qk,
)
from linear_attn_refs import oracle_linear_attention, random_inputs, random_layer, random_state

SHAPE = LinearAttentionShape(
    num_key_heads=2, num_value_heads=6, key_head_dim=16, value_head_dim=8, conv_kernel=4, norm_eps=1e-6
)
LENGTHS = (1, 5, 63, 64, 65, 130, 200)


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-300))


def query_start(lengths: tuple[int, ...]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def rule_inputs(rng: np.random.Generator, rows: int) -> tuple[np.ndarray, ...]:
    """q, k, v, g, beta as the layer makes them: normalised q/k and gating over A in [0.01, 16]."""
    weights = random_layer(rng, SHAPE)
    _, _, b, a = random_inputs(rng, SHAPE, rows)
    q = rng.standard_normal((rows, SHAPE.num_key_heads, SHAPE.key_head_dim))
    k = rng.standard_normal((rows, SHAPE.num_key_heads, SHAPE.key_head_dim))
    q, k = normalize_qk(q, k)
    v = rng.standard_normal((rows, SHAPE.num_value_heads, SHAPE.value_head_dim))
    g, beta = gating(a, b, weights.a_log, weights.dt_bias)
    return q, k, v, g, beta


@pytest.mark.parametrize("lengths", [(3,), (1, 7, 2), (70,), (9, 66)])
def test_layer_matches_the_token_loop_oracle(lengths: tuple[int, ...]) -> None:
    rng = np.random.default_rng(sum(lengths))
    weights = random_layer(rng, SHAPE)
    qkv, z, b, a = random_inputs(rng, SHAPE, sum(lengths))
    state = random_state(rng, SHAPE, len(lengths))
    starts = query_start(lengths)
    got = linear_attention_mix(qkv, z, b, a, weights, SHAPE, starts, state)
    for seq in range(len(lengths)):
        rows = slice(starts[seq], starts[seq + 1])
        out, window, recurrent = oracle_linear_attention(
            qkv[rows], z[rows], b[rows], a[rows], weights, SHAPE, state.conv_windows[seq], state.recurrent[seq]
        )
        assert rel_err(got.out[rows], out) < 1e-12
        np.testing.assert_array_equal(got.state.conv_windows[seq], window)
        assert rel_err(got.state.recurrent[seq], recurrent) < 1e-12


@pytest.mark.parametrize("with_initial_state", [False, True])
def test_chunked_equals_recurrent_over_a_batch_of_lengths(with_initial_state: bool) -> None:
    rng = np.random.default_rng(7)
    starts = query_start(LENGTHS)
    q, k, v, g, beta = rule_inputs(rng, int(starts[-1]))
    shape = (len(LENGTHS), SHAPE.num_value_heads, SHAPE.key_head_dim, SHAPE.value_head_dim)
    initial = rng.standard_normal(shape) * 0.3 if with_initial_state else np.zeros(shape)
    recurrent = recurrent_gated_delta_rule(DeltaRuleInputs(q, k, v, g, beta, starts, initial))
    chunked = chunked_gated_delta_rule(DeltaRuleInputs(q, k, v, g, beta, starts, initial))
    for seq in range(len(LENGTHS)):
        rows = slice(starts[seq], starts[seq + 1])
        assert rel_err(chunked.out[rows], recurrent.out[rows]) < 1e-12, LENGTHS[seq]
        assert rel_err(chunked.final_states[seq], recurrent.final_states[seq]) < 1e-12, LENGTHS[seq]


def test_a_sequence_without_rows_keeps_its_state() -> None:
    rng = np.random.default_rng(8)
    starts = query_start((3, 0, 70))
    q, k, v, g, beta = rule_inputs(rng, int(starts[-1]))
    initial = rng.standard_normal((3, SHAPE.num_value_heads, SHAPE.key_head_dim, SHAPE.value_head_dim))
    for form in (recurrent_gated_delta_rule, chunked_gated_delta_rule):
        result = form(DeltaRuleInputs(q, k, v, g, beta, starts, initial))
        np.testing.assert_array_equal(result.final_states[1], initial[1])


@pytest.mark.parametrize("length", LENGTHS)
def test_chunked_equals_recurrent_for_one_sequence(length: int) -> None:
    rng = np.random.default_rng(length)
    q, k, v, g, beta = rule_inputs(rng, length)
    initial = rng.standard_normal((1, SHAPE.num_value_heads, SHAPE.key_head_dim, SHAPE.value_head_dim))
    starts = query_start((length,))
    recurrent = recurrent_gated_delta_rule(DeltaRuleInputs(q, k, v, g, beta, starts, initial))
    chunked = chunked_gated_delta_rule(DeltaRuleInputs(q, k, v, g, beta, starts, initial))
    assert rel_err(chunked.out, recurrent.out) < 1e-12
    assert rel_err(chunked.final_states, recurrent.final_states) < 1e-12


def test_float32_inputs_compute_in_float32_close_to_float64() -> None:
    rng = np.random.default_rng(3)
    q, k, v, g, beta = rule_inputs(rng, 130)
    starts = query_start((130,))
    initial = np.zeros((1, SHAPE.num_value_heads, SHAPE.key_head_dim, SHAPE.value_head_dim))
    exact = chunked_gated_delta_rule(DeltaRuleInputs(q, k, v, g, beta, starts, initial))
    single_rows = (x.astype(np.float32) for x in (q, k, v, g, beta))
    single = chunked_gated_delta_rule(DeltaRuleInputs(*single_rows, starts, initial))
    assert single.out.dtype == np.float32 and single.final_states.dtype == np.float32
    assert rel_err(single.out, exact.out) < 1e-4


def test_chunks_are_cut_at_requested_counts_and_the_64_grid() -> None:
    plan = plan_chunks(query_start((130, 10)), [[0, 100, 128], [3, 10]])
    assert plan.start.tolist() == [0, 64, 100, 128, 130, 133]
    assert plan.end.tolist() == [64, 100, 128, 130, 133, 140]
    assert plan.local.tolist() == [0, 1, 2, 3, 0, 1]
    assert plan.width == CHUNK


@pytest.mark.parametrize("form", [chunked_gated_delta_rule, recurrent_gated_delta_rule])
def test_states_at_requested_counts_are_the_states_of_the_prefixes(form) -> None:
    rng = np.random.default_rng(11)
    lengths, counts = (130, 77), [[0, 1, 37, 64, 100, 130, 37], [65, 76]]
    starts = query_start(lengths)
    q, k, v, g, beta = rule_inputs(rng, int(starts[-1]))
    initial = rng.standard_normal((2, SHAPE.num_value_heads, SHAPE.key_head_dim, SHAPE.value_head_dim)) * 0.3
    result = form(DeltaRuleInputs(q, k, v, g, beta, starts, initial), counts)
    for seq, wanted in enumerate(counts):
        assert result.saved_states[seq].shape[0] == len(wanted)
        for slot, n in enumerate(wanted):
            rows = slice(starts[seq], starts[seq] + n)
            prefix_rows = (x[rows] for x in (q, k, v, g, beta))
            prefix_inputs = DeltaRuleInputs(*prefix_rows, query_start((n,)), initial[seq : seq + 1])
            prefix = recurrent_gated_delta_rule(prefix_inputs)
            assert rel_err(result.saved_states[seq][slot], prefix.final_states[0]) < 1e-12, (seq, n)


def test_a_count_outside_the_sequence_is_refused() -> None:
    q, k, v, g, beta = rule_inputs(np.random.default_rng(0), 5)
    initial = np.zeros((1, SHAPE.num_value_heads, SHAPE.key_head_dim, SHAPE.value_head_dim))
    with pytest.raises(ValueError, match="outside 0..5"):
        chunked_gated_delta_rule(DeltaRuleInputs(q, k, v, g, beta, query_start((5,)), initial), [[6]])


def test_verification_states_after_each_row_equal_plain_decoding() -> None:
    """Verify k+1 = 5 rows after a 70-row prompt; the state after a rows equals decoding those a rows one by one."""
    rng = np.random.default_rng(5)
    weights = random_layer(rng, SHAPE)
    prompt = random_inputs(rng, SHAPE, 70)
    after_prompt = linear_attention_mix(*prompt, weights, SHAPE, query_start((70,)), LinearAttnState.fresh(SHAPE, 1))
    verify = random_inputs(rng, SHAPE, 5)
    verified = linear_attention_mix(
        *verify, weights, SHAPE, query_start((5,)), after_prompt.state, save_after=[range(6)]
    )
    state = after_prompt.state
    for accepted in range(6):
        saved = verified.saved[0]
        np.testing.assert_array_equal(saved.conv_windows[accepted], state.conv_windows[0])
        assert rel_err(saved.recurrent[accepted], state.recurrent[0]) < 1e-12
        if accepted < 5:
            row = tuple(x[accepted : accepted + 1] for x in verify)
            state = linear_attention_mix(*row, weights, SHAPE, query_start((1,)), state).state


def test_conv_windows_carry_a_sequence_across_calls() -> None:
    rng = np.random.default_rng(2)
    weight = rng.standard_normal((10, 4))
    rows = rng.standard_normal((17, 10))
    fresh = np.zeros((1, 3, 10))
    whole = causal_conv_silu(rows, weight, query_start((17,)), fresh)
    first = causal_conv_silu(rows[:6], weight, query_start((6,)), fresh)
    rest = causal_conv_silu(rows[6:], weight, query_start((11,)), first.windows)
    np.testing.assert_allclose(np.concatenate([first.out, rest.out]), whole.out, rtol=1e-14, atol=0)
    np.testing.assert_array_equal(rest.windows[0], rows[-3:])
    np.testing.assert_array_equal(whole.windows_after(0, [2])[0], np.concatenate([np.zeros((1, 10)), rows[:2]]))


def test_conv_of_a_batch_keeps_sequences_apart() -> None:
    rng = np.random.default_rng(4)
    weight = rng.standard_normal((6, 4))
    lengths = (1, 4, 0, 2)
    rows = rng.standard_normal((sum(lengths), 6))
    windows = rng.standard_normal((len(lengths), 3, 6))
    starts = query_start(lengths)
    batch = causal_conv_silu(rows, weight, starts, windows)
    for seq in range(len(lengths)):
        part = slice(starts[seq], starts[seq + 1])
        alone = causal_conv_silu(rows[part], weight, query_start((lengths[seq],)), windows[seq : seq + 1])
        np.testing.assert_array_equal(batch.out[part], alone.out)
        np.testing.assert_array_equal(batch.windows[seq], alone.windows[0])
    np.testing.assert_array_equal(batch.windows[2], windows[2])  # no rows: the window is unchanged


def test_gating_stays_finite_at_extreme_inputs() -> None:
    x = np.array([-1000.0, -30.0, 0.0, 19.0, 25.0, 1000.0])
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        plus, sig = softplus(x), sigmoid(x)
    np.testing.assert_allclose(plus[[2, 3, 4, 5]], [np.log(2.0), np.log1p(np.exp(19.0)), 25.0, 1000.0])
    assert plus[0] == 0.0 and sig[0] == 0.0 and sig[-1] == 1.0
    np.testing.assert_allclose(sig[1], np.exp(-30.0) / (1 + np.exp(-30.0)), rtol=1e-15)
    g, beta = gating(x[:, None], x[:, None], np.log(np.array([16.0])), np.zeros(1))
    assert np.all(np.isfinite(g)) and np.all(g <= 0) and g[-1, 0] == pytest.approx(-16000.0, rel=1e-15)


@pytest.mark.parametrize(
    ("lengths", "forbidden"),
    [((1, 4), "chunked_gated_delta_rule"), ((8,), "chunked_gated_delta_rule"), ((65,), "recurrent_gated_delta_rule")],
)
def test_decode_and_verification_run_recurrent_and_prefill_chunked(
    monkeypatch: pytest.MonkeyPatch, lengths: tuple[int, ...], forbidden: str
) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError(f"{forbidden} ran for sequences of {lengths} rows")

    monkeypatch.setattr(numpy_delta_rule, forbidden, refuse)
    rng = np.random.default_rng(0)
    inputs = random_inputs(rng, SHAPE, sum(lengths))
    state = random_state(rng, SHAPE, len(lengths))
    linear_attention_mix(*inputs, random_layer(rng, SHAPE), SHAPE, query_start(lengths), state)
