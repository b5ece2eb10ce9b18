"""`ninfer-rt inspect ARTIFACT`: list a `.ninfer` v1 artifact's objects, or write one tensor's values as .npy.

The listing has one line per object: name, kind, shape, format, layout (the encoding for a resource) and
stored bytes. `--tensor NAME --npy OUT` writes that tensor's logical values as float32 (grouped formats
dequantized through bfloat16, as NInfer's decoder reads them). A file that breaks the v1 specification, or
an unknown tensor name, is one line and exit status 2, and no .npy is written.
"""

from __future__ import annotations

import os
from pathlib import Path

import click
import numpy as np

from ninfer_rt.artifact import Artifact, ArtifactError, ArtifactObject
from ninfer_rt.cli.errors import BadUsage, OneLineErrors


def object_line(obj: ArtifactObject) -> str:
    if obj.kind == "resource":
        return f"{obj.name}  resource  -  -  {obj.encoding}  {obj.bytes}"
    shape = "[" + ", ".join(str(d) for d in obj.shape or ()) + "]"
    return f"{obj.name}  tensor  {shape}  {obj.format}  {obj.layout}  {obj.bytes}"


@click.command("inspect", cls=OneLineErrors)
@click.argument("artifact_path", metavar="ARTIFACT", type=click.Path(path_type=Path))
@click.option("--tensor", "tensor_name", default=None, help="A tensor to write with --npy.")
@click.option("--npy", "npy_path", default=None, type=click.Path(path_type=Path), help="Where to write --tensor.")
def inspect(artifact_path: Path, tensor_name: str | None, npy_path: Path | None) -> None:
    """List a .ninfer artifact's objects (name, kind, shape, format, layout, bytes)."""
    if (tensor_name is None) != (npy_path is None):
        raise BadUsage("--tensor and --npy go together")
    if not artifact_path.is_file():
        raise BadUsage(f"{artifact_path}: no such file")
    try:
        artifact = Artifact(artifact_path)
    except ArtifactError as exc:
        raise BadUsage(f"{artifact_path}: {exc}") from None
    with artifact:
        if tensor_name is None:
            click.echo(f"model_id {artifact.model_id}")
            for obj in artifact.objects.values():
                click.echo(object_line(obj))
            return
        obj = artifact.objects.get(tensor_name)
        if obj is None or obj.kind != "tensor":
            raise BadUsage(f"--tensor {tensor_name}: no tensor of that name in {artifact_path}")
        values = artifact.tensor_values(tensor_name).astype(np.float32, copy=False)  # I32 ids widen
    assert npy_path is not None
    partial = npy_path.with_name(npy_path.name + ".partial")  # a failed write leaves nothing at npy_path
    try:
        with open(partial, "wb") as out:
            np.save(out, values)
        os.replace(partial, npy_path)
    except OSError as exc:
        raise BadUsage(f"--npy {npy_path}: {exc.strerror or exc}") from None
    finally:
        partial.unlink(missing_ok=True)
