"""A GRPO run's checkpoints: what each rank writes at a step boundary (the trainer's state, the draft
learner's, its RNG state; rank 0 also the tokenizer, the data position and the run's history) and
how a resume reads them back. `fastgrpo.checkpoint.CheckpointManager` makes each one atomic and
keeps the last few ([checkpoints.md](../docs/checkpoints.md))."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from fastgrpo.grpo.record import StepRecord
from fastgrpo.paths import checkpoint_draft, checkpoint_policy
from fastgrpo.run_state import Run, TrainResult


def rng_file(rank: int) -> str:
    return "rng.pt" if rank == 0 else f"rng_rank{rank}.pt"


def index_file(rank: int) -> str:
    """An engine leader's suffix index (`speculation.drafts` index or hybrid): each engine holds its own."""
    return f"suffix_index_rank{rank}.json"


def save_checkpoint(run: Run) -> Path:
    """On every rank (collective): the trainer's state (a Megatron trainer's ranks write their shards),
    the draft's, every rank's RNG state, an engine's suffix index (its prompts' earlier responses: a
    resumed run drafts from them as the uninterrupted one would); rank 0 the tokenizer, the data
    position (one prompt stream, the same on every rank) and the run's history."""
    def write(d: Path) -> None:
        run.trainer.save(d)
        if run.draft_learner is not None:
            run.draft_learner.save(checkpoint_draft(d))
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, d / rng_file(run.world.rank))
        index = getattr(run.engine, "index", None)
        if index is not None:
            (d / index_file(run.world.rank)).write_text(json.dumps(index.state_dict()))
        if not run.world.main:
            return
        run.text.tokenizer.save_pretrained(checkpoint_policy(d))
        state = {"step": run.step, "data": run.data.state_dict(), "mlflow_run_id": run.tracker.run_id,
                 "weights_version": run.bridge.version, "world_size": run.world.size,
                 "history": {"steps": [r.metrics() for r in run.history.steps], "evals": run.history.evals}}
        (d / "state.json").write_text(json.dumps(state, indent=2))

    path = run.checkpoints.save(run.step, write)
    if run.world.main:
        print(f"checkpoint: {path}", flush=True)
    return path


def restore_checkpoint(run: Run, path: Path) -> str | None:
    state = json.loads((path / "state.json").read_text())
    run.trainer.load(path)
    if run.draft_learner is not None:
        if not checkpoint_draft(path).is_dir():
            raise FileNotFoundError(f"checkpoint {path} holds no draft state, but draft.online={run.cfg.draft.online}")
        run.draft_learner.load(checkpoint_draft(path))
    rng_path = path / rng_file(run.world.rank)
    if rng_path.is_file():  # a rank of a larger world than the checkpoint's has none: its seeds are explicit
        rng = torch.load(rng_path, weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
    index, index_path = getattr(run.engine, "index", None), path / index_file(run.world.rank)
    if index is not None and index_path.is_file():  # (a checkpoint of a run without the index has none)
        index.load_state_dict(json.loads(index_path.read_text()))
    run.data.load_state_dict(state["data"])
    run.step = int(state["step"])
    history = state.get("history", {"steps": [], "evals": {}})
    run.history = TrainResult([StepRecord.from_metrics(i + 1, m) for i, m in enumerate(history["steps"])],
                              {int(k): v for k, v in history["evals"].items()})
    return state.get("mlflow_run_id")
