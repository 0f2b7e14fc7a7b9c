"""A GRPO run's state: what `fastgrpo.run_setup` builds, the loop (`fastgrpo.train`) advances step by
step and `fastgrpo.run_checkpoint` saves and restores; and what a call of the loop returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fastgrpo.bridge import WeightBridge
from fastgrpo.checkpoint import CheckpointManager
from fastgrpo.config import Config
from fastgrpo.distributed import World
from fastgrpo.grpo.record import StepRecord
from fastgrpo.models.tokenizer import TextFormat
from fastgrpo.protocols import DraftLearner, Engine, PolicyTrainer
from fastgrpo.tasks.rewards import Reward, math_reward
from fastgrpo.tasks.source import EncodedProblem, PromptSource
from fastgrpo.tracking import Tracker


@dataclass
class TrainResult:
    steps: list[StepRecord]  # the record of every step this call ran
    evals: dict[int, dict[str, float]]  # eval results by step
    checkpoint: Path | None = None  # the last checkpoint this call saved
    stopped: bool = False  # ended early by SIGTERM, after checkpointing


@dataclass
class Run:
    cfg: Config
    text: TextFormat  # the checkpoint's tokenizer and how prompts and responses are written
    trainer: PolicyTrainer
    engine: Engine | None  # on the ranks that lead an engine
    bridge: WeightBridge
    data: PromptSource
    eval_problems: list[EncodedProblem]
    tracker: Tracker
    checkpoints: CheckpointManager
    draft_learner: DraftLearner | None = None
    world: World = field(default_factory=World)
    step: int = 0
    history: TrainResult = field(default_factory=lambda: TrainResult([], {}))  # every step so far, resumes too
    reward: Reward = field(default_factory=math_reward)  # task.reward's, scoring rollout and eval
