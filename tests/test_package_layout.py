"""Where things live: the server below the CLI, the quantized-weight format below the model, and the
checkpoint writers for tests and tools used by no module of the runtime."""

from __future__ import annotations

from pathlib import Path

import ninfer_rt
from test_streams import imported_modules

PACKAGE = Path(ninfer_rt.__file__).parent


def ninfer_imports(path: Path) -> set[str]:
    return {module for module in imported_modules(path) if module.split(".")[0] == "ninfer_rt"}


def under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_server_does_not_import_the_cli() -> None:
    # serve/__main__.py is `python -m ninfer_rt.serve`, the serve command's second entry point.
    offenders = {
        f"{path.name}: {module}"
        for path in (PACKAGE / "serve").rglob("*.py")
        if path.name != "__main__.py"
        for module in ninfer_imports(path)
        if under(module, "ninfer_rt.cli")
    }
    assert not offenders, f"serve/ takes its flags' values as arguments: {sorted(offenders)}"


def test_the_quantized_weight_format_imports_only_itself() -> None:
    offenders = {
        f"{path.name}: {module}"
        for path in (PACKAGE / "quantize").glob("*.py")
        for module in ninfer_imports(path)
        if not under(module, "ninfer_rt.quantize")
    }
    assert not offenders, f"the format sits below model/ (writing a checkpoint is quantize_checkpoint/): {sorted(offenders)}"


def test_no_runtime_module_imports_the_test_checkpoint_writers() -> None:
    offenders = {
        f"{path.relative_to(PACKAGE)}: {module}"
        for path in PACKAGE.rglob("*.py")
        if PACKAGE / "testing" not in path.parents
        for module in ninfer_imports(path)
        if under(module, "ninfer_rt.testing")
    }
    assert not offenders, f"ninfer_rt/testing is for tests and tools: {sorted(offenders)}"
