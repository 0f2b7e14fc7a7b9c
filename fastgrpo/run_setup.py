"""Setting up a GRPO run, on every rank: the launched world checked against the configured layout,
the policy checked for, the process groups, the seeds, the prompts, the trainer, this rank's engine
and draft learner (built by their factories), the weight bridge, the tracker; a resume restores the
latest checkpoint. The engines get the policy's weights with the bridge's first push."""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path

import torch
from transformers import AutoConfig

from fastgrpo.bridge import WeightBridge
from fastgrpo.checkpoint import CheckpointManager
from fastgrpo.config import Config, enforce, flatten, layout_rules, to_yaml
from fastgrpo.distributed import World, init_world, launched_world_size
from fastgrpo.draft_learning import build_draft_learner
from fastgrpo.engines import build_engine
from fastgrpo.topology import WorldSize
from fastgrpo.models.families import check_checkpoint
from fastgrpo.paths import is_policy
from fastgrpo.models.tokenizer import load_text_format
from fastgrpo.run_checkpoint import restore_checkpoint
from fastgrpo.run_state import Run
from fastgrpo.tasks.rewards import load_reward
from fastgrpo.tasks.source import PromptSource, data_metrics, encode_problems, load_task_data
from fastgrpo.tracking import Tracker, default_tracking_uri
from fastgrpo.trainers import build_trainer

log = logging.getLogger(__name__)


def check_layout(cfg: Config) -> None:
    """The launched world against the configured layout (`layout_rules`), on every rank before any group is
    made: torchrun's WORLD_SIZE ranks, LOCAL_WORLD_SIZE of them on each node."""
    ranks = launched_world_size()
    enforce(layout_rules(cfg, WorldSize(ranks, int(os.environ.get("LOCAL_WORLD_SIZE", ranks)))))


def preflight(cfg: Config) -> None:
    """The checks every rank makes once, whatever its role, before any group is made or any work done: the
    launched world against the configured layout, and the device and precision this machine has (one it
    lacks fails here). `fastgrpo train` runs them on a draft rank; `train.train` on a policy rank."""
    from fastgrpo.device import resolve

    check_layout(cfg)
    resolve(cfg)


def require_policy(cfg: Config) -> None:
    """A run starts from the policy at model.path, which `fastgrpo sft` builds: without it, say so (not
    the Hugging Face hub's error for a model name it cannot download)."""
    if not is_policy(cfg.model.path):
        raise FileNotFoundError(
            f"no policy at model.path={cfg.model.path} (no config.json there). Build it first: `make policy`, "
            f"or `fastgrpo sft --config CONFIG` then `fastgrpo draft-pretrain --config CONFIG` with this run's "
            f"config and overrides (`make train` does both, then trains)")


def setup_run(cfg: Config, resume: bool) -> Run:
    """A policy rank's run, from the policy at model.path (or the latest checkpoint: `resume`). The layout
    and the device were checked before (`preflight`, which `train.train` runs), not again here; the caller
    sets the thread count (`device.thread_count`)."""
    require_policy(cfg)
    check_checkpoint(cfg.model.path)  # a family fastgrpo computes, before any work
    reward = load_reward(cfg.task)  # a module:function that cannot be imported fails here, before any work
    channel = init_world(cfg.parallel.draft_ranks)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    run_dir = Path(cfg.run_dir)
    checkpoints = CheckpointManager(run_dir / "checkpoints", cfg.checkpoint.keep_last)
    latest = checkpoints.latest() if resume else None
    if resume and latest is None:
        log.warning("--resume: no checkpoint in %s, starting from step 0", checkpoints.root)

    # input errors (a missing dataset, no usable rows) surface before any model is built
    text = load_text_format(cfg.model.path, cfg.task)
    task = load_task_data(cfg.task, cfg.eval.split)
    data = PromptSource(encode_problems(task.train, text, cfg.model.max_context, "train"), cfg.seed)
    evals = encode_problems(task.held_out, text, cfg.model.max_context, "eval")

    trainer = build_trainer(cfg)  # the policy of model.path; a resume loads its checkpoint over it
    world = World.of(trainer.placement(), cfg.engine.tensor)
    model_config = AutoConfig.from_pretrained(cfg.model.path)
    engine = None
    if world.leads_engine:  # its weights come with the bridge's first push
        engine = build_engine(cfg, model_config, text)
    draft_learner = build_draft_learner(cfg, engine, model_config, world, channel)
    # the draft's embedding and LM head are the policy's: it gets them with every push, as engines do
    # (every policy rank takes part in a push: it gathers the shards; a rank that leads no engine drops
    # them as they pass, so no rank holds more than a bucket beyond its own shards)
    bridge = WeightBridge([c for c in (engine, draft_learner) if c is not None])

    if world.main:
        run_dir.mkdir(parents=True, exist_ok=True)
    tracker = Tracker(cfg.tracking.uri or default_tracking_uri(run_dir), cfg.tracking.experiment,
                      run_dir / "mlartifacts", enabled=cfg.tracking.enabled and world.main)
    run = Run(cfg, text, trainer, engine, bridge, data, evals, tracker, checkpoints, draft_learner, world,
              reward=reward)
    run_id = None
    if latest is not None:
        run_id = restore_checkpoint(run, latest)
        if world.main:
            print(f"resumed from {latest} at step {run.step}")
    tracker.start(cfg.tracking.run_name or run_dir.name, flatten(cfg), to_yaml(cfg), run_id=run_id)
    tracker.log_metrics(data_metrics(task, data.problems, evals), step=run.step)  # rows and prompts skipped
    bridge.push(trainer.export_weights(), version=run.step)
    return run
