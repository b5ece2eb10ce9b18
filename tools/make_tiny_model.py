"""Writes a tiny random-weight checkpoint in Hugging Face layout (see ninfer_rt.testing.tiny and, for
``--arch qwen3_5``, ninfer_rt.testing.tiny_hybrid, which transformers itself writes)."""

from __future__ import annotations

from pathlib import Path

import click

from ninfer_rt.testing.tiny import ARCHITECTURES, TinyModelSpec, make_tiny_model
from ninfer_rt.testing.tiny_hybrid import LAYOUTS, TinyHybridSpec, make_tiny_qwen3_5

DEFAULTS = TinyModelSpec()
HYBRID = "qwen3_5"
# sizes whose default differs between the dense and the hybrid tiny models
LINEAR_FIELDS = ("linear_key_heads", "linear_value_heads", "linear_head_dim")
ARCH_DEFAULTS = {"layers": (DEFAULTS.layers, TinyHybridSpec().layers), "mtp": (DEFAULTS.mtp, TinyHybridSpec().mtp)}


@click.command()
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--arch", type=click.Choice(sorted([*ARCHITECTURES, HYBRID])), default=DEFAULTS.arch, show_default=True)
@click.option("--layout", type=click.Choice(LAYOUTS), default=None,
              help=f"{HYBRID} only: checkpoint layout  [default: {TinyHybridSpec().layout}]")
@click.option("--mtp/--no-mtp", default=None, help="add one MTP layer  [default: dense no, qwen3_5 yes]")
@click.option("--seed", type=int, default=DEFAULTS.seed, show_default=True)
@click.option("--hidden", type=int, default=DEFAULTS.hidden, show_default=True)
@click.option("--layers", type=int, default=None, help="[default: dense 2, qwen3_5 8 (3 linear : 1 full)]")
@click.option("--heads", type=int, default=DEFAULTS.heads, show_default=True)
@click.option("--kv-heads", type=int, default=DEFAULTS.kv_heads, show_default=True)
@click.option("--head-dim", type=int, default=DEFAULTS.head_dim, show_default=True)
@click.option("--intermediate", type=int, default=DEFAULTS.intermediate, show_default=True)
@click.option("--vocab", type=int, default=DEFAULTS.vocab, show_default=True)
@click.option("--tie/--no-tie", default=DEFAULTS.tie, help="tie lm_head to the embedding")
@click.option("--max-positions", type=int, default=DEFAULTS.max_positions, show_default=True,
              help="max_position_embeddings (before YaRN scaling): bounds the server's --max-context")
@click.option("--yarn", type=float, default=None, help="YaRN rope scaling factor (dense only)")
@click.option("--linear-key-heads", type=int, default=None, help=f"{HYBRID} only  [default: {TinyHybridSpec().linear_key_heads}]")
@click.option("--linear-value-heads", type=int, default=None, help=f"{HYBRID} only  [default: {TinyHybridSpec().linear_value_heads}]")
@click.option("--linear-head-dim", type=int, default=None,
              help=f"{HYBRID} only: key and value head dims (the CUDA kernels take 64 or 128)  [default: {TinyHybridSpec().linear_head_dim}]")
@click.option("--shards", type=int, default=DEFAULTS.shards, show_default=True, help="safetensors shard count")
def main(out_dir: Path, arch: str, layout: str | None, yarn: float | None, **spec: object) -> None:
    hybrid = arch == HYBRID
    linear = {name: value for name in LINEAR_FIELDS if (value := spec.pop(name)) is not None}
    if linear and not hybrid:
        raise click.BadParameter(f"only {HYBRID} has linear-attention layers", param_hint="'--linear-*'")
    for name, (dense_default, hybrid_default) in ARCH_DEFAULTS.items():
        if spec[name] is None:
            spec[name] = hybrid_default if hybrid else dense_default
    if hybrid:
        if yarn is not None:
            raise click.BadParameter("YaRN is not written for qwen3_5", param_hint="'--yarn'")
        click.echo(make_tiny_qwen3_5(out_dir, layout=layout or TinyHybridSpec().layout, **spec, **linear))
        return
    if layout is not None:
        raise click.BadParameter(f"only {HYBRID} has layouts", param_hint="'--layout'")
    click.echo(make_tiny_model(out_dir, arch=arch, yarn=yarn, **spec))


if __name__ == "__main__":
    main()
