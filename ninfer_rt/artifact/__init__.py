"""NInfer's `.ninfer` v1 artifacts: the container reader (container.py) and its registered layouts (layouts.py)."""

from ninfer_rt.artifact.container import Artifact, ArtifactObject
from ninfer_rt.artifact.layouts import ArtifactError

__all__ = ["Artifact", "ArtifactError", "ArtifactObject"]
