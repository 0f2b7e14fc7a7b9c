"""How every benchmark ends: its JSON (and plot) on disk, its BENCHMARKS.md section on stdout."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def command_line(what: str, quick: bool, output: Path, extra: list[str] | None = None) -> str:
    """The command that reproduces a benchmark: `extra` holds its key=value overrides and other flags."""
    return " ".join(["fastgrpo bench", what, *(extra or []), *(["--quick"] if quick else []), "--output", str(output)])


def publish(result: dict, output: Path, command: str, markdown: Callable[[dict, str], str],
            plot: Callable[[Path], None] | None = None) -> None:
    """Write `output` (and `plot` to the PNG beside it), then print the section with the command that
    reproduces it."""
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2))
    written = [output]
    if plot is not None:
        plot(output.with_suffix(".png"))
        written.append(output.with_suffix(".png"))
    seconds = result.get("meta", {}).get("seconds")
    print(f"wrote {' and '.join(map(str, written))}" + (f" ({seconds:.0f}s)" if seconds else "") + "\n", flush=True)
    print(markdown(result, command), flush=True)
