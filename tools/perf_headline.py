"""The README's headline figures: a few current rows of docs/performance.md's tables, each linking to its section.

tools/perf_report.py writes them between the README's two markers (START, END) from the same current rows as
the page, each figure formatted by the page's own column, so the README cannot drift from the page. A headline
whose row is not current (a configuration no longer measured) stops the report instead of vanishing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from perf_benches import DECODE, GATED_DELTANET, PREFILL, REPLAY, TORCH
from perf_data import Bench, Current, cell

START = "<!-- headline figures: written by tools/perf_report.py from bench/results, do not edit -->"
END = "<!-- end of the headline figures -->"
PAGE = "docs/performance.md"
GPU, SHAPE = "NVIDIA H200", "qwen3-8b"
SHORT, LONG = 256, 114_812
HEADER = "| what | ninfer-rt | of roofline | torch and fla-core on the same GPU |\n| --- | --- | --- | --- |"

Row = dict[str, Any]


@dataclass(frozen=True)
class Line:
    what: str
    bench: Bench  # the section of the page it links to
    rows: tuple[Row, ...]  # the page's rows it quotes, ours first
    ours: str
    fraction: str = ""
    peers: str = ""

    def markdown(self) -> str:
        link = f"[{self.what}]({PAGE}#{anchor(self.bench.name)})"
        return f"| {link} | {self.ours} | {self.fraction} | {self.peers} |"


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation other than - and _ dropped, each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def pick(found: dict[str, Current], bench: Bench, **where: Any) -> Row:
    rows = [r for r in found[bench.name].rows if all(r.get(k) == v for k, v in where.items())]
    if len(rows) != 1:
        raise LookupError(f"{bench.name}: {len(rows)} current rows where {where}, not one")
    return rows[0]


def fig(bench: Bench, row: Row, field: str) -> str:
    """The row's figure as the page prints it."""
    return cell(row, next(c for c in bench.key + bench.figures if c.field == field))


Peer = tuple[str, str, str]  # label, torch implementation, torch weights


def decode(found: dict[str, Current], weights: str, kv: str, context: int, peers: tuple[Peer, ...] = ()) -> Line:
    """A batch-1 decode configuration, torch's at the same weights, KV and context beside."""
    where = {"gpu": GPU, "shape": SHAPE, "kv_dtype": kv, "context": context}
    row = pick(found, DECODE, weights=weights, dependent_launch=True, **where)
    torch = [pick(found, TORCH, impl=impl, weights=torch_weights, **where) for _, impl, torch_weights in peers]
    beside = [f"{label} {fig(TORCH, r, 'tok_s')} tok/s ({fig(TORCH, r, 'roofline_fraction')})"
              for (label, _, _), r in zip(peers, torch)]
    grouped = "" if weights == "bf16" else " (group 128)"  # tools/bench_decode.py's quantized projections
    return Line(
        f"decode, {weights} weights{grouped}, {kv} KV, context {context:,}", DECODE, (row, *torch),
        f"{fig(DECODE, row, 'tok_s')} tok/s ({fig(DECODE, row, 'overlap_tok_s')} in the engine loop)",
        f"{fig(DECODE, row, 'roofline_fraction')} ({fig(DECODE, row, 'overlap_fraction')})", "; ".join(beside),
    )


def prefill(found: dict[str, Current]) -> Line:
    row = pick(found, PREFILL, gpu=GPU, shape=SHAPE, cached=0, tokens=8192, kv_dtype="bf16")
    return Line(
        f"prefill, {fig(PREFILL, row, 'tokens')} tokens", PREFILL, (row,),
        f"{fig(PREFILL, row, 'ms')} ms, {fig(PREFILL, row, 'TFLOPs')} TFLOP/s",
        f"{fig(PREFILL, row, 'gemm_fraction')} of GEMM",
    )


