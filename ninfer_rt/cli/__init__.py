"""`ninfer-rt`: the command-line entry point. Each command lives in its own module of this package."""

from __future__ import annotations

import click

from ninfer_rt import __version__
from ninfer_rt.cli import check, generate, inspect, kernels, quantize, replay, serve


@click.group()
@click.version_option(__version__, prog_name="ninfer-rt")
def main() -> None:
    """ninfer-rt: a CUDA inference runtime for dense Qwen3-family models."""


main.add_command(check.check)
main.add_command(generate.generate)
main.add_command(inspect.inspect)
main.add_command(kernels.kernels)
main.add_command(quantize.quantize_command)
main.add_command(serve.serve)
main.add_command(replay.replay)
