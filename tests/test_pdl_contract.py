"""Programmatic dependent launch is safe only if every kernel waits for the previous one before touching
mutable memory (kernels_src/common.cuh). Checked on the PTX NVRTC emits, so a kernel added without the
prologue fails here, on a CPU, before it can race on a GPU."""

import re

import pytest

from ninfer_rt.cuda.compiler import families, family_ptx

ENTRY = re.compile(r"\.entry\s+(\w+)")


def entry_bodies(ptx: str) -> dict[str, str]:
    starts = [(m.group(1), m.start()) for m in ENTRY.finditer(ptx)]
    ends = [start for _, start in starts[1:]] + [len(ptx)]
    return {name: ptx[start:end] for (name, start), end in zip(starts, ends)}


@pytest.mark.parametrize("family", families())
def test_every_kernel_entry_waits_for_the_previous_kernel(family: str) -> None:
    bodies = entry_bodies(family_ptx(family, "sm_90a"))
    assert bodies, f"{family}: no kernel entries found in the PTX"
    missing = [name for name, body in bodies.items() if "griddepcontrol.wait" not in body]
    assert not missing, f"{family}: kernels without grid_dependency_wait(): {missing}"


@pytest.mark.parametrize("family", families())
def test_every_kernel_entry_lets_the_next_launch_before_it_waits(family: str) -> None:
    # the next kernel's weight prologue then overlaps this kernel's whole run (common.cuh)
    late = [
        name for name, body in entry_bodies(family_ptx(family, "sm_90a")).items()
        if not -1 < body.find("griddepcontrol.launch_dependents") < body.index("griddepcontrol.wait")
    ]
    assert not late, f"{family}: kernels that wait before letting the next kernel launch: {late}"


def test_pre_hopper_ptx_has_no_dependent_launch_instructions() -> None:
    assert "griddepcontrol" not in family_ptx("rmsnorm", "sm_80")


def test_gemv_issues_weight_loads_before_waiting() -> None:
    body = entry_bodies(family_ptx("gemv", "sm_90a"))["gemv_bf16_b1"]
    assert body.index("ld.global.nc.L1::no_allocate") < body.index("griddepcontrol.wait")
