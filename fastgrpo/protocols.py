"""The seams that make backends swappable.

A rollout engine (embedded on CPU, SGLang on GPU), a policy trainer (torch, Megatron) and a draft
learner only meet through these protocols, the shared types (`fastgrpo.types`) and the weight
bridge. The loop and the benchmarks use nothing else of them.

A backend's module is imported only when chosen (`import_backend`, by the factories
`fastgrpo.trainers.build_trainer` and `fastgrpo.engines.build_engine`), so an uninstalled one costs
nothing until asked for, and then fails with the install command (`BackendUnavailable`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Protocol

from torch import Tensor

from fastgrpo.speculation.policy import SpeculationPolicy
from fastgrpo.types import Completion, EngineStats, Placement, Request, RolloutBatch, SamplingParams

NamedTensors = Iterable[tuple[str, Tensor]]  # Hugging Face names and full tensors
DraftUpdate = tuple[NamedTensors, int]  # a draft's weights and its version


class BackendUnavailable(ImportError):
    """A configured backend whose libraries are not installed."""


def import_backend(module: str, key: str, name: str, extra: str | None = None, hint: str | None = None) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        hint = f"; {hint}" if hint else f"; install it with `pip install -e \".[{extra}]\"`" if extra else ""
        raise BackendUnavailable(f"{key}={name} cannot be used here: {e}{hint}") from e


class WeightConsumer(Protocol):
    """Whatever holds a copy of the policy's weights: engines, and the draft learner (its embedding
    and LM head are the policy's)."""

    def update_weights(self, named_tensors: NamedTensors, version: int, complete: bool = True) -> None:
        """Tensors of policy `version`: all of them, or (`complete=False`) a bucket of a streamed push."""

    def commit_weights(self, version: int, checksums: dict[str, int] | None = None) -> None:
        """A streamed push of `version` is whole; `checksums`: the sender's, per tensor name."""


class Engine(WeightConsumer, Protocol):
    # polled between decode steps for a newer draft (async draft learning); None: no source
    draft_source: Callable[[], DraftUpdate | None] | None

    def generate(self, requests: list[Request], sampling: SamplingParams, seed: int = 0,
                 capture: bool = False, routing: bool = False) -> list[Completion]:
        """Completions in request order. `capture`: each completion also carries the target's hidden
        states (what online draft learning trains on), taken from the forwards rollout runs anyway.
        `routing`: a mixture of experts' completions carry the experts each position ran (routing
        replay, `trainer.routing_replay`)."""
        ...

    def update_draft(self, named_tensors: NamedTensors, version: int) -> None: ...
    def set_speculation(self, policy: SpeculationPolicy) -> None: ...
    def release_memory(self) -> None: ...
    def resume_memory(self) -> None: ...
    def stats(self) -> EngineStats:
        """The last generate() call: tokens/s, accepted length, decode and speculative steps, ... (every
        key in `fastgrpo.types.EngineStats`)"""
        ...


class PolicyTrainer(Protocol):
    def logprobs(self, batch: RolloutBatch) -> Tensor: ...
    def train_step(self, batch: RolloutBatch) -> dict[str, float]: ...
    def export_weights(self) -> Iterator[tuple[str, Tensor]]: ...
    def save(self, directory: Path) -> None: ...
    def load(self, directory: Path) -> None: ...
    def placement(self) -> Placement: ...


class DraftLearner(WeightConsumer, Protocol):
    """Online draft learning (sync in process, or async on draft ranks)."""

    def learn(self, prompts: list[list[int]], completions: list[Completion], policy_version: int,
              budget_s: float) -> dict[str, float]: ...
    def save(self, directory: Path) -> None: ...
    def load(self, directory: Path) -> None: ...
    def close(self) -> None: ...
