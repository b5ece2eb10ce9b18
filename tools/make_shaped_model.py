"""Writes a random-weight checkpoint of a named model shape (see ninfer_rt.testing.shaped), e.g. the 16 GB
qwen3-8b for the GPU agent replay: `python tools/make_shaped_model.py --shape qwen3-8b --out /tmp/qwen3-8b`,
or the hybrid 27B in int4 g128 (~17 GB, never written in bf16) for `ninfer-rt serve`:
`python tools/make_shaped_model.py --shape qwen3.6-27b --bits 4 --out /tmp/qwen3.6-27b-int4`."""

from __future__ import annotations

import time
from pathlib import Path

import click

from ninfer_rt.model.shapes import SHAPES
from ninfer_rt.testing.shaped import GROUP_SIZE, Quantized, make_shaped_model


@click.command()
@click.option("--shape", type=click.Choice(sorted(SHAPES)), default="qwen3-8b", show_default=True)
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--bits", type=click.Choice(["4", "8"]), default=None, help="write the layer weights groupwise-int (default: bf16)")
@click.option("--group-size", type=int, default=GROUP_SIZE, show_default=True)
def main(shape: str, out_dir: Path, seed: int, bits: str | None, group_size: int) -> None:
    started = time.monotonic()
    quantized = Quantized(int(bits), group_size) if bits else None
    make_shaped_model(out_dir, SHAPES[shape], seed, quantized)
    size = sum(f.stat().st_size for f in out_dir.iterdir())
    click.echo(f"{out_dir}: {shape}, {size / 1e9:.1f} GB in {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main()
