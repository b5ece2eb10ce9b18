"""How many KV pages to allocate (--kv-capacity auto|PAGES) and which requests can ever fit (--max-context).

`auto` on a GPU: the free device memory left after the weights and the activation workspace are allocated,
minus a safety margin (cuBLASLt workspaces, graph pools, fragmentation), divided by the bytes one page costs
across all layers. On the CPU executor memory is not the constraint, so a fixed default is used.

A request whose prompt plus requested output exceeds the context limit (the smaller of --max-context and
the whole pool) is refused up front with `ContextTooLong`; it could never be scheduled, and discovering
that in the middle of a step would strand the other lane.
"""

from __future__ import annotations

from ninfer_rt.kv.cache import KVSpec

CPU_DEFAULT_PAGES = 4096
DEFAULT_SAFETY_MARGIN_BYTES = 1 << 30


class ContextTooLong(ValueError):
    def __init__(self, needed: int, limit: int) -> None:
        super().__init__(f"request needs {needed} tokens of context; the limit is {limit} tokens")
        self.needed = needed
        self.limit = limit


def bytes_per_page(spec: KVSpec) -> int:
    """One page across every layer (values and, for int8, scales); `spec.num_pages` is ignored."""
    return spec.bytes_per_page_per_layer() * spec.num_layers


def pages_for_capacity(spec: KVSpec, free_bytes: int, margin: int = DEFAULT_SAFETY_MARGIN_BYTES) -> int:
    """Pages that fit in `free_bytes - margin`; raises when not even one does."""
    pages = (free_bytes - margin) // bytes_per_page(spec)
    if pages < 1:
        raise ValueError(
            f"no room for KV pages: {free_bytes} bytes free, {margin} kept as margin, "
            f"{bytes_per_page(spec)} bytes per page"
        )
    return int(pages)


def resolve_kv_capacity(option: str, spec: KVSpec, free_bytes: int | None, margin: int = DEFAULT_SAFETY_MARGIN_BYTES) -> int:
    """--kv-capacity: 'auto' (free device memory, or CPU_DEFAULT_PAGES when `free_bytes` is None) or a count."""
    if option == "auto":
        return CPU_DEFAULT_PAGES if free_bytes is None else pages_for_capacity(spec, free_bytes, margin)
    pages = int(option)
    if pages < 1:
        raise ValueError(f"--kv-capacity must be 'auto' or a positive page count, got {option!r}")
    return pages


def context_limit(max_context: int, num_pages: int, page_size: int) -> int:
    return min(max_context, num_pages * page_size)


def check_fits(needed_tokens: int, limit: int) -> None:
    if needed_tokens > limit:
        raise ContextTooLong(needed_tokens, limit)
