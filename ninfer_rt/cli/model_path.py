"""What `--model` names: a Hugging Face model directory, a qwen3_6_27b `.ninfer` artifact file, or a shipped
model by its name (ninfer_rt/shipped); no --model is the shipped default."""

from __future__ import annotations

from pathlib import Path

from ninfer_rt.artifact import ArtifactError
from ninfer_rt.cli.errors import BadUsage
from ninfer_rt.model.artifact_binding import artifact_frontend, is_artifact_path
from ninfer_rt.shipped import DefaultModelMissing, default_model_dir, shipped_model_dir, shipped_model_names


def resolve_model(model: str | None) -> Path:
    """The path `--model` stands for: a path as given when it exists or reads as one (model_frontend then
    says what is wrong with it), else a shipped model of that name; None is the shipped default. A bare
    name that is none of these is one line naming the flag and the shipped models (exit 2)."""
    if model is None:
        try:
            return default_model_dir()
        except DefaultModelMissing as err:
            raise BadUsage(str(err)) from None
    path = Path(model)
    if path.exists() or len(path.parts) > 1:
        return path
    shipped = shipped_model_dir(model)
    if shipped is not None:
        return shipped
    names = ", ".join(shipped_model_names()) or "none installed"
    raise BadUsage(f"--model {model}: not a model directory, a .ninfer artifact nor a shipped model ({names})")


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
