"""ninfer-rt: a CUDA inference runtime for Qwen-family models.

    from ninfer_rt import Engine, EngineConfig, SamplingParams

The names load on first use, so `import ninfer_rt` stays cheap (the CLI and tools import submodules directly).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Engine": "ninfer_rt.engine.engine",
    "EngineConfig": "ninfer_rt.engine.build",
    "SamplingParams": "ninfer_rt.engine.request",
}
__all__ = ["Engine", "EngineConfig", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ninfer_rt' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
