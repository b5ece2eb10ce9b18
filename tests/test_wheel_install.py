"""A non-editable install works on its own: the wheel built from a clean copy of the checkout carries the
kernel sources and the shipped model, and, installed into a fresh virtual environment and run from a
directory outside the repository, compiles a kernel family with NVRTC from its own copy (no GPU needed).

The fresh environment gets the dependencies by linking the running environment's installed distributions
into its site-packages (everything but ninfer-rt itself), so the test needs no package index.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ELF_MAGIC = b"\x7fELF"
FAMILY, ARCH = "rmsnorm", "sm_80"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("setuptools", reason="the [dev] extra brings the build backend")
    checkout = tmp_path_factory.mktemp("checkout")
    for name in _repository_files():
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, checkout / name)
    dist = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", str(dist), str(checkout)])
    (built,) = dist.glob("ninfer_rt-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("venv")
    _run([sys.executable, "-m", "venv", "--without-pip", str(root)])
    python = root / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)])
    _link_dependencies(Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()))
    return root


def test_the_wheel_carries_the_package_files_the_kernel_sources_and_the_shipped_model(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    tracked = _repository_files()
    package_files = {name for name in tracked if name.startswith("ninfer_rt/")}
    kernel_sources = {f"ninfer_rt/{name}" for name in tracked if name.startswith("kernels_src/")}
    assert any(name.startswith("ninfer_rt/shipped/") and name.endswith("config.json") for name in package_files)
    assert {name for name in kernel_sources if name.endswith(".cu")}, "kernels_src/ holds no family"
    assert package_files | kernel_sources <= names, sorted((package_files | kernel_sources) - names)


def test_the_installed_copy_reads_its_own_kernel_sources(venv: Path, tmp_path: Path) -> None:
    probe = ("import json, ninfer_rt; from ninfer_rt.cuda import compiler; "
             "print(json.dumps([ninfer_rt.__file__, str(compiler.kernels_dir()), compiler.families()]))")
    package, kernels, families = json.loads(_run([str(venv / "bin" / "python"), "-c", probe], cwd=tmp_path, env=_clean_env(tmp_path)))
    assert Path(package).is_relative_to(venv) and Path(kernels).is_relative_to(venv)
    assert families == sorted(path.stem for path in (REPO / "kernels_src").glob("*.cu"))


def test_the_installed_command_compiles_a_kernel_family_with_nvrtc(venv: Path, tmp_path: Path) -> None:
    out = tmp_path / "cubins"
    _run([str(venv / "bin" / "ninfer-rt"), "kernels", "compile", "--arch", ARCH, "--out", str(out), FAMILY],
         cwd=tmp_path, env=_clean_env(tmp_path))
    assert (out / f"{FAMILY}-{ARCH}.cubin").read_bytes().startswith(ELF_MAGIC)


def _repository_files() -> list[str]:
    """What a clean checkout holds: tracked files, and new ones git does not ignore."""
    listed = _run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO)
    return [name for name in listed.splitlines() if (REPO / name).is_file()]


def _link_dependencies(site_packages: Path) -> None:
    """The running environment's distributions, minus any ninfer-rt install (editable ones point at this
    checkout), linked into the fresh environment as if pip had installed them there."""
    sources = dict.fromkeys(Path(sysconfig.get_paths()[key]) for key in ("purelib", "platlib"))
    for source in sources:
        for entry in source.iterdir():
            if entry.name.startswith(("ninfer_rt", "ninfer-rt", "__editable__")) or (site_packages / entry.name).exists():
                continue
            (site_packages / entry.name).symlink_to(entry)


def _clean_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NINFER_KERNELS_DIR", "VIRTUAL_ENV")}
    return env | {"NINFER_CACHE_DIR": str(tmp_path / "cache")}


def _run(command: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(command)}\n{done.stdout}\n{done.stderr}"
    return done.stdout
