"""Groupwise int4/int8 weights (ninfer_rt/quantize/): the absmax grid's error bound, the scale search never
losing to it, GPTQ's codes with and without input correlations, the packed layout, and GPTQ / AWQ checkpoints built here from known integers, which must load to exactly the weights those
integers define."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from ninfer_rt.model.weights import WeightsError, load_model_weights
from ninfer_rt.quantize import quantizer
from ninfer_rt.quantize.format import QuantFormatError, QuantizedWeight, pack, unpack
from ninfer_rt.quantize.gptq_awq import AWQ_ORDER
from ninfer_rt.quantize.layouts import concat_rows, dequantize
from ninfer_rt.quantize.quantizer import CLIP_RATIOS, absmax_scales, gptq_codes, quantize, search_scales
from ninfer_rt.quantize.scheme import scheme_from_config
from ninfer_rt.testing.tiny import make_tiny_model

BF16 = np.dtype(ml_dtypes.bfloat16)
TINY = dict(hidden=128, heads=4, kv_heads=2, head_dim=64, intermediate=256, vocab=512, layers=1)
GROUP = 128


def weights_with_outliers(seed: int, out: int = 48, in_features: int = 256) -> np.ndarray:
    """Gaussian rows of magnitudes over three decades, with a few large weights as trained models have."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((out, in_features)) * rng.uniform(0.001, 2.0, (out, 1))
    w[rng.random(w.shape) < 0.01] *= 6.0
    return w.astype(np.float32)


def group_errors(w: np.ndarray, scales: np.ndarray, bits: int, importance: np.ndarray | None = None) -> np.ndarray:
    """Each group's (importance-weighted) squared error when rounding to nearest with ``scales``."""
    group = w.shape[1] // scales.shape[1]
    half = 1 << (bits - 1)
    step = np.repeat(scales.astype(np.float64), group, axis=1)
    q = np.clip(np.rint(w / np.where(step != 0, step, 1.0)), -half, half - 1)
    weighted = (w - q * step) ** 2 * (1.0 if importance is None else importance)
    return weighted.reshape(w.shape[0], -1, group).sum(axis=-1)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 128])
def test_absmax_grid_error_is_at_most_half_a_step_everywhere(bits: int, group_size: int) -> None:
    w = weights_with_outliers(bits + group_size)
    w[3, :group_size] = 0.0  # an all-zero group: scale 0, and its weights stay exactly 0
    grouped = w.reshape(w.shape[0], -1, group_size)
    scales = absmax_scales(grouped, bits)
    step = np.repeat(scales.astype(np.float64), group_size, axis=1)
    half = 1 << (bits - 1)
    q = np.clip(np.rint(w / np.where(step != 0, step, 1.0)), -half, half - 1)
    assert np.all(np.abs(q * step - w) <= step / 2 + 1e-12 * np.abs(w))
    assert scales[3, 0] == 0


@pytest.mark.parametrize("bits", [4, 8])
def test_absmax_grid_is_absmax_over_half_levels_minus_a_half(bits: int) -> None:
    """GPTQ's symmetric grid: the largest magnitude lands at +-(2^(bits-1) - 0.5) steps, so the top code
    2^(bits-1) - 1 is used (absmax / 7 would leave one int4 level unused)."""
    half = 1 << (bits - 1)
    scales = absmax_scales(np.linspace(-1.0, 1.0, 128, dtype=np.float32).reshape(1, 1, 128), bits).astype(np.float64)
    assert np.all(scales >= 1.0 / (half - 0.5))  # rounded up to bf16
    assert np.all(scales < 1.0 / (half - 0.5) * (1 + 2**-7))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("weighted", [False, True])
def test_searched_scales_never_increase_a_groups_error_over_absmax(bits: int, weighted: bool) -> None:
    w = weights_with_outliers(bits)
    importance = np.random.default_rng(1).uniform(0.01, 10.0, 256).astype(np.float32) if weighted else None
    grouped = w.reshape(48, 2, 128)
    searched = search_scales(grouped, bits, None if importance is None else importance.reshape(1, 2, 128))
    assert searched.dtype == BF16 and searched.shape == (48, 2)
    plain, found = group_errors(w, absmax_scales(grouped, bits), bits, importance), group_errors(w, searched, bits, importance)
    assert np.all(found <= plain)


def test_int4_scale_search_cuts_the_squared_error_of_gaussian_weights_by_a_fifth() -> None:
    w = np.random.default_rng(0).standard_normal((256, 512)).astype(np.float32)
    grouped = w.reshape(256, 4, 128)
    plain = group_errors(w, absmax_scales(grouped, 4), 4).sum()
    assert group_errors(w, search_scales(grouped, 4), 4).sum() < 0.8 * plain


