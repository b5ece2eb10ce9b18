"""Writes a random-weight checkpoint of a named model shape (see ninfer_rt.testing.shaped), e.g. the 16 GB
qwen3-8b for the GPU agent replay: `python tools/make_shaped_model.py --shape qwen3-8b --out /tmp/qwen3-8b`."""

from __future__ import annotations

import time
from pathlib import Path

import click

from ninfer_rt.model.shapes import SHAPES
from ninfer_rt.testing.shaped import make_shaped_model


@click.command()
@click.option("--shape", type=click.Choice(sorted(SHAPES)), default="qwen3-8b", show_default=True)
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--seed", type=int, default=0, show_default=True)
def main(shape: str, out_dir: Path, seed: int) -> None:
    started = time.monotonic()
    make_shaped_model(out_dir, SHAPES[shape], seed)
    size = sum(f.stat().st_size for f in out_dir.iterdir())
    click.echo(f"{out_dir}: {shape}, {size / 1e9:.1f} GB in {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main()
