"""Writes a random-weight checkpoint of a named model shape (see ninfer_rt.testing.shaped), e.g. the 16 GB
qwen3-8b for the GPU agent replay: `python tools/make_shaped_model.py --shape qwen3-8b --out /tmp/qwen3-8b`,
or the hybrid 27B in int4 g128 (~17 GB, never written in bf16) for `ninfer-rt serve`:
`python tools/make_shaped_model.py --shape qwen3.6-27b --bits 4 --out /tmp/qwen3.6-27b-int4`;
with --format ninfer, a hybrid as a qwen3_6_27b `.ninfer` artifact of random codes in NInfer's formats
(Q4/Q5/Q6G64, W8G32, ~17 GB at the 27B; --out is then the file):
`python tools/make_shaped_model.py --shape qwen3.6-27b --format ninfer --out /tmp/qwen3.6-27b.ninfer`."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click
from tqdm import tqdm

from ninfer_rt.model.shapes import SHAPES, is_hybrid_shape
from ninfer_rt.testing.shaped import GROUP_SIZE, Quantized, make_shaped_model
from ninfer_rt.testing.shaped_artifact import write_shaped_artifact

DRAFT_ROWS = 131_072  # the published artifact's reduced-vocabulary draft head


@click.command()
@click.option("--shape", type=click.Choice(sorted(SHAPES)), default="qwen3-8b", show_default=True)
@click.option("--out", "out_path", required=True, type=click.Path(path_type=Path), help="a directory, or with --format ninfer the file")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--bits", type=click.Choice(["4", "8"]), default=None, help="write the layer weights groupwise-int (default: bf16)")
@click.option("--group-size", type=int, default=GROUP_SIZE, show_default=True)
@click.option("--format", "out_format", type=click.Choice(["safetensors", "ninfer"]), default="safetensors", show_default=True)
def main(shape: str, out_path: Path, seed: int, bits: str | None, group_size: int, out_format: str) -> None:
    started = time.monotonic()
    if out_format == "ninfer":
        if not is_hybrid_shape(SHAPES[shape]) or bits is not None:
            raise click.UsageError(f"--format ninfer: a hybrid shape in the artifact's own formats (no --bits), not {shape}")
        if not out_path.parent.is_dir():
            raise click.UsageError(f"--out {out_path}: no directory {out_path.parent}")
        with tqdm(desc="writing", unit="B", unit_scale=True, disable=not sys.stderr.isatty()) as bar:
            write_shaped_artifact(out_path, SHAPES[shape], DRAFT_ROWS, seed, progress=lambda name, nbytes: bar.update(nbytes))
        size = out_path.stat().st_size
    else:
        if out_path.is_file():
            raise click.UsageError(f"--out {out_path}: a checkpoint is a directory, and this is a file")
        quantized = Quantized(int(bits), group_size) if bits else None
        make_shaped_model(out_path, SHAPES[shape], seed, quantized)
        size = sum(f.stat().st_size for f in out_path.iterdir())
    click.echo(f"{out_path}: {shape}, {size / 1e9:.1f} GB in {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main()
