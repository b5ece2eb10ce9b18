"""`ninfer-rt check`: validate a model directory on the CPU before serving it.

One line per check (OK / FAIL / SKIPPED, checkpoint_checks.py): config.json, every tensor's presence, shape
and dtype, the chat template (with a tool call when it takes tools), the tokenizer on the rendered prompt,
and, where transformers is installed, the first --tokens tokens' logits against transformers' (float32;
check_logits.py gives the bound). Exit status 0 when nothing failed, 2 otherwise; a check whose input an
earlier check rejected is skipped.
"""

from __future__ import annotations

from pathlib import Path

import click

from ninfer_rt.cli.checkpoint_checks import (
    FAIL,
    SKIPPED,
    CheckResult,
    check_chat_template,
    check_config,
    check_logits,
    check_tensors,
    check_tokenizer,
)
from ninfer_rt.cli.errors import BadUsage, OneLineErrors

DEFAULT_TOKENS = 16


@click.command("check", cls=OneLineErrors)
@click.option("--model", "model_dir", required=True, type=click.Path(path_type=Path), help="Model directory.")
@click.option(
    "--tokens", default=DEFAULT_TOKENS, show_default=True, type=click.IntRange(min=0),
    help="Prompt tokens whose logits are compared with transformers' (0: skip the comparison).",
)
def check(model_dir: Path, tokens: int) -> None:
    """Check that a checkpoint loads and computes what transformers computes (CPU only)."""
    if not (model_dir / "config.json").is_file():
        raise BadUsage(f"--model {model_dir}: not a model directory (no config.json)")
    results = run_checks(model_dir, tokens)
    for result in results:
        click.echo(result.line())
    if any(result.status == FAIL for result in results):
        raise click.exceptions.Exit(2)


def run_checks(model_dir: Path, tokens: int) -> list[CheckResult]:
    config_result, cfg = check_config(model_dir)
    results = [config_result]
    checkpoint = prompt = ids = None
    if cfg is not None:
        tensor_result, checkpoint = check_tensors(model_dir, cfg)
        template_result, prompt = check_chat_template(model_dir)
        results += [tensor_result, template_result]
        if prompt is not None:
            tokenizer_result, ids = check_tokenizer(model_dir, cfg, prompt)
            results.append(tokenizer_result)
    if checkpoint is not None and ids is not None:
        results.append(check_logits(model_dir, checkpoint, ids[:tokens]))
    else:
        results.append(CheckResult("logits", SKIPPED, "needs the config, tensors and tokenizer checks to pass"))
    return results
