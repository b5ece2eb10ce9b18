"""Repository-wide test set-up: the ordering verifier is on in every test; `gpu` tests skip without a GPU;
property tests draw fixed examples under CI."""

import os

os.environ.setdefault("NINFER_VERIFY_ORDERING", "1")
# The numpy executor's matrices are tiny: BLAS threads only fight each other (2-3x slower on 2 cores).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

if os.environ.get("CI"):
    # CI runs the property tests on a fixed set of examples, so that a red build is a change's doing and
    # reproduces; anywhere else each run draws new ones. (Imported here only: the GPU machine has no
    # hypothesis, and its property tests are CPU tests.)
    from hypothesis import settings

    settings.register_profile("ci", derandomize=True, database=None)
    settings.load_profile("ci")


def _has_gpu() -> bool:
    from ninfer_rt.cuda.driver import device_count

    return device_count() > 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
