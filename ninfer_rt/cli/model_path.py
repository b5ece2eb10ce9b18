"""What `--model` names: a Hugging Face model directory, or a qwen3_6_27b `.ninfer` artifact file."""

from __future__ import annotations

from pathlib import Path

from ninfer_rt.artifact import ArtifactError
from ninfer_rt.cli.errors import BadUsage
from ninfer_rt.model.artifact_binding import artifact_frontend, is_artifact_path


def model_frontend(model_path: Path) -> Path:
    """The directory holding the model's tokenizer and generation config (an artifact's: its frontend
    resources, materialised); a path that is neither kind, or a bad artifact, is one line and exit 2."""
    if is_artifact_path(model_path):
        try:
            return artifact_frontend(model_path)
        except ArtifactError as exc:
            raise BadUsage(f"--model {exc}") from None
    if not (model_path / "config.json").is_file():
        raise BadUsage(f"--model {model_path}: not a model directory (no config.json) nor a .ninfer artifact")
    return model_path
