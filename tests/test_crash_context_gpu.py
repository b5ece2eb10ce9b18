"""A real sticky error on a real GPU: a kernel that traps kills the context; the next sync dumps the crash
context and raises FatalCudaError naming the file. It runs in a subprocess because the context stays dead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TRAP_KERNEL = """\
// Test-only: a kernel that executes `trap`, the quickest way to a sticky CUDA_ERROR_LAUNCH_FAILED.
extern "C" __global__ void trap_kernel() { asm("trap;"); }
"""

SCRIPT = textwrap.dedent(
    """
    from ninfer_rt.cuda.driver import open_device
    from ninfer_rt.cuda.kernels import KernelLibrary, KernelSpec
    from ninfer_rt.cuda.streams import FatalCudaError, StreamSet

    device = open_device()
    streams = StreamSet(device, verify=True)
    compute, copy = streams.create("compute"), streams.create("copy")
    copy.record()  # the copy stream exists but has done nothing: its ring is empty
    streams.crash.add_section("lanes", lambda: {"req-1": {"frontier": 5}})
    trap = KernelLibrary(device).kernel(KernelSpec("trap", "trap_kernel", ()))
    trap.launch(compute, 1, 1, label="trap", writes=("scratch",), lane="req-1")
    try:
        compute.synchronize()
    except FatalCudaError as error:
        print(error.crash_file)
        print(error)
    """
)


@pytest.mark.gpu
def test_hazard_trapping_kernel_dumps_crash_context_and_names_the_file(tmp_path: Path) -> None:
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    (kernels / "trap.cu").write_text(TRAP_KERNEL)
    env = {
        **os.environ,
        "NINFER_KERNELS_DIR": str(kernels),
        "NINFER_CACHE_DIR": str(tmp_path / "cache"),
        "NINFER_CRASH_DIR": str(tmp_path / "crash"),
    }

    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)

    assert run.returncode == 0 and run.stdout, run.stderr
    crash_file, message = run.stdout.splitlines()[:2]
    doc = json.loads(Path(crash_file).read_text())
    assert crash_file in message
    assert "cuStreamSynchronize" in doc["error"]
    assert [op["label"] for op in doc["streams"]["stream:compute"]] == ["trap"]
    assert doc["streams"]["stream:copy"] == []
    assert doc["lanes"] == {"req-1": {"frontier": 5}}
