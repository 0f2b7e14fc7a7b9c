"""Building the embedded rollout engine from a config: target weights, draft, speculation policy."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from transformers import PretrainedConfig

from fastgrpo.models.tokenizer import TextFormat
from fastgrpo.protocols import NamedTensors
from fastgrpo.config import Config
from fastgrpo.device import Compute, resolve
from fastgrpo.engines.embedded.engine import EmbeddedEngine
from fastgrpo.engines.embedded.calibrate import load_or_calibrate
from fastgrpo.models.draft import DraftHead
from fastgrpo.paths import DRAFT_CONFIG, draft_dir, draft_weights, has_draft
from fastgrpo.speculation.policy import SpeculationPolicy
from fastgrpo.speculation.registry import CALIBRATED, make_policy
from fastgrpo.speculation.suffix_index import IndexLimits

log = logging.getLogger(__name__)


def build_engine(cfg: Config, model_config: PretrainedConfig, text: TextFormat,
                 weights: NamedTensors | None = None, speculation: str | None = None,
                 compute: Compute | None = None) -> EmbeddedEngine:
    """An engine for a policy of `model_config`, holding `weights` if given (else the first push of
    the weight bridge brings them); with speculation, the draft from `draft.path` (or next to the
    policy) and the configured policy (`speculation` overrides `cfg.speculation.policy`). `compute`:
    the device and dtype, default `cfg`'s resolved on this machine (a benchmark passes its trainer's,
    bf16 emulated on a CPU that a run would refuse)."""
    compute = compute or resolve(cfg)  # the trainer's device and dtype: pushed weights arrive as they are held
    steps = cfg.engine.steps
    engine = EmbeddedEngine(model_config, cfg.rollout.max_batch, cfg.model.max_context,
                            eos_id=text.stop_ids, device=compute.device,
                            dtype=compute.dtype, static_steps=None if steps == "auto" else steps == "static")
    if cfg.engine.fused:
        if not engine.static:
            raise ValueError(f"engine.fused=true needs static steps, and engine.steps={steps} on "
                             f"{compute.device.type} steps eagerly: set engine.steps=static")
        engine.fused = True
    if weights is not None:
        engine.update_weights(weights, version=0)
    mode = speculation or cfg.speculation.policy
    if mode != "off":
        if not has_draft(draft_dir(cfg)):
            raise FileNotFoundError(f"speculation.policy={mode} needs a draft at {draft_weights(draft_dir(cfg))}; "
                                    f"build it with `fastgrpo draft-pretrain`")
        draft = DraftHead.load(draft_dir(cfg), model_config, cfg.model.max_context)
        engine.update_draft(draft.state_dict().items(), version=0)
        engine.set_speculation(speculation_policy(engine, cfg, mode))
        engine.set_drafts(cfg.speculation.drafts, IndexLimits.of(cfg.speculation))
        if engine.static and mode == "aware_per_sequence" and cfg.speculation.drafts != "learned":
            log.warning("speculation.policy=aware_per_sequence with speculation.drafts=%s runs its speculative steps "
                        "eagerly (its budgets cut trees by the learned draft's scores, which a merged tree does not "
                        "carry in a static step yet): on a GPU those steps are launch-bound; "
                        "speculation.policy=aware runs every step static", cfg.speculation.drafts)
    return engine


def speculation_policy(engine: EmbeddedEngine, cfg: Config, mode: str) -> SpeculationPolicy:
    """The configured speculation policy in mode `mode`; `aware` gets this machine's cost model
    (calibrated once per machine and model shape, then read from `speculation.cost_model_dir`)."""
    costs = None
    if mode in CALIBRATED:
        assert engine.draft is not None
        costs = load_or_calibrate(engine.model, engine.draft, Path(cfg.speculation.cost_model_dir))
    sc = cfg.speculation
    return make_policy(type(sc)(**{**sc.__dict__, "policy": mode}), costs, draft_acceptance(draft_dir(cfg)))


def draft_acceptance(directory: Path | str) -> float | None:
    """The draft's held-out top-1 agreement with the policy, as its pretraining measured it (the chance a
    drafted level is accepted, at temperature 0), or None where its files do not say."""
    try:
        meta = json.loads((Path(directory) / DRAFT_CONFIG).read_text())
    except (OSError, ValueError):
        return None
    top1 = meta.get("pretrain", {}).get("eval_top1") if isinstance(meta.get("pretrain"), dict) else None
    return float(top1) if isinstance(top1, (int, float)) and 0 < top1 < 1 else None
