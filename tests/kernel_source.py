"""The kernels' own constants, read from kernels_src (for the tests that check the host-side mirrors)."""

from __future__ import annotations

import re
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[1] / "kernels_src"


def constexpr_int(source: str, name: str) -> int:
    """The value of the file-scope `constexpr int name = <literal>;` in kernels_src/`source`."""
    text = (KERNELS / source).read_text()
    found = re.findall(rf"^constexpr int {name} = (\d+);", text, flags=re.MULTILINE)
    assert len(found) == 1, f"{source}: expected one file-scope constexpr int {name}, found {len(found)}"
    return int(found[0])
