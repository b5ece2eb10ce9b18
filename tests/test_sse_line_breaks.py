"""A streamed chunk whose text holds a character Python's splitlines counts as a line break (NEL, U+2028,
U+2029) stays one SSE data line: the server escapes those characters in its JSON, and the replay client
ends lines only where the SSE grammar does (CR LF, LF, CR), so a raw one from another server is no break
either. A random-weights model emits such tokens; a cut line was an unparseable half of a chunk."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from ninfer_rt.replay.sse_lines import sse_lines
from ninfer_rt.serve.jobs import sse_event

AWKWARD = "a\x85b\u2028c\u2029d"  # JSON may carry these raw; the control characters it escapes itself


def collect(chunks: list[str]) -> list[str]:
    async def source() -> AsyncIterator[str]:
        for chunk in chunks:
            yield chunk

    async def run() -> list[str]:
        return [line async for line in sse_lines(source())]

    return asyncio.run(run())


def test_the_servers_data_line_is_one_line_to_splitlines_and_parses_back() -> None:
    event = sse_event({"text": AWKWARD + "\x0c\x1c"}, name="delta")
    lines = event.splitlines()
    assert lines[0] == "event: delta" and lines[2:] == [""]
    assert json.loads(lines[1].removeprefix("data: ")) == {"text": AWKWARD + "\x0c\x1c"}


@pytest.mark.parametrize("cut", range(1, 12))
def test_lines_end_at_crlf_lf_and_cr_wherever_the_chunks_are_cut(cut: int) -> None:
    stream = "data: 1\r\ndata: 2\ndata: 3\r\r\ndata: 4"
    chunks = [stream[i:i + cut] for i in range(0, len(stream), cut)]
    assert collect(chunks) == ["data: 1", "data: 2", "data: 3", "", "data: 4"]


def test_a_raw_unicode_line_break_inside_a_data_line_does_not_end_it() -> None:
    line = 'data: {"text": "' + AWKWARD + '"}'
    assert collect([line[:17], line[17:] + "\n\n", "data: [DONE]\n\n"]) == [line, "", "data: [DONE]", ""]
    assert json.loads(collect([line + "\n"])[0].removeprefix("data: ")) == {"text": AWKWARD}
