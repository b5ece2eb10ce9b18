"""Write a profile's trace: `python tools/traces.py agent --scale 1 -o agent.jsonl` (see ninfer_rt/replay/profiles.py).

Profiles: 1 prefix-saturation, 2 long-conversation, 3 tools-thinking, 4 dual-lane, 5 system-rotation,
6 unaligned-tail, 7 agent; `mixed` is all seven at once (the soak). Replay the file with `ninfer-rt replay FILE --url URL`.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from ninfer_rt.replay.profiles import MIXED, PROFILES, make_profile
from ninfer_rt.replay.trace import TraceStats, write_trace


@click.command()
@click.argument("profile")
@click.option("--scale", default=1.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="1.0 is the GPU full-scale run; CI uses ~0.05.")
@click.option("-o", "--out", "out_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Output file (default: PROFILE.jsonl).")
def main(profile: str, scale: float, out_path: Path | None) -> None:
    """Write PROFILE (a name, 1..7 or mixed) as a JSON-lines trace."""
    try:
        turns = make_profile(profile, scale)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="PROFILE") from None
    name = profile if profile in (*PROFILES, MIXED) else list(PROFILES)[int(profile) - 1]
    out_path = out_path or Path(f"{name}.jsonl")
    write_trace(turns, out_path)
    click.echo(f"{out_path}: {json.dumps(TraceStats.of(turns).as_json())}")


if __name__ == "__main__":
    main()
