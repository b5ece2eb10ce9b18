"""Checkpoints shipped inside the package: the default model of `ninfer-rt generate`.

``tiny-qwen3-code`` is a ~7M-parameter Qwen3 with one MTP layer trained on Python sources by
tools/train_tiny_model.py (figures in its train_summary.json and the README). It is small enough to ship
(< 16 MB) and real enough to measure speculative acceptance and quantization quality on.

Every directory here with a config.json is a shipped model: `--model NAME` picks one by its name
(`shipped_model_dir`), no --model the default.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_NAME = "tiny-qwen3-code"
_SHIPPED = Path(__file__).resolve().parent


class DefaultModelMissing(FileNotFoundError):
    """The package was built without its default model (one line, for the CLI)."""


def shipped_model_names() -> list[str]:
    """The names of the models this install holds, sorted."""
    return sorted(d.name for d in _SHIPPED.iterdir() if (d / "config.json").is_file())


def shipped_model_dir(name: str) -> Path | None:
    """The directory of the shipped model `name`, or None when this install holds no such model."""
    return _SHIPPED / name if name in shipped_model_names() else None


def default_model_dir() -> Path:
    """The shipped model's directory; raises DefaultModelMissing when this install does not hold it."""
    model_dir = _SHIPPED / DEFAULT_MODEL_NAME
    if not (model_dir / "config.json").is_file():
        raise DefaultModelMissing(
            f"the default model is not installed (expected at {model_dir}); pass --model DIR, or train it with "
            "tools/train_tiny_model.py and copy its output there"
        )
    return model_dir
