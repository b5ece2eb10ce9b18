"""Named model shapes: the Hugging Face config fields of the models ninfer-rt is benchmarked and replayed
on. Benchmarks build random-weight models of these shapes on the GPU (ninfer_rt/kernel_dev/,
tools/bench_decode.py); tools/make_shaped_model.py writes them as checkpoints for the engine and server.

A hybrid shape (Qwen3.5/3.6: Gated DeltaNet + gated attention + MTP) carries `full_attention_interval`
(every 4th layer full attention, the rest linear) and the linear-attention sizes; `is_hybrid_shape` tells.
"""

from __future__ import annotations

from collections.abc import Mapping

Shape = dict[str, int | float]

HYBRID_MAX_POSITIONS = 262144  # the 27B's max_position_embeddings (tests/fixtures/qwen3_6_27b_config.json)

SHAPES: dict[str, Shape] = {
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=12288, vocab_size=151936),
    "qwen3-32b": dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
                      head_dim=128, intermediate_size=25600, vocab_size=151936),
    # tests/fixtures/qwen3_6_27b_config.json: 48 Gated DeltaNet + 16 gated attention layers, untied
    "qwen3.6-27b": dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4,
                        head_dim=256, intermediate_size=17408, vocab_size=248320, full_attention_interval=4,
                        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                        linear_value_head_dim=128, linear_conv_kernel_dim=4, partial_rotary_factor=0.25,
                        rope_theta=10_000_000.0, mtp_num_hidden_layers=1),
}


def is_hybrid_shape(shape: Mapping[str, int | float]) -> bool:
    return "full_attention_interval" in shape


def hybrid_text_config(shape: Mapping[str, int | float]) -> dict[str, object]:
    """The `qwen3_5_text` config.json fields of a hybrid shape (without token ids and positions)."""
    layers, interval = int(shape["num_hidden_layers"]), int(shape["full_attention_interval"])
    return {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
        **{key: value for key, value in shape.items() if key not in ("rope_theta", "partial_rotary_factor")},
        "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)],
        "rope_parameters": {"rope_type": "default", "rope_theta": shape["rope_theta"],
                            "partial_rotary_factor": shape["partial_rotary_factor"]},
        "attn_output_gate": True, "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "attention_bias": False, "torch_dtype": "bfloat16",
    }
