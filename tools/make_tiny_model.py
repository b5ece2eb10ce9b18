"""Writes a tiny random-weight checkpoint in Hugging Face layout (see ninfer_rt.testing.tiny)."""

from __future__ import annotations

from pathlib import Path

import click

from ninfer_rt.testing.tiny import ARCHITECTURES, TinyModelSpec, make_tiny_model

DEFAULTS = TinyModelSpec()


@click.command()
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--arch", type=click.Choice(sorted(ARCHITECTURES)), default=DEFAULTS.arch, show_default=True)
@click.option("--mtp/--no-mtp", default=DEFAULTS.mtp, help="add one MTP layer (Qwen3-Next layout)")
@click.option("--seed", type=int, default=DEFAULTS.seed, show_default=True)
@click.option("--hidden", type=int, default=DEFAULTS.hidden, show_default=True)
@click.option("--layers", type=int, default=DEFAULTS.layers, show_default=True)
@click.option("--heads", type=int, default=DEFAULTS.heads, show_default=True)
@click.option("--kv-heads", type=int, default=DEFAULTS.kv_heads, show_default=True)
@click.option("--head-dim", type=int, default=DEFAULTS.head_dim, show_default=True)
@click.option("--intermediate", type=int, default=DEFAULTS.intermediate, show_default=True)
@click.option("--vocab", type=int, default=DEFAULTS.vocab, show_default=True)
@click.option("--tie/--no-tie", default=DEFAULTS.tie, help="tie lm_head to the embedding")
@click.option("--max-positions", type=int, default=DEFAULTS.max_positions, show_default=True,
              help="max_position_embeddings (before YaRN scaling): bounds the server's --max-context")
@click.option("--yarn", type=float, default=None, help="YaRN rope scaling factor")
@click.option("--shards", type=int, default=DEFAULTS.shards, show_default=True, help="safetensors shard count")
def main(out_dir: Path, **spec: object) -> None:
    click.echo(make_tiny_model(out_dir, **spec))


if __name__ == "__main__":
    main()
