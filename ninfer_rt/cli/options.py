"""The engine flags that `generate` and `serve` share, and the EngineConfig built from them: a flag sets the
config field (or, for `generate`, the SamplingParams field) of its own name."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import click

from ninfer_rt.cuda.driver import device_count
from ninfer_rt.cuda.fault_drill import ALLOW_ENV, check_allowed
from ninfer_rt.engine.build import EngineConfig, require_tensor_parallel_path, resolve_device
from ninfer_rt.engine.spec_vocab import DEFAULT_DRAFT_VOCAB
from ninfer_rt.kv.memory_plan import SnapshotBudget

T = TypeVar("T")

_OPTIONS = [
    click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cuda", "cpu"]), help="auto: the GPU when one is present."),
    click.option("--max-context", default=32768, show_default=True, type=click.IntRange(min=2)),
    click.option("--kv-capacity", default="auto", show_default=True, callback=lambda c, p, v: _kv_capacity(v)),
    click.option("--max-concurrency", default=2, show_default=True, type=click.IntRange(min=1)),
    click.option("--kv-dtype", default="bf16", show_default=True, type=click.Choice(["bf16", "int8"])),
    click.option(
        "--prefix-caching/--no-prefix-caching", default=True, show_default=True,
        help="Reuse the K/V of earlier prompts' shared prefixes; off, every prompt is computed in full.",
    ),
    click.option("--verify-ordering", is_flag=True, help="Run the happens-before verifier on every device op."),
    click.option(
        "--overlap/--no-overlap", default=True, show_default=True,
        help="Enqueue each decode step before the previous step's tokens are read back (not with --spec mtp).",
    ),
    click.option("--spec", default="none", show_default=True, type=click.Choice(["none", "mtp"]), help="mtp: speculative decoding with the checkpoint's MTP module."),
    click.option("--draft-tokens", default=3, show_default=True, type=click.IntRange(min=1), help="Drafts verified per step (--spec mtp)."),
    click.option(
        "--lm-head-draft", type=click.IntRange(min=1), is_flag=False, flag_value=DEFAULT_DRAFT_VOCAB, default=None,
        help=f"Draft over the N most frequent tokens only (N defaults to {DEFAULT_DRAFT_VOCAB}); verification stays exact.",
    ),
    click.option(
        "--state-snapshot-budget", default=None, callback=lambda c, p, v: _snapshot_budget(v),
        help="Hybrid models: memory (e.g. 4GiB) or count of saved Gated DeltaNet states; default: planned with --kv-capacity.",
    ),
    click.option(
        "--tensor-parallel", default=1, show_default=True, type=click.IntRange(min=1),
        help="Split the model over N ranks (on the CPU: N simulated ranks; the GPUs' NCCL path is not built).",
    ),
    click.option(
        "--debug-fault-after", type=int, default=None, hidden=True,
        help=f"The fault drill: an out-of-bounds write after N device ops; needs {ALLOW_ENV}=1.",
    ),
]


def engine_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Adds the engine flags to a click command, in the order --help lists them."""
    for option in reversed(_OPTIONS):
        command = option(command)
    return command


def engine_config(options: dict[str, Any]) -> EngineConfig:
    """The engine's share of a command's flags; a ValueError (one line for the CLI) when they cannot work here."""
    require_tensor_parallel_path(resolve_device(options["device"]), options["tensor_parallel"])
    if options["device"] == "cuda" and device_count() == 0:
        raise ValueError("--device cuda: no CUDA GPU is visible here (no driver or no device); use --device cpu")
    if options["debug_fault_after"] is not None:
        check_allowed(options["debug_fault_after"])  # FaultDrillRefused is a ValueError: one line, exit 2
    return from_flags(EngineConfig, options, verify_ordering=options["verify_ordering"] or None)


def from_flags(cls: type[T], options: Mapping[str, Any], **overrides: Any) -> T:
    """The dataclass `cls` with each field that a flag of the same name sets taken from `options` (a field no
    flag names keeps its default), then `overrides`."""
    named = {field.name: options[field.name] for field in dataclasses.fields(cls) if field.name in options}
    return cls(**(named | overrides))


def _snapshot_budget(value: str | None) -> str | None:
    if value is not None:
        try:
            SnapshotBudget.parse(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
    return value


def _kv_capacity(value: str) -> str:
    if value != "auto" and not (value.isdigit() and int(value) > 0):
        raise click.BadParameter(f"must be 'auto' or a positive page count, got {value!r}")
    return value
