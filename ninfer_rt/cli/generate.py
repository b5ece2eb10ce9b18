"""`ninfer-rt generate`: stream one completion (or an interactive chat) to stdout, statistics to stderr.

Mistakes in the command line (a bad flag, a missing model directory) exit 2 with one "Error: ..." line
and no usage screen, before anything loads.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from ninfer_rt.cli.errors import BadUsage, OneLineErrors
from ninfer_rt.cli.options import engine_config, engine_options, from_flags
from ninfer_rt.engine.build import EngineError
from ninfer_rt.engine.engine import Engine
from ninfer_rt.engine.output import RequestStats
from ninfer_rt.cli.model_path import model_frontend, resolve_model
from ninfer_rt.engine.request import SamplingParams
from ninfer_rt.serve.chat import ChatTemplate


@click.command("generate", cls=OneLineErrors)
@click.option(
    "--model", "model_dir", default=None, help="Model directory (Hugging Face layout), .ninfer artifact, or a shipped model's name [default: the shipped tiny model]."
)
@click.option("--prompt", default=None, help="The prompt text.")
@click.option("--prompt-file", type=click.File("r"), default=None, help="Read the prompt from a file ('-' = stdin).")
@click.option("--chat", is_flag=True, help="Interactive conversation through the model's chat template.")
@click.option("--max-tokens", default=256, show_default=True, type=click.IntRange(min=1))
@click.option("--temperature", default=1.0, show_default=True, type=click.FloatRange(min=0))
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0, 1, min_open=True))
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(min=-1), help="0 or -1: no top-k cut.")
@click.option("--seed", default=None, type=int)
@engine_options
def generate(model_dir: str | None, prompt: str | None, prompt_file: Any, chat: bool, **options: Any) -> None:
    """Generate text from a prompt, or chat with --chat."""
    model_path = resolve_model(model_dir)
    model_frontend(model_path)
    if sum(x is not None and x is not False for x in (prompt, prompt_file, chat or None)) != 1:
        raise BadUsage("give exactly one of --prompt, --prompt-file or --chat")
    try:
        params = from_flags(SamplingParams, options)
        engine = Engine.load(model_path, engine_config(options))
    except ValueError as err:  # bad sampling values, or an unreadable config/tokenizer/weights
        raise BadUsage(str(err)) from None
    except EngineError as err:
        raise click.ClickException(str(err)) from None
    if chat:
        _chat(engine, params)
    else:
        _stream(engine, prompt if prompt is not None else prompt_file.read(), params)


def _stream(engine: Engine, prompt: str, params: SamplingParams) -> str:
    """Print the completion as it comes; returns its text."""
    try:
        text = ""
        for output in engine.generate([prompt], params):
            click.echo(output.text, nl=False)
            sys.stdout.flush()
            text += output.text
            if output.stats is not None:
                click.echo()
                click.echo(_format_stats(output.stats), err=True)
        return text
    except ValueError as err:  # e.g. a prompt longer than the context
        raise click.ClickException(str(err)) from None


def _chat(engine: Engine, params: SamplingParams) -> None:
    if engine.tokenizer.chat_template is None:
        raise BadUsage("--chat: the model has no chat template")
    template = ChatTemplate(engine.tokenizer.chat_template)
    messages: list[dict[str, str]] = []
    while True:
        try:
            user = input("> ")
        except EOFError:
            return
        messages.append({"role": "user", "content": user})
        reply = _stream(engine, template.render(messages).text, params)
        messages.append({"role": "assistant", "content": reply})


def _format_stats(stats: RequestStats) -> str:
    acceptance = f", {stats.acceptance.describe()}" if stats.acceptance is not None else ""
    return (
        f"[{stats.prompt_tokens} prompt tokens ({stats.cached_tokens} cached), {stats.completion_tokens} generated; "
        f"TTFT {stats.ttft_s * 1000:.0f} ms, prefill {stats.prefill_tok_s:.1f} tok/s, decode {stats.decode_tok_s:.1f} tok/s"
        f"{acceptance}]"
    )
