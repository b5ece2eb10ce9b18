"""`ninfer-rt`: the command-line entry point. Each command group lives in its own module."""

from __future__ import annotations

import click

from ninfer_rt import __version__
from ninfer_rt.cli_generate import generate
from ninfer_rt.cli_kernels import kernels
from ninfer_rt.cli_quantize import quantize_command
from ninfer_rt.cli_replay import replay
from ninfer_rt.serve.command import serve


@click.group()
@click.version_option(__version__, prog_name="ninfer-rt")
def main() -> None:
    """ninfer-rt: a CUDA inference runtime for dense Qwen3-family models."""


main.add_command(generate)
main.add_command(kernels)
main.add_command(quantize_command)
main.add_command(serve)
main.add_command(replay)
