"""The lines of a server-sent event stream, as the SSE grammar ends them: at CR LF, LF or CR alone.

Not at the other line breaks Python's str.splitlines knows (NEL, U+2028, U+2029, form feed...), as httpx's
iter_lines does: those may sit raw inside a JSON string in a data field, and cutting there leaves two
halves neither of which parses.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

_LINE_END = re.compile(r"\r\n|\r|\n")


async def sse_lines(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    pending = ""
    async for text in chunks:
        pending += text
        # a CR closing the text may be the first half of a CR LF: decide once the next text arrives
        held_cr = pending.endswith("\r")
        lines = _LINE_END.split(pending[:-1] if held_cr else pending)
        pending = lines.pop() + ("\r" if held_cr else "")
        for line in lines:
            yield line
    for line in _LINE_END.split(pending):
        if line:
            yield line
