"""Speculation policies: how much to speculate at a decode step, given how many sequences run.

All policies run inside the same engine, so they compare fairly. `choose` returns None for plain
decoding (one token per sequence per target forward).
"""

from __future__ import annotations

import math
from typing import Protocol

from fastgrpo.speculation.tree import SpecConfig


class SpeculationPolicy(Protocol):
    name: str

    def choose(self, running: int) -> SpecConfig | None: ...

    def observe(self, config: SpecConfig | None, running: int, emitted: int, seconds: float) -> None: ...


class Off:
    name = "off"

    def choose(self, running: int) -> SpecConfig | None:
        return None

    def observe(self, config: SpecConfig | None, running: int, emitted: int, seconds: float) -> None:
        pass


class Static(Off):
    """One fixed tree shape at every concurrency (what static speculative systems do)."""

    name = "static"

    def __init__(self, config: SpecConfig):
        self.config = config

    def choose(self, running: int) -> SpecConfig | None:
        return self.config


class FastGRPOFormula(Off):
    """FastGRPO's published rule (DESIGN.md 5.3), guarded: with a fixed capacity C = 160 verify
    tokens, n = min(C // B, 160) per sequence, depth = clamp(floor(log2(n / 0.75)), 3, 5),
    top-k = min(n - 1, 8). Where the original would build an empty tree (B > 80) or crash (B > 160),
    this falls back to plain decoding."""

    name = "fastgrpo"
    capacity = 160

    def choose(self, running: int) -> SpecConfig | None:
        n = min(self.capacity // max(running, 1), 160)
        topk = min(n - 1, 8)
        if n < 2 or topk < 1:
            return None
        depth = min(max(int(math.floor(math.log2(n / 0.75))), 3), 5)
        max_nodes = topk + (depth - 1) * topk**2
        return SpecConfig(depth=depth, topk=topk, num_verify=min(n, max_nodes + 1))


def make_policy(cfg: "SpeculationConfig") -> SpeculationPolicy:  # noqa: F821 (config imports engine types)
    if cfg.policy == "off":
        return Off()
    if cfg.policy == "static":
        return Static(SpecConfig(cfg.depth, cfg.topk, cfg.num_verify))
    if cfg.policy == "fastgrpo":
        return FastGRPOFormula()
    raise ValueError(f"speculation.policy {cfg.policy!r} is not available")
