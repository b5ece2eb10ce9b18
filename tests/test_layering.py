"""The model is written against the Executor protocol only: it sits below the executors, the KV cache
and the engine, so nothing in ninfer_rt/model imports them (not even for type checking)."""

from __future__ import annotations

from pathlib import Path

from import_scan import imported_modules

import ninfer_rt
from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.kv.cache import KVCache, KVSpec
from ninfer_rt.model.executor import PagedKV

MODEL_PACKAGE = Path(ninfer_rt.__file__).parent / "model"
ABOVE_MODEL = ("ninfer_rt.exec", "ninfer_rt.kv", "ninfer_rt.engine", "ninfer_rt.serve", "ninfer_rt.replay", "ninfer_rt.cli")


def is_above_model(module: str) -> bool:
    return any(module == layer or module.startswith((layer + ".", layer + "_")) for layer in ABOVE_MODEL)


def test_model_imports_nothing_from_the_layers_above_it() -> None:
    offenders = sorted(
        f"{path.relative_to(MODEL_PACKAGE.parent)}: {module}"
        for path in MODEL_PACKAGE.rglob("*.py")
        for module in imported_modules(path)
        if is_above_model(module)
    )
    assert not offenders, f"ninfer_rt/model must not import exec, kv, engine or above: {offenders}"


def test_the_layer_check_names_every_higher_layer() -> None:
    higher = ["ninfer_rt.exec.cuda_exec", "ninfer_rt.kv", "ninfer_rt.engine.engine", "ninfer_rt.cli_generate"]
    assert all(is_above_model(module) for module in higher)
    assert not any(is_above_model(m) for m in ["ninfer_rt.model.config", "ninfer_rt.cuda.streams", "ninfer_rt.kvx"])


def test_the_engines_kv_cache_is_the_models_paged_kv() -> None:
    kv = KVCache(StreamSet(None), KVSpec(num_layers=1, num_pages=2, n_kv_heads=1, head_dim=8, page_size=4))
    assert isinstance(kv, PagedKV)
    assert kv.spec.page_size == 4
