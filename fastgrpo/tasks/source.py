"""Where training prompts come from: the task's problems, tokenized, in a resumable seeded order."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

from fastgrpo.config import TaskConfig
from fastgrpo.models.tokenizer import TextFormat
from fastgrpo.tasks.arithmetic import arithmetic_splits
from fastgrpo.tasks.datasets import DatasetError, LoadReport, load_problems
from fastgrpo.tasks.problems import Problem

log = logging.getLogger(__name__)


@dataclass
class TaskData:
    """The configured source's train and held-out problems, and what loading each dataset file found
    (none for the synthetic task)."""

    train: list[Problem]
    held_out: list[Problem]
    reports: list[LoadReport] = field(default_factory=list)


def load_task_data(cfg: TaskConfig, split: str = "test") -> TaskData:
    """(train, held-out) problems of the configured source; `split` picks the held-out set: "test"
    (what results are reported on) or "validation" (what settings are tuned on). Neither set's
    prompts are trained on. The data depend on `task.seed` only, not on the run's seed. File sources
    read their rows at task.prompt_key / task.answer_key (fastgrpo/tasks/datasets.py)."""
    if split not in ("test", "validation"):
        raise ValueError(f"split must be 'test' or 'validation', got {split!r}")
    if cfg.source == "arithmetic":
        train, test, validation = arithmetic_splits(
            cfg.train_size, cfg.eval_size, cfg.seed, validation_size=cfg.validation_size,
            min_steps=cfg.min_steps, max_steps=cfg.max_steps, tail=cfg.tail, max_value=cfg.max_value,
            max_operand=cfg.max_operand, slip_rate=cfg.slip_rate)
        return TaskData(train, test if split == "test" else validation)
    rows, report = load_problems(cfg.source, cfg.prompt_key, cfg.answer_key)
    reports = [report]
    rows = list(rows)
    random.Random(cfg.seed).shuffle(rows)
    if cfg.eval_source:
        test, eval_report = load_problems(cfg.eval_source, cfg.prompt_key, cfg.answer_key)
        reports.append(eval_report)
    else:
        if len(rows) < 2:
            raise DatasetError(f"{cfg.source}: need at least 2 usable rows to hold out an eval split")
        n_test = min(cfg.eval_size, len(rows) // 2)
        test, rows = rows[:n_test], rows[n_test:]
    n_val = min(cfg.validation_size, len(rows) // 2)
    validation, rows = rows[:n_val], rows[n_val:]
    if split == "validation" and not validation:
        raise DatasetError(f"{cfg.source}: too few rows to hold out a validation split")
    return TaskData(rows, test if split == "test" else validation, reports)


def load_task(cfg: TaskConfig, split: str = "test") -> tuple[list[Problem], list[Problem]]:
    """`load_task_data`'s (train, held-out) problems."""
    data = load_task_data(cfg, split)
    return data.train, data.held_out


def data_metrics(data: TaskData, train: list[EncodedProblem], held_out: list[EncodedProblem]) -> dict[str, float]:
    """What a run logs of its data (MLflow, once at its start): rows read and skipped as malformed over the
    dataset files (file sources only), and the prompts of each split kept and skipped as too long for the
    context."""
    files = {"data/rows": float(sum(r.rows for r in data.reports)),
             "data/rows_skipped": float(sum(r.malformed for r in data.reports))} if data.reports else {}
    return files | {"data/train_prompts": float(len(train)),
            "data/train_prompts_too_long": float(len(data.train) - len(train)),
            "data/eval_prompts": float(len(held_out)),
            "data/eval_prompts_too_long": float(len(data.held_out) - len(held_out))}


@dataclass
class EncodedProblem:
    problem: Problem
    prompt_ids: list[int]


def held_out_prompt_ids(cfg: TaskConfig, text: TextFormat, max_context: int) -> list[list[int]]:
    """The held-out problems' prompts as token ids, those that fit `max_context` (what benchmarks decode)."""
    _, held_out = load_task(cfg)
    return [e.prompt_ids for e in encode_problems(held_out, text, max_context, "eval")]


def encode_problems(problems: list[Problem], text: TextFormat, max_context: int,
                    what: str = "train") -> list[EncodedProblem]:
    """Tokenized problems; prompts that leave no room to answer within the context are skipped and counted."""
    kept = [EncodedProblem(p, text.prompt_ids(p.prompt)) for p in problems]
    usable = [e for e in kept if len(e.prompt_ids) < max_context]
    skipped = len(kept) - len(usable)
    if skipped:
        log.warning("%s: skipped %d of %d prompts longer than the context of %d tokens",
                    what, skipped, len(kept), max_context)
    if not usable:
        raise DatasetError(f"{what}: no prompt fits in the context of {max_context} tokens "
                           f"({skipped} skipped as too long)")
    return usable


class PromptSource:
    """An endless, seeded stream of training problems: a fresh shuffle each epoch; `position` resumes it."""

    def __init__(self, problems: list[EncodedProblem], seed: int):
        self.problems = problems
        self.seed = seed
        self.position = 0  # problems handed out so far
        self._epoch = -1
        self._order: list[int] = []

    def _index(self, i: int) -> int:
        epoch, offset = divmod(i, len(self.problems))
        if epoch != self._epoch:
            self._order = list(range(len(self.problems)))
            random.Random(self.seed * 7919 + epoch).shuffle(self._order)
            self._epoch = epoch
        return self._order[offset]

    def next_batch(self, k: int) -> list[EncodedProblem]:
        batch = [self.problems[self._index(self.position + j)] for j in range(k)]
        self.position += k
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])
