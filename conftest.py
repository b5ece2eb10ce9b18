"""Repository-wide test set-up: the ordering verifier is on in every test; `gpu` tests skip without a GPU."""

import os

os.environ.setdefault("NINFER_VERIFY_ORDERING", "1")
# The numpy executor's matrices are tiny: BLAS threads only fight each other (2-3x slower on 2 cores).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402


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
