"""The shape of a speculative step's draft tree: what every speculation policy chooses, and what
the engines run (`fastgrpo/engines/embedded/tree.py` drafts and verifies it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecConfig:
    depth: int  # draft levels (longest path that can be accepted)
    topk: int  # children per expanded node, and nodes expanded per level
    num_verify: int  # tokens per sequence in the verify forward, root included

    def __post_init__(self) -> None:
        if self.depth < 1 or self.topk < 1 or self.num_verify < 2:
            raise ValueError(f"invalid speculation config {self}")
        if self.num_verify - 1 > self.topk + (self.depth - 1) * self.topk**2:
            raise ValueError(f"{self}: the tree has fewer nodes than num_verify - 1")

    @property
    def name(self) -> str:
        return f"d{self.depth}k{self.topk}n{self.num_verify}"
