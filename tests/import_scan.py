"""What a source file imports, read from its syntax tree (for the layering tests)."""

from __future__ import annotations

import ast
from pathlib import Path


def imported_modules(path: Path) -> set[str]:
    """Every module an `import` or `from ... import` in `path` names (relative imports excluded), at any
    depth: inside functions and `if TYPE_CHECKING:` blocks too."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names
