"""Building the embedded rollout engine from a config: target weights, draft, speculation policy."""

from __future__ import annotations

import logging
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fastgrpo.config import Config
from fastgrpo.engine.engine import EmbeddedEngine
from fastgrpo.speculation.cost_model import load_or_calibrate
from fastgrpo.speculation.draft import DRAFT_WEIGHTS, DraftHead
from fastgrpo.speculation.policy import make_policy

log = logging.getLogger(__name__)


def draft_dir(cfg: Config) -> Path:
    return Path(cfg.draft.path or cfg.model.path)


def build_engine(cfg: Config, policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 speculation: str | None = None) -> EmbeddedEngine:
    """An engine holding `policy`'s weights; with speculation, the draft from `draft.path` (or next
    to the policy) and the configured policy (`speculation` overrides `cfg.speculation.policy`)."""
    engine = EmbeddedEngine(policy.config, cfg.rollout.max_batch, cfg.model.max_context,
                            eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)
    engine.update_weights(policy.state_dict().items(), version=0)
    mode = speculation or cfg.speculation.policy
    if mode != "off":
        weights = draft_dir(cfg) / DRAFT_WEIGHTS
        if not weights.is_file():
            raise FileNotFoundError(f"speculation.policy={mode} needs a draft at {weights}; "
                                    f"build it with `fastgrpo draft-pretrain`")
        draft = DraftHead.load(draft_dir(cfg), policy.config, cfg.model.max_context)
        engine.update_draft(draft.state_dict().items(), version=0)
        set_speculation(engine, cfg, mode)
    return engine


def set_speculation(engine: EmbeddedEngine, cfg: Config, mode: str) -> None:
    costs = None
    if mode == "aware":
        assert engine.draft is not None
        costs = load_or_calibrate(engine.model, engine.draft, Path(cfg.speculation.cost_model_dir))
    sc = cfg.speculation
    engine.set_policy(make_policy(type(sc)(**{**sc.__dict__, "policy": mode}), costs))
