"""The one build step pyproject.toml cannot declare: the kernel sources live in kernels_src/ at the top of
the repository (beside the package, where `ninfer-rt kernels watch` edits them) and ship inside the wheel
as ninfer_rt/kernels_src/, where ninfer_rt.cuda.compiler finds them with importlib.resources. An editable
install copies nothing: it compiles the repository's own files."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

KERNEL_SOURCES = Path("kernels_src")
SHIPPED_AS = Path("ninfer_rt") / "kernels_src"


class BuildPyWithKernels(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        target = Path(self.build_lib) / SHIPPED_AS
        self.mkpath(str(target))
        for source in sorted([*KERNEL_SOURCES.glob("*.cu"), *KERNEL_SOURCES.glob("*.cuh")]):
            self.copy_file(str(source), str(target / source.name))


setup(cmdclass={"build_py": BuildPyWithKernels})
