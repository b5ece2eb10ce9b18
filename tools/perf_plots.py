"""The data behind docs/img/*.png, taken from the current figures, and its drawing (matplotlib, imported lazily).

A plot is a dict: name, title, axis labels, kind ("line": each series has its own x; "bar": series share the
categories, a missing figure is None). docs/img/plots.json holds them all, so the committed plots can be checked
against the results without comparing PNG bytes.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

from perf_benches import DECODE, PREFILL, TORCH
from perf_data import Current, history

Plot = dict[str, Any]
FORMATS = ("bf16", "int8", "int4")
SHORT_CONTEXT = 256


def _decode_rows(found: dict[str, Current]) -> list[dict[str, Any]]:
    return [r for r in found[DECODE.name].rows if r["shape"] == "qwen3-8b" and r["dependent_launch"] is True]


def _short(rows: list[dict[str, Any]], weights: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["weights"] == weights and r["kv_dtype"] == "bf16" and r["context"] == SHORT_CONTEXT), None)


def _torch_short(found: dict[str, Current], weights: str) -> dict[str, Any] | None:
    rows = [r for r in found[TORCH.name].rows if r["impl"] == "torch-compile" and r["context"] == SHORT_CONTEXT]
    return next((r for r in rows if r["weights"] == weights), None)


def _get(row: dict[str, Any] | None, name: str) -> float | None:
    return None if row is None or row.get(name) is None else round(float(row[name]), 4)


def decode_vs_context(found: dict[str, Current]) -> Plot:
    series = []
    for weights in FORMATS:
        for kv in ("bf16", "int8"):
            rows = [r for r in _decode_rows(found) if r["weights"] == weights and r["kv_dtype"] == kv]
            rows = [r for r in rows if r.get("overlap_tok_s") is not None]
            if rows:
                x = [r["context"] for r in rows]
                series.append({"label": f"{weights} weights, {kv} KV", "x": x, "y": [_get(r, "overlap_tok_s") for r in rows]})
    return {"name": "decode_context", "kind": "line", "title": "qwen3-8b shape, batch-1 decode, engine loop (overlap)",
            "x_label": "context (tokens)", "y_label": "tokens/s", "series": series}


def roofline_by_format(found: dict[str, Current]) -> Plot:
    rows = _decode_rows(found)
    return {"name": "roofline_fraction", "kind": "bar", "title": "Fraction of the copy roofline, context 256, bf16 KV",
            "x_label": "weights", "y_label": "of roofline", "categories": list(FORMATS), "series": [
                {"label": "ours, each token read back", "y": [_get(_short(rows, w), "roofline_fraction") for w in FORMATS]},
                {"label": "ours, engine loop (overlap)", "y": [_get(_short(rows, w), "overlap_fraction") for w in FORMATS]},
                {"label": "torch.compile, each token read back",
                 "y": [_get(_torch_short(found, w), "roofline_fraction") for w in FORMATS]}]}


def peers(found: dict[str, Current]) -> Plot:
    rows = _decode_rows(found)
    return {"name": "peers", "kind": "bar", "title": "Decode tokens/s against torch, context 256, bf16 KV (same H200)",
            "x_label": "weights", "y_label": "tokens/s", "categories": list(FORMATS), "series": [
                {"label": "ours, each token read back", "y": [_get(_short(rows, w), "tok_s") for w in FORMATS]},
                {"label": "torch.compile", "y": [_get(_torch_short(found, w), "tok_s") for w in FORMATS]}]}


def agent_turn_ttft(results: Path) -> Plot:
    series = []
    for kv in ("bf16", "int8"):
        runs = history(PREFILL, results, {"cached": 114281, "tokens": 531, "kv_dtype": kv}, "ms")
        series.append({"label": f"{kv} KV", "x": [date for date, _, _ in runs], "commits": [c for _, c, _ in runs],
                       "y": [round(ms, 2) for _, _, ms in runs]})
    return {"name": "agent_turn_ttft", "kind": "line", "title": "Agent turn: 114,281 cached + 531 new tokens, "
            "time to first token, every committed tree measured", "x_label": "measured (UTC)", "y_label": "ms",
            "series": series}


def prefill_vs_gemm(found: dict[str, Current]) -> Plot:
    rows = found[PREFILL.name].rows
    names = [f"{r['cached']:,} + {r['tokens']:,}, {r['kv_dtype']} KV" for r in rows]
    return {"name": "prefill_gemm", "kind": "bar", "title": "Prefill rate against the GEMM rate of the same run",
            "x_label": "cached + new tokens", "y_label": "TFLOP/s", "categories": names, "series": [
                {"label": "prefill (GEMM + attention FLOPs)", "y": [_get(r, "TFLOPs") for r in rows]},
                {"label": "cuBLASLt bf16 GEMM", "y": [_get(r, "gemm_TFLOPs") for r in rows]}]}


def plots(found: dict[str, Current], results: Path) -> list[Plot]:
    return [decode_vs_context(found), roofline_by_format(found), agent_turn_ttft(results),
            prefill_vs_gemm(found), peers(found)]


def draw(plot: Plot, out: Path) -> None:
    import matplotlib
    import matplotlib.dates

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    if plot["kind"] == "line":
        for s in plot["series"]:
            xs = [datetime.fromisoformat(x) for x in s["x"]] if "commits" in s else s["x"]
            ax.plot(xs, s["y"], marker="o", label=s["label"])
        if plot["series"] and "commits" in plot["series"][0]:
            ax.xaxis.set_major_formatter(matplotlib.dates.DateFormatter("%m-%d %H:%M"))
        else:
            ax.set_xscale("log")
    else:
        width = 0.8 / max(1, len(plot["series"]))
        for i, s in enumerate(plot["series"]):
            xs = [j + i * width for j, y in enumerate(s["y"]) if y is not None]
            ax.bar(xs, [y for y in s["y"] if y is not None], width, label=s["label"])
        ax.set_xticks([j + width * (len(plot["series"]) - 1) / 2 for j in range(len(plot["categories"]))])
        ax.set_xticklabels(plot["categories"], fontsize=8)
    ax.set_title(plot["title"], fontsize=10)
    ax.set_xlabel(plot["x_label"])
    ax.set_ylabel(plot["y_label"])
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / f"{plot['name']}.png")
    plt.close(fig)