def whole_matrix_search(grouped: np.ndarray, bits: int, importance: np.ndarray | None) -> np.ndarray:
    """search_scales as first written: every candidate over the whole matrix at once, plain expressions."""
    half = 1 << (bits - 1)
    weights = np.ones((1, 1, 1), np.float32) if importance is None else importance

    def codes(scales: np.ndarray) -> np.ndarray:
        return np.clip(np.rint(grouped / np.where(scales != 0, scales, 1.0)[..., None]), -half, half - 1)

    def error(scales: np.ndarray) -> np.ndarray:
        residual = grouped - codes(scales) * scales[..., None]
        return (weights * residual * residual).sum(axis=-1)

    best = absmax_scales(grouped, bits).astype(np.float32)
    best_error = error(best)
    top = np.abs(grouped).max(axis=-1) / (half - 1)
    for candidate in (*(sign * clip * top for clip in CLIP_RATIOS for sign in (1.0, -1.0)), None, None):
        if candidate is None:
            q = codes(best)
            num, den = (weights * grouped * q).sum(axis=-1), (weights * q * q).sum(axis=-1)
            candidate = np.where(den > 0, num / np.where(den > 0, den, 1.0), best)
        candidate = candidate.astype(BF16).astype(np.float32)
        e = error(candidate)
        best, best_error = np.where(e < best_error, candidate, best), np.where(e < best_error, e, best_error)
    return best.astype(BF16)


