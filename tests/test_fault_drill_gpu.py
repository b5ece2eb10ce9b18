"""The fault drill's kernel on a real GPU: after the armed op, kernels_src/fault_drill.cu's out-of-bounds
write kills the context, and the next sync dumps the crash context and raises FatalCudaError naming
CUDA_ERROR_ILLEGAL_ADDRESS. In a subprocess, because the context stays dead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    from ninfer_rt.cuda.driver import open_device
    from ninfer_rt.cuda.fault_drill import FaultDrill
    from ninfer_rt.cuda.streams import FatalCudaError, StreamSet

    streams = StreamSet(open_device(), verify=True)
    compute = streams.create("compute")
    FaultDrill.arm(streams, after=2)
    compute.declare("decode attention", lane="req-1")
    compute.declare("lm_head", lane="req-1")  # the second op: the drill's kernel follows it
    try:
        compute.synchronize()
    except FatalCudaError as error:
        print(error.crash_file)
    """
)


@pytest.mark.gpu
def test_the_drill_kernel_faults_and_the_next_sync_dumps_the_crash_context(tmp_path: Path) -> None:
    env = {**os.environ, "NINFER_ALLOW_FAULT_DRILL": "1", "NINFER_CRASH_DIR": str(tmp_path),
           "NINFER_CACHE_DIR": str(tmp_path / "cache")}

    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)

    assert run.returncode == 0 and run.stdout, run.stderr
    doc = json.loads(Path(run.stdout.split()[0]).read_text())
    assert "CUDA_ERROR_ILLEGAL_ADDRESS" in doc["error"]
    labels = [op["label"] for op in doc["streams"]["stream:compute"]]
    assert labels == ["decode attention", "lm_head", "fault drill: out-of-bounds write"]
