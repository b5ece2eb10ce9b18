"""`ninfer-rt quantize` streams: its peak memory does not grow with the checkpoint. The writer reads one
memory-mapped tensor at a time, quantizes it in row chunks, writes it into a shard whose header was planned
ahead, and releases the mapped pages; so quantizing 8 layers needs about the memory of quantizing 2: the
checkpoint grows by ~130 MB, the peak by about a tenth of that (a writer that held the
checkpoint, or a shard of it, would grow by all of it). Measured as the VmHWM of a fresh child process."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import bench_quantize_memory as bench  # noqa: E402 -- lives in tools/

MID_SIZE = {
    "hidden_size": 768, "intermediate_size": 4096, "vocab_size": 4096, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 128, "linear_num_key_heads": 2, "linear_num_value_heads": 6,
    "linear_key_head_dim": 64, "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4,
}


def quantized_peak(tmp_path: Path, layers: int) -> tuple[int, dict[str, int]]:
    cfg = bench.write_checkpoint(tmp_path / f"bf16-{layers}", layers, MID_SIZE)
    measured = bench.quantize_in_child(tmp_path / f"bf16-{layers}", tmp_path / f"int4-{layers}")
    return measured["peak_rss_bytes"], bench.tensor_sizes(cfg)


def test_peak_memory_does_not_grow_with_the_number_of_layers(tmp_path: Path) -> None:
    small_peak, small = quantized_peak(tmp_path, 2)
    large_peak, large = quantized_peak(tmp_path, 8)
    assert large["checkpoint_bytes"] - small["checkpoint_bytes"] > 10 * large["largest_tensor_bytes"]
    grown = large["checkpoint_bytes"] - small["checkpoint_bytes"]
    # a writer holding the input would grow by all of it, one holding the int4 output by over a quarter
    assert large_peak - small_peak < grown / 5, (large_peak - small_peak, grown)