@pytest.mark.parametrize(("bits", "group", "weighted"), [(4, 128, False), (4, 32, True), (8, 64, False), (8, 256, True)])
@pytest.mark.parametrize("threads", ["1", "3"])
def test_blocked_threaded_search_is_bit_identical_to_the_whole_matrix_search(
    bits: int, group: int, weighted: bool, threads: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """search_scales works on cache-sized row blocks on several threads with in-place operations: the same
    float32 values, so `ninfer-rt quantize` writes the same checkpoint whatever the machine."""
    rng = np.random.default_rng(bits + group)
    w = weights_with_outliers(group, out=700, in_features=512)
    w[5, :group] = 0.0  # an all-zero group: scale 0
    grouped = w.reshape(700, -1, group)
    importance = rng.uniform(0.0, 3.0, (1, 512 // group, group)).astype(np.float32) if weighted else None
    monkeypatch.setenv("NINFER_QUANT_THREADS", threads)
    monkeypatch.setattr(quantizer, "SEARCH_BLOCK_VALUES", 1 << 14)  # many blocks, a short last one
    np.testing.assert_array_equal(
        search_scales(grouped, bits, importance).view(np.uint16), whole_matrix_search(grouped, bits, importance).view(np.uint16)
    )


def test_a_positive_extreme_may_flip_the_grid_to_reach_code_minus_8() -> None:
    """W = (u - 8) * scale holds 8 steps on one side: a negative scale puts that side on a positive extreme."""
    w = np.full((1, 32), 0.5, np.float32)
    w[0, 0] = 4.0  # 4.0 = -8 * -0.5 and 0.5 = -1 * -0.5: exact on the flipped grid, not on +-4/7.5 steps
    qw = quantize(w, 4, 32)
    assert qw.scales.astype(np.float32)[0, 0] == -0.5
    np.testing.assert_array_equal(dequantize(qw), w)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_stores_codes_nearest_to_each_weight_on_its_searched_grid(bits: int) -> None:
    w = weights_with_outliers(bits)
    w[3, :128] = 0.0
    qw = quantize(w, bits, 128)
    assert qw.scales.shape == (48, 2) and qw.qweight.shape == (48, 256 * bits // 8)
    np.testing.assert_array_equal(qw.scales, search_scales(w.reshape(48, 2, 128), bits))
    expected = group_errors(w, qw.scales, bits).sum()
    assert np.isclose(((dequantize(qw, np.float64) - w) ** 2).sum(), expected, rtol=1e-6)
    assert np.all(dequantize(qw)[3, :128] == 0.0)


def test_gptq_with_uncorrelated_inputs_rounds_to_nearest() -> None:
    """A diagonal Hessian couples no inputs: there is nothing to compensate, so GPTQ is plain rounding."""
    w = weights_with_outliers(5).astype(np.float64)
    scales = search_scales(w.reshape(48, 2, 128).astype(np.float32), 4)
    codes = gptq_codes(w, scales, np.diag(np.random.default_rng(2).uniform(0.5, 2.0, 256)), 4)
    step = np.repeat(scales.astype(np.float64), 128, axis=1)
    np.testing.assert_array_equal(codes, np.clip(np.rint(w / step), -8, 7))


def test_calibrated_quantization_cuts_the_output_error_on_correlated_inputs() -> None:
    rng = np.random.default_rng(3)
    mixing = rng.standard_normal((256, 256)) * 0.3 + np.eye(256)  # correlated channels, as activations are
    x = rng.standard_normal((4096, 256)) @ mixing * rng.uniform(0.1, 3.0, 256)
    w = weights_with_outliers(4)
    hessian = x.T @ x / len(x)

    def output_error(qw: QuantizedWeight) -> float:
        return float(np.linalg.norm(x @ (dequantize(qw, np.float64) - w).T))

    weight_only, calibrated = quantize(w, 4, 128), quantize(w, 4, 128, hessian)
    assert calibrated.qweight.shape == weight_only.qweight.shape and calibrated.scales.dtype == BF16
    assert output_error(calibrated) < 0.8 * output_error(weight_only)


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_unpack_round_trip(bits: int) -> None:
    codes = np.random.default_rng(bits).integers(0, 1 << bits, (5, 64)).astype(np.uint8)
    packed = pack(codes, bits)
    assert packed.shape == (5, 64 * bits // 8) and packed.dtype == np.uint8
    np.testing.assert_array_equal(unpack(packed, bits), codes)


def test_int4_byte_holds_the_even_input_in_its_low_nibble() -> None:
    codes = np.array([[0x1, 0x2, 0x3, 0x4]], np.uint8)
    np.testing.assert_array_equal(pack(codes, 4), [[0x21, 0x43]])


def test_fused_rows_of_different_widths_widen_exactly_to_int8() -> None:
    rng = np.random.default_rng(0)
    a, b = quantize(rng.standard_normal((4, 128)), 4, GROUP), quantize(rng.standard_normal((6, 128)), 8, GROUP)
    fused = concat_rows([a, b])
    assert fused.bits == 8 and fused.shape == (10, 128)
    np.testing.assert_array_equal(dequantize(fused), np.concatenate([dequantize(a), dequantize(b)]))


# -- GPTQ / AWQ from known integers -----------------------------------------------------------------------


def known_weight(rng: np.random.Generator, out: int, in_features: int) -> tuple[np.ndarray, np.ndarray]:
    """(codes uint8 [in, out] in 0..15, scales [in/GROUP, out] exact in fp16 and bf16)."""
    codes = rng.integers(0, 16, (in_features, out)).astype(np.uint8)
    scales = rng.integers(1, 256, (in_features // GROUP, out)) * 2.0**-14  # 8-bit mantissas, fp16-normal
    return codes, scales


def pack_int32_along_rows(values: np.ndarray) -> np.ndarray:
    """GPTQ's qweight packing (AutoGPTQ's pack loop): word [r, c] holds rows 8r..8r+7, row 8r+p in bits 4p."""
    packed = np.zeros((values.shape[0] // 8, values.shape[1]), np.uint32)
    for p in range(8):
        packed |= values[p::8].astype(np.uint32) << (4 * p)
    return packed.view(np.int32)


def pack_int32_along_columns(values: np.ndarray, order: tuple[int, ...] = tuple(range(8))) -> np.ndarray:
    """Word [r, c] holds columns 8c..8c+7: nibble i holds column 8c + order[i] (GPTQ qzeros: identity;
    AWQ: AWQ_ORDER, as AutoAWQ's WQLinear_GEMM.from_linear packs)."""
    packed = np.zeros((values.shape[0], values.shape[1] // 8), np.uint32)
    for i, column in enumerate(order):
        packed |= values[:, column::8].astype(np.uint32) << (4 * i)
    return packed.view(np.int32)


LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def imported_checkpoint(tmp_path: Path, method: str, config: dict, zeros_of: callable) -> tuple[Path, dict[str, np.ndarray]]:
    """A tiny model whose linear weights are stored as GPTQ or AWQ tensors of known integers; returns the
    directory and the float64 weights [out, in] those integers define, W = scale * (q - zero)."""
    model_dir = make_tiny_model(tmp_path / method, **TINY)
    raw = json.loads((model_dir / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": GROUP, **config}
    (model_dir / "config.json").write_text(json.dumps(raw))
    from safetensors.numpy import load_file

    tensors = load_file(str(model_dir / "model.safetensors"))
    rng = np.random.default_rng(7)
    expected: dict[str, np.ndarray] = {}
    for module in LINEARS:
        name = f"model.layers.0.{module}"
        out, in_features = tensors.pop(f"{name}.weight").shape
        codes, scales = known_weight(rng, out, in_features)
        zeros = zeros_of(rng, in_features // GROUP, out)
        expected[f"{name}.weight"] = (
            (codes.astype(np.float64) - np.repeat(zeros, GROUP, axis=0)) * np.repeat(scales, GROUP, axis=0)
        ).T
        tensors.update(stored_tensors(method, name, codes, zeros, scales, config))
    save_file(tensors, str(model_dir / "model.safetensors"))
    return model_dir, expected


def stored_tensors(method: str, name: str, codes: np.ndarray, zeros: np.ndarray, scales: np.ndarray, config: dict) -> dict:
    if method == "gptq":
        stored_zeros = zeros - (0 if config.get("checkpoint_format") == "gptq_v2" else 1)
        return {
            f"{name}.qweight": pack_int32_along_rows(codes),
            f"{name}.qzeros": pack_int32_along_columns(stored_zeros),
            f"{name}.scales": scales.astype(np.float16),
            f"{name}.g_idx": (np.arange(codes.shape[0]) // GROUP).astype(np.int32),
        }
    return {
        f"{name}.qweight": pack_int32_along_columns(codes, AWQ_ORDER),
        f"{name}.qzeros": pack_int32_along_columns(zeros, AWQ_ORDER),
        f"{name}.scales": scales.astype(np.float16),
    }


def symmetric_zeros(rng: np.random.Generator, groups: int, out: int) -> np.ndarray:
    return np.full((groups, out), 8)


def asymmetric_zeros(rng: np.random.Generator, groups: int, out: int) -> np.ndarray:
    return rng.integers(0, 16, (groups, out))


def assert_loads_to(model_dir: Path, expected: dict[str, np.ndarray], bits: int) -> None:
    layer = load_model_weights(model_dir).layers[0]
    for name, weight in expected.items():
        loaded = getattr(layer, name.split(".")[-2])
        assert isinstance(loaded, QuantizedWeight) and loaded.bits == bits
        np.testing.assert_array_equal(dequantize(loaded, np.float64), weight)


@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
def test_gptq_loads_to_the_weights_its_integers_define(tmp_path: Path, checkpoint_format: str) -> None:
    config = {"sym": True, "desc_act": False, "checkpoint_format": checkpoint_format}
    model_dir, expected = imported_checkpoint(tmp_path, "gptq", config, symmetric_zeros)
    assert_loads_to(model_dir, expected, bits=4)


def test_awq_with_zero_points_8_loads_as_int4(tmp_path: Path) -> None:
    model_dir, expected = imported_checkpoint(tmp_path, "awq", {"version": "gemm", "zero_point": True}, symmetric_zeros)
    assert_loads_to(model_dir, expected, bits=4)


def test_awq_with_arbitrary_zero_points_loads_exactly_as_int8(tmp_path: Path) -> None:
    model_dir, expected = imported_checkpoint(tmp_path, "awq", {"version": "gemm", "zero_point": True}, asymmetric_zeros)
    assert_loads_to(model_dir, expected, bits=8)


def test_gptq_and_awq_of_the_same_integers_load_to_the_same_weights(tmp_path: Path) -> None:
    gptq_dir, gptq_expected = imported_checkpoint(tmp_path, "gptq", {"sym": True}, symmetric_zeros)
    awq_dir, awq_expected = imported_checkpoint(tmp_path, "awq", {"version": "gemm"}, symmetric_zeros)
    assert all(np.array_equal(gptq_expected[n], awq_expected[n]) for n in gptq_expected)  # same seed: same integers
    gptq, awq = load_model_weights(gptq_dir).layers[0], load_model_weights(awq_dir).layers[0]
    for module in LINEARS:
        attr = module.split(".")[-1]
        np.testing.assert_array_equal(dequantize(getattr(gptq, attr)), dequantize(getattr(awq, attr)))


def test_gptq_with_asymmetric_zero_points_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    model_dir, _ = imported_checkpoint(tmp_path, "gptq", {"sym": True}, asymmetric_zeros)
    with pytest.raises(WeightsError, match=r"q_proj: GPTQ zero points are not all 8"):
        load_model_weights(model_dir)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "act-order"),
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits=8"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": False}, "asymmetric"),
        ({"quant_method": "gptq", "bits": 4, "group_size": -1}, "group size -1"),
        ({"quant_method": "awq", "bits": 3, "group_size": 128}, "bits=3"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "GEMM"),
        ({"quant_method": "fp8"}, "not supported"),
    ],
)
def test_unsupported_variants_are_refused_with_a_clear_message(config: dict, message: str) -> None:
    with pytest.raises(QuantFormatError, match=message):
        scheme_from_config(config)


def test_refusal_surfaces_as_a_weights_error_when_loading(tmp_path: Path) -> None:
    model_dir, _ = imported_checkpoint(tmp_path, "gptq", {"sym": True, "desc_act": True}, symmetric_zeros)
    with pytest.raises(WeightsError, match="act-order"):
        load_model_weights(model_dir)
