"""`ninfer-rt quantize`: a bf16 checkpoint -> the project's groupwise int4/int8 checkpoint (quantize_checkpoint/writer.py).

With --calibration-text, windows of that text run through the numpy executor first; each linear layer's
mean x x^T (over its inputs) then weights the scale search and drives GPTQ's choice of codes
(quantize_checkpoint/calibration.py, quantize/quantizer.py).
"""

from __future__ import annotations

from pathlib import Path

import click

from ninfer_rt.cli.errors import BadUsage, OneLineErrors
from ninfer_rt.quantize_checkpoint.writer import quantize_checkpoint


@click.command("quantize", cls=OneLineErrors)
@click.option("--model", "model_dir", required=True, type=click.Path(path_type=Path), help="bf16 model directory.")
@click.option("--out", "out_dir", required=True, type=click.Path(path_type=Path), help="Output directory.")
@click.option("--bits", default=4, show_default=True, type=click.Choice(["4", "8"]), help="Bits per weight.")
@click.option("--group-size", default=128, show_default=True, type=int, help="Inputs per scale (power of two >= 32).")
@click.option("--quantize-lm-head", is_flag=True, help="Quantize lm_head too (embeddings always stay bf16).")
@click.option("--force", is_flag=True, help="Replace a non-empty --out.")
@click.option("--calibration-text", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Text whose activations weight the scale search and drive GPTQ (numpy forward: small models).")
@click.option("--calibration-tokens", default=32768, show_default=True, type=click.IntRange(min=1),
              help="Tokens of --calibration-text used.")
def quantize_command(
    model_dir: Path, out_dir: Path, bits: str, group_size: int, quantize_lm_head: bool, force: bool,
    calibration_text: str | None, calibration_tokens: int,
) -> None:
    """Quantize a checkpoint's linear weights to symmetric groupwise int4/int8 with bf16 scales."""
    try:
        quantize_checkpoint(
            model_dir, out_dir, int(bits), group_size, quantize_lm_head, force, calibration_text, calibration_tokens
        )
    except ValueError as err:  # bad flags, an unreadable or unsuitable checkpoint
        raise BadUsage(str(err)) from None
    click.echo(f"wrote int{bits} (group {group_size}) checkpoint to {out_dir}")
