"""Checkpoints shipped inside the package: the default model of `ninfer-rt generate`.

``tiny-qwen3-code`` is a ~7M-parameter Qwen3 with one MTP layer trained on Python sources by
tools/train_tiny_model.py (figures in its train_summary.json and the README). It is small enough to ship
(< 16 MB) and real enough to measure speculative acceptance and quantization quality on.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_NAME = "tiny-qwen3-code"


class DefaultModelMissing(FileNotFoundError):
    """The package was built without its default model (one line, for the CLI)."""


def default_model_dir() -> Path:
    """The shipped model's directory; raises DefaultModelMissing when this install does not hold it."""
    model_dir = Path(__file__).resolve().parent / DEFAULT_MODEL_NAME
    if not (model_dir / "config.json").is_file():
        raise DefaultModelMissing(
            f"the default model is not installed (expected at {model_dir}); pass --model DIR, or train it with "
            "tools/train_tiny_model.py and copy its output there"
        )
    return model_dir