def agent_turn(found: dict[str, Current]) -> Line:
    where = {"gpu": GPU, "shape": SHAPE, "cached": 114_281, "tokens": 531}
    rows = tuple(pick(found, PREFILL, kv_dtype=kv, **where) for kv in ("bf16", "int8"))
    return Line(
        f"agent turn, {fig(PREFILL, rows[0], 'cached')} cached + {fig(PREFILL, rows[0], 'tokens')} new, bf16 / int8 KV",
        PREFILL, rows, " / ".join(fig(PREFILL, r, "ms") for r in rows) + " ms to the first token",
        " / ".join(fig(PREFILL, r, "gemm_fraction") for r in rows) + " of GEMM",
    )


def replay(found: dict[str, Current]) -> Line:
    row = pick(found, REPLAY, gpu=GPU, model=SHAPE, profile="agent")
    return Line(
        f"agent replay, {fig(REPLAY, row, 'requests')} requests, {fig(REPLAY, row, 'lanes')} lanes", REPLAY, (row,),
        f"TTFT p50 {fig(REPLAY, row, 'ttft_ms.p50')} ms, inter-token p50 {fig(REPLAY, row, 'itl_ms.p50')} ms",
        f"cached ratio {fig(REPLAY, row, 'cached_ratio')}",
    )


def delta_rule(found: dict[str, Current], what: str, ours: str, theirs: str, tokens: int, fraction: bool) -> Line:
    """One Gated DeltaNet layer's delta rule at the 27B shape, fla-core's kernel beside (us a call). The fraction
    of the copy bandwidth is shown for the memory-bound decode only: the chunked prefill is bound by compute."""
    row = pick(found, GATED_DELTANET, gpu=GPU, kernel=ours, T=tokens, states_kept=1)
    peer = pick(found, GATED_DELTANET, gpu=GPU, kernel=theirs, T=tokens, states_kept=1)
    of_copy = f"{fig(GATED_DELTANET, row, 'of_copy_bw')} of copy bandwidth" if fraction else ""
    what = f"Gated DeltaNet delta rule (27B layer), {what}, {tokens:,} {'token' if tokens == 1 else 'tokens'}"
    us = [f"{fig(GATED_DELTANET, r, 'us')} us" for r in (row, peer)]
    return Line(what, GATED_DELTANET, (row, peer), us[0], of_copy, f"{theirs} {us[1]}")


def lines(found: dict[str, Current]) -> list[Line]:
    return [
        decode(found, "bf16", "bf16", SHORT,
               (("torch.compile", "torch-compile", "bf16"), ("HF eager", "torch-eager", "bf16"))),
        decode(found, "bf16", "bf16", LONG),
        decode(found, "bf16", "int8", LONG),
        decode(found, "int8", "bf16", SHORT, (("torch.compile, gpt-fast's int8", "torch-compile", "int8-linear"),)),
        decode(found, "int4", "bf16", SHORT, (("torch.compile, tinygemm", "torch-compile", "int4"),)),
        prefill(found),
        agent_turn(found),
        replay(found),
        delta_rule(found, "decode", "ninfer recurrent", "fla fused_recurrent", 1, fraction=True),
        # the split form (the executor's default) with 32 value columns a block of its sequential pass, as on the H200
        delta_rule(found, "chunked prefill", "ninfer split c32", "fla chunk", 8192, fraction=False),
    ]


def headline(found: dict[str, Current]) -> str:
    """The README's block: where and when the figures were measured, then the table."""
    table = lines(found)
    dates = sorted(str(r["date"])[:10] for line in table for r in line.rows)
    copy = sorted({fig(DECODE, line.rows[0], "copy_bw_TBs") for line in table if line.bench is DECODE})
    caption = (f"{GPU}, {SHAPE} shape unless named, batch 1; measured {dates[0]} to {dates[-1]}; the decode runs' copy "
               f"bandwidth {' / '.join(copy)} TB/s.")
    return "\n".join([caption, "", HEADER] + [line.markdown() for line in table])


def with_headline(readme: str, block: str) -> str:
    """The README with `block` between its markers, the rest as it was."""
    before, start, rest = readme.partition(START + "\n")
    _, end, after = rest.partition(END + "\n")
    if not start or not end:
        raise ValueError(f"README.md lacks the headline markers {START!r} and {END!r}")
    return before + START + "\n" + block + "\n" + END + "\n" + after
