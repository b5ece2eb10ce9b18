"""Imports point down the layers only (docs/ARCHITECTURE.md, "Layers"). Each top-level package of ninfer_rt
has a rank; a module may import its own package and packages of lower rank, never one of its own rank or
above. Every import counts, at any depth: inside functions and under `if TYPE_CHECKING:` too. A package's
`__main__.py` (`python -m ninfer_rt.serve`) is an entry point, ranked above the CLI."""

from __future__ import annotations

import ast
from pathlib import Path

from import_scan import imported_modules

import ninfer_rt
from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.kv.cache import KVCache, KVSpec
from ninfer_rt.model.executor import PagedKV

PACKAGE = Path(ninfer_rt.__file__).parent
LAYERS = (
    ("ordering", "quantize"),  # the verifier; the groupwise-int format (numpy only), which kernels launch by
    ("cuda",),
    ("artifact",),  # the .ninfer container, bound to the groupwise-int format
    ("model",),  # the config, the Executor protocol and the one model definition
    ("kv",),
    ("exec",),
    ("engine", "quantize_checkpoint"),  # the request loop; the quantizer run over a checkpoint (it runs the model)
    ("serve", "replay", "testing", "kernel_dev", "shipped"),
    ("cli",),
)
RANK = {package: rank for rank, packages in enumerate(LAYERS) for package in packages}
ENTRY_POINT = len(LAYERS)


def top_package(module: str) -> str | None:
    """`ninfer_rt.kv.cache` -> `kv`; None for modules outside ninfer_rt and for the package root itself."""
    parts = module.split(".")
    return parts[1] if parts[0] == "ninfer_rt" and len(parts) > 1 else None


def source_rank(path: Path) -> tuple[str, int]:
    package = path.relative_to(PACKAGE).parts[0]
    return package, ENTRY_POINT if path.name == "__main__.py" else RANK[package]


def upward_imports(path: Path, modules: set[str]) -> list[str]:
    """The imports among `modules` that the module at `path` may not make."""
    package, rank = source_rank(path)
    return [
        f"{path.relative_to(PACKAGE).as_posix()}: {module}"
        for module in sorted(modules)
        if (target := top_package(module)) not in (None, package) and RANK[target] >= rank
    ]


def package_modules() -> list[Path]:
    return [path for path in sorted(PACKAGE.rglob("*.py")) if path.parent != PACKAGE]  # the root only re-exports


def test_every_top_level_package_has_a_layer() -> None:
    packages = {path.name for path in PACKAGE.iterdir() if path.is_dir() and (path / "__init__.py").is_file()}
    loose = sorted(path.name for path in PACKAGE.glob("*.py") if path.name != "__init__.py")
    assert packages == set(RANK), "place a new package in LAYERS (and in docs/ARCHITECTURE.md)"
    assert not loose, f"modules belong to a package: {loose}"


def test_no_module_imports_its_own_layer_or_one_above() -> None:
    offenders = [line for path in package_modules() for line in upward_imports(path, imported_modules(path))]
    assert not offenders, f"imports must point down the layers: {offenders}"


def test_no_module_uses_a_relative_import() -> None:
    # the scan reads absolute module names only; a relative import would slip past it
    offenders = sorted(
        str(path.relative_to(PACKAGE))
        for path in package_modules()
        if any(isinstance(node, ast.ImportFrom) and node.level for node in ast.walk(ast.parse(path.read_text())))
    )
    assert not offenders, offenders


def test_an_upward_import_is_found_at_any_depth(tmp_path: Path) -> None:
    source = tmp_path / "probe.py"
    source.write_text(
        "from typing import TYPE_CHECKING\nimport ninfer_rt.cuda.streams\nfrom ninfer_rt.artifact import container\n"
        "if TYPE_CHECKING:\n    from ninfer_rt.kv.cache import KVCache\n"
        "def f():\n    from ninfer_rt.exec import numpy_exec\n"
    )
    as_if_in_model = upward_imports(PACKAGE / "model" / "probe.py", imported_modules(source))
    assert as_if_in_model == ["model/probe.py: ninfer_rt.exec", "model/probe.py: ninfer_rt.kv.cache"]


def test_packages_of_one_layer_do_not_import_each_other() -> None:
    assert upward_imports(PACKAGE / "serve" / "app.py", {"ninfer_rt.replay.trace", "ninfer_rt.engine"}) == [
        "serve/app.py: ninfer_rt.replay.trace"
    ]


def test_a_main_module_is_an_entry_point_above_the_cli() -> None:
    assert upward_imports(PACKAGE / "serve" / "__main__.py", {"ninfer_rt.cli.serve"}) == []
    assert upward_imports(PACKAGE / "serve" / "app.py", {"ninfer_rt.cli.serve"}) == ["serve/app.py: ninfer_rt.cli.serve"]


def test_the_engines_kv_cache_is_the_models_paged_kv() -> None:
    kv = KVCache(StreamSet(None), KVSpec(num_layers=1, num_pages=2, n_kv_heads=1, head_dim=8, page_size=4))
    assert isinstance(kv, PagedKV)
    assert kv.spec.page_size == 4
