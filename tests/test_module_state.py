"""No device state at module level in ninfer_rt/cuda and ninfer_rt/exec. A module-level mutable container (a
dict, list or set display or comprehension, or a call that makes one) is either a true constant, listed below
and mutated nowhere in the package, or the driver's primary contexts, process-global by the driver's design
(docs/ARCHITECTURE.md, "Layers"). Anything else a device or a sequence needs lives on an owner object."""

from __future__ import annotations

import ast
from pathlib import Path

import ninfer_rt

PACKAGE = Path(ninfer_rt.__file__).parent
SCANNED = ("cuda", "exec")
CONSTANTS = {
    "cuda/blas.py": {"_ELEMENT_BYTES"},
    "cuda/driver.py": {"_STICKY", "_ARCH_SPECIFIC"},
    "cuda/quant_ops.py": {"_EPILOGUE_CODE", "_SCALE_SUFFIX"},
    "exec/cuda_attention.py": {"_VARIANTS"},
    "exec/cuda_exec.py": {"_HOST_DTYPE"},
    "exec/cuda_tensors.py": {"ITEMSIZE"},
}
PROCESS_GLOBAL = {"cuda/driver.py": {"_contexts"}}  # cuDevicePrimaryCtxRetain: one context per device per process

CONTAINER_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "Counter", "deque", "bytearray"}
MUTATORS = {
    "append", "extend", "insert", "add", "update", "setdefault", "pop", "popitem", "remove", "discard", "clear",
    "appendleft", "extendleft", "sort", "reverse",
}


def makes_container(value: ast.expr) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        return name in CONTAINER_CALLS
    return False


def module_containers(source: str) -> set[str]:
    """Names bound to a mutable container by a statement at the top level of a module."""
    names: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and makes_container(node.value):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and node.value is not None and makes_container(node.value):
            if isinstance(node.target, ast.Name):
                names.add(node.target.id)
    return names


def _identifier(node: ast.expr) -> str | None:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def mutated_names(source: str) -> set[str]:
    """Names (or attributes) that an item assignment or deletion, an augmented assignment, a mutating method
    call or a `global` statement anywhere in `source` changes."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(_identifier(node.value))
        elif isinstance(node, ast.AugAssign):
            names.add(_identifier(node.target))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            names.add(_identifier(node.func.value))
        elif isinstance(node, ast.Global):
            names.update(node.names)
    return names - {None}


def scanned_containers() -> dict[str, set[str]]:
    found = {}
    for package in SCANNED:
        for path in sorted((PACKAGE / package).rglob("*.py")):
            names = module_containers(path.read_text())
            if names:
                found[path.relative_to(PACKAGE).as_posix()] = names
    return found


def test_every_module_level_container_is_a_listed_constant_or_the_primary_contexts() -> None:
    expected = {path: CONSTANTS.get(path, set()) | PROCESS_GLOBAL.get(path, set()) for path in {*CONSTANTS, *PROCESS_GLOBAL}}
    assert scanned_containers() == expected, "module-level state belongs on an owner object (or here, if constant)"


def test_no_listed_constant_is_mutated_anywhere_in_the_package() -> None:
    constants = set().union(*CONSTANTS.values())
    offenders = sorted(
        f"{path.relative_to(PACKAGE)}: {name}"
        for path in PACKAGE.rglob("*.py")
        for name in mutated_names(path.read_text()) & constants
    )
    assert not offenders, f"a constant is changed after import: {offenders}"


def test_the_scan_finds_each_way_of_making_a_container() -> None:
    source = "from collections import defaultdict\nA = {}\nB: list[int] = []\nC = set()\nD = defaultdict(list)\nE = {k: 1 for k in 'ab'}\n"
    assert module_containers(source) == {"A", "B", "C", "D", "E"}
    immutable = "A = (1, 2)\nB = frozenset({1})\nC = 'text'\ndef f():\n    d = {}\n    return d\n"
    assert module_containers(immutable) == set()


def test_the_scan_finds_each_way_of_mutating_a_name() -> None:
    source = "A[1] = 2\ndel B[0]\nC += [1]\nD.append(1)\nm.E.update({})\ndef f():\n    global F\n"
    assert mutated_names(source) == {"A", "B", "C", "D", "E", "F"}
    assert mutated_names("x = A[1]\nA.get(1)\nlen(B)\n") == set()
