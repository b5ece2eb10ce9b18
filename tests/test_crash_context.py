"""Crash context: an injected sticky CUDA error at a sync point dumps one JSON document and fails loudly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cuda.bindings import driver as cu

from ninfer_rt.cuda.driver import CudaError
from ninfer_rt.cuda.streams import FatalCudaError, StreamSet
from ninfer_rt.ordering import Span
from ninfer_rt.ordering.crash import RING_LENGTH, CrashContext


def launch_failure() -> None:
    raise CudaError("cuStreamSynchronize", cu.CUresult.CUDA_ERROR_LAUNCH_FAILED, "unspecified launch failure")


def traffic(streams: StreamSet) -> None:
    """A little of two lanes' work on two streams, as the engine would enqueue it."""
    compute, copy = streams.create("compute"), streams.create("copy")
    copy.declare("publish block table", reads=(Span("staging", 0, 256),), writes=("block_table",), lane="req-1")
    compute.wait(copy.record())
    compute.declare("decode attention", reads=("block_table", ("kv", 17)), writes=("attn_out",), lane="req-1")
    compute.declare("lm_head", reads=("attn_out",), writes=("logits",), lane="req-2")


def fail_at_sync(streams: StreamSet) -> FatalCudaError:
    with pytest.raises(FatalCudaError) as caught:
        streams.synchronized(launch_failure, "synchronize compute")
    return caught.value


@pytest.fixture
def crashed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[FatalCudaError, dict]:
    monkeypatch.setenv("NINFER_CRASH_DIR", str(tmp_path))
    streams = StreamSet(verify=True)
    traffic(streams)
    streams.crash.add_section("lanes", lambda: {"req-1": {"frontier": 130}, "req-2": {"frontier": 64}})
    streams.crash.add_section("kv_transactions", lambda: [{"kind": "cow_tail", "src_page": 17, "dst_page": 40}])
    error = fail_at_sync(streams)
    return error, json.loads(Path(error.crash_file).read_text())


def test_hazard_injected_launch_failure_dumps_valid_json_naming_the_last_ops_of_each_stream(crashed: tuple) -> None:
    _, doc = crashed
    last = {stream: [op["label"] for op in ops] for stream, ops in doc["streams"].items()}
    assert last["stream:copy"] == ["publish block table"]
    assert last["stream:compute"] == ["decode attention", "lm_head"]
    assert doc["streams"]["stream:compute"][0]["lane"] == "req-1"
    assert doc["streams"]["stream:copy"][0]["reads"] == [{"key": "'staging'", "start": 0, "end": 256}]


def test_hazard_injected_failure_dump_includes_the_engine_sections(crashed: tuple) -> None:
    _, doc = crashed
    assert doc["lanes"]["req-2"] == {"frontier": 64}
    assert doc["kv_transactions"][0]["kind"] == "cow_tail"


def test_hazard_fatal_error_names_the_crash_file_and_the_cuda_error(crashed: tuple) -> None:
    error, doc = crashed
    assert error.crash_file in str(error)
    assert "CUDA_ERROR_LAUNCH_FAILED" in str(error)
    assert "CUDA_ERROR_LAUNCH_FAILED" in doc["error"]


def test_a_non_sticky_cuda_error_is_re_raised_without_a_dump(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NINFER_CRASH_DIR", str(tmp_path))

    def not_ready() -> None:
        raise CudaError("cuEventQuery", cu.CUresult.CUDA_ERROR_INVALID_VALUE, "invalid argument")

    with pytest.raises(CudaError):
        StreamSet().synchronized(not_ready, "query")
    assert list(tmp_path.iterdir()) == []


def test_the_ring_keeps_only_the_most_recent_ops_of_a_stream() -> None:
    streams = StreamSet(verify=False)
    compute = streams.create("compute")
    for step in range(RING_LENGTH + 10):
        compute.declare(f"step {step}")

    ops = streams.crash.snapshot()["streams"]["stream:compute"]
    assert len(ops) == RING_LENGTH
    assert ops[-1] == {"seq": RING_LENGTH + 10, "label": f"step {RING_LENGTH + 9}", "lane": None, "reads": [], "writes": []}


def test_a_failing_section_provider_does_not_hide_the_crash(tmp_path: Path) -> None:
    crash = CrashContext()
    crash.add_section("lanes", lambda: 1 / 0)

    doc = json.loads(crash.dump(tmp_path / "crash.json").read_text())

    assert "ZeroDivisionError" in doc["lanes"]


def test_a_section_may_not_overwrite_the_dumps_own_fields() -> None:
    with pytest.raises(ValueError, match="streams"):
        CrashContext().add_section("streams", lambda: {})


def test_two_dumps_in_one_process_get_two_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NINFER_CRASH_DIR", str(tmp_path))
    crash = CrashContext()
    assert crash.dump() != crash.dump()


def test_after_a_sticky_error_every_enqueue_refuses_instead_of_launching_into_the_dead_context(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NINFER_CRASH_DIR", str(tmp_path))
    streams = StreamSet(verify=True)
    compute = streams.create("compute")
    error = fail_at_sync(streams)
    ops_before = compute.ring.seq
    with pytest.raises(FatalCudaError) as again:
        compute.declare("decode attention", reads=(("kv", 3),), writes=("attn_out",))
    assert again.value is error and compute.ring.seq == ops_before
