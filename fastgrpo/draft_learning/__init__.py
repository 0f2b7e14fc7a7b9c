"""Draft learning: the draft trainer (`trainer.py`), the offline warm start (`pretrain.py`), online
learning beside the engine (`online.py`, draft.online=sync) or on a draft rank of its own
(`async_learner.py`, draft.online=async); and the one place a run's online draft learner is built
from its config (`build_draft_learner`).

The loop asks for a `DraftLearner` (`fastgrpo.protocols`) and uses nothing else of it.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from fastgrpo.config import Config
from fastgrpo.device import resolve
from fastgrpo.distributed import Channel, World
from fastgrpo.protocols import DraftLearner, Engine


def build_draft_learner(cfg: Config, engine: Engine | None, model_config: PretrainedConfig, world: World,
                        channel: Channel | None) -> DraftLearner | None:
    """The online draft learner `draft.online` asks for, beside `engine` (the one this rank leads): sync
    learns in this process; async ships the rollouts' states to a draft rank of its own (`channel`: the
    torchrun world's draft slice; None: a spawned draft process) and sets the engine's `draft_source`,
    so the engine picks up the published versions between decode steps. None with draft.online=off
    or on a rank that leads no engine."""
    if cfg.draft.online == "off" or engine is None:
        return None
    from fastgrpo.models.draft import DraftHead
    from fastgrpo.paths import draft_dir

    draft = DraftHead.load(draft_dir(cfg), model_config, cfg.model.max_context)
    device = resolve(cfg).device  # beside the engine whose states it learns from
    if cfg.draft.online == "sync":
        from fastgrpo.draft_learning.online import OnlineDraftLearner

        return OnlineDraftLearner(draft, cfg.draft, [engine], seed=cfg.seed, device=device)
    from fastgrpo.draft_learning.async_learner import AsyncDraftClient

    # a draft rank of its own; the engine picks up its versions between decode steps
    engine_ranks = world.engines.leaders() if channel is not None else None
    draft_ranks = list(range(world.size, world.size + cfg.parallel.draft_ranks)) if channel else None
    learner = AsyncDraftClient(draft, cfg.draft, [engine], cfg.seed, channel=channel,
                               draft_ranks=draft_ranks, engine_ranks=engine_ranks, device=str(device))
    engine.draft_source = learner.poll
    return learner
