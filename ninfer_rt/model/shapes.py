"""Named model shapes: the Hugging Face config fields of the dense models ninfer-rt is benchmarked and
replayed on. Benchmarks build random-weight models of these shapes on the GPU (ninfer_rt/kernel_benches.py,
tools/bench_decode.py); tools/make_shaped_model.py writes them as checkpoints for the replay."""

from __future__ import annotations

SHAPES: dict[str, dict[str, int]] = {
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=12288, vocab_size=151936),
    "qwen3-32b": dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
                      head_dim=128, intermediate_size=25600, vocab_size=151936),
}
