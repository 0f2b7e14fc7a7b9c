"""The seams that make backends swappable (DESIGN.md section 4).

A rollout engine (embedded on CPU, SGLang on GPU) and a policy trainer (torch, Megatron) only meet
through these protocols and the weight bridge.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from torch import Tensor

from fastgrpo.engine.sampling import SamplingParams


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]
    max_new_tokens: int | None = None  # None: the sampling params' limit


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # of the sampling distribution, one per token
    finish_reason: str  # "stop" (EOS), "length" (max_new_tokens), "context" (context full)
    spec: dict[str, float] = field(default_factory=dict)  # speculation statistics
    # with capture on: the target's final hidden states at positions 0..T-2 of prompt + response, taken
    # from the forwards that rollout ran anyway; hidden[t] is the state after reading token t
    hidden: Tensor | None = None


class Engine(Protocol):
    def generate(self, requests: list[Request], sampling: SamplingParams, seed: int = 0) -> list[Completion]: ...
    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None: ...
    def update_draft(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None: ...
    def release_memory(self) -> None: ...
    def resume_memory(self) -> None: ...
    def stats(self) -> dict[str, Any]: ...


class PolicyTrainer(Protocol):
    def logprobs(self, batch: Any) -> Tensor: ...
    def train_step(self, batch: Any) -> dict[str, float]: ...
    def export_weights(self) -> Iterator[tuple[str, Tensor]]: ...
    def save(self, directory: Path) -> None: ...
    def load(self, directory: Path) -> None: ...
