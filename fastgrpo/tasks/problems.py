from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    solution: str | None = None  # worked solution (synthetic task only; used for SFT)
