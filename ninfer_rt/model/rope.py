"""RoPE inverse frequencies and the cos/sin scaling, computed as transformers' ``ROPE_INIT_FUNCTIONS`` do.

The math follows ``_compute_default_rope_parameters`` and ``_compute_yarn_parameters`` step by step, in
float64 instead of torch float32, so the values agree with transformers to float32 rounding.
"""

from __future__ import annotations

import math

import numpy as np

from ninfer_rt.model.config import ModelConfig, RopeScaling


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequency of each rotated pair, float64 ``[rotary_dim // 2]`` (pair i rotates dims i and
    i + R/2 of the first R = rotary_dim dims; R = head_dim except with a partial_rotary_factor)."""
    pos_freqs = _base_frequencies(cfg.rope_theta, cfg.rotary_dim)
    if cfg.rope_scaling is None:
        return 1.0 / pos_freqs
    return _yarn_inv_freq(cfg.rope_scaling, pos_freqs, cfg.rope_theta, cfg.rotary_dim)


def rope_attention_scaling(cfg: ModelConfig) -> float:
    """Factor that cos and sin are multiplied by (YaRN's mscale; 1.0 for plain RoPE)."""
    if cfg.rope_scaling is None:
        return 1.0
    return _yarn_attention_factor(cfg.rope_scaling)


def _base_frequencies(base: float, dim: int) -> np.ndarray:
    return base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_attention_factor(scaling: RopeScaling) -> float:
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    # transformers tests truthiness here, so mscale=0 falls back to the plain formula as well
    if scaling.mscale and scaling.mscale_all_dim:
        return _yarn_mscale(scaling.factor, scaling.mscale) / _yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return _yarn_mscale(scaling.factor)


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, max_positions: int) -> float:
    """The dimension index whose wavelength completes ``num_rotations`` turns over ``max_positions``."""
    return (dim * math.log(max_positions / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def _yarn_correction_range(scaling: RopeScaling, dim: int, base: float) -> tuple[float, float]:
    max_positions = scaling.original_max_position_embeddings
    low = _yarn_correction_dim(scaling.beta_fast, dim, base, max_positions)
    high = _yarn_correction_dim(scaling.beta_slow, dim, base, max_positions)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _yarn_inv_freq(scaling: RopeScaling, pos_freqs: np.ndarray, base: float, dim: int) -> np.ndarray:
    low, high = _yarn_correction_range(scaling, dim, base)
    if low == high:
        high += 0.001  # same singularity guard as transformers
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation_weight = 1.0 - ramp
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (scaling.factor * pos_freqs)
    return inv_freq_interpolation * (1.0 - extrapolation_weight) + inv_freq_extrapolation * extrapolation_weight
