"""Every speculation policy the engines run, by the name `speculation.policy` gives it.

The names are declared once, as the config's type (`config.SpeculationPolicyName`); each policy class
carries its own `name`, and this registry maps one to the other (`tests/test_speculation.py` checks
that the two agree). Policies that price steps need a calibrated cost model (`CALIBRATED`).
"""

from __future__ import annotations

from typing import get_args

from fastgrpo.config import SpeculationConfig, SpeculationPolicyName
from fastgrpo.speculation.cost_model import CostModel
from fastgrpo.speculation.per_sequence import AwarePerSequence
from fastgrpo.speculation.policy import Aware, FastGRPOFormula, Off, SpeculationPolicy, Static
from fastgrpo.speculation.tlt import TLT
from fastgrpo.speculation.spec import SpecConfig

POLICIES: dict[str, type] = {cls.name: cls for cls in (Off, Static, FastGRPOFormula, TLT, Aware, AwarePerSequence)}
CALIBRATED = frozenset({Aware.name, AwarePerSequence.name})
assert set(POLICIES) == set(get_args(SpeculationPolicyName)), "the registry and the config name other policies"


def make_policy(cfg: SpeculationConfig, costs: CostModel | None = None,
                acceptance_prior: float | None = None) -> SpeculationPolicy:
    """The policy `cfg.policy` names; a static one runs `cfg`'s tree, a calibrated one `costs` (and
    `acceptance_prior`, the draft's measured chance of accepting a level, where known)."""
    cls = POLICIES.get(cfg.policy)
    if cls is None:
        raise ValueError(f"speculation.policy {cfg.policy!r} is not available (one of {', '.join(POLICIES)})")
    if cls is Static:
        return Static(SpecConfig(cfg.depth, cfg.topk, cfg.num_verify))
    if cfg.policy in CALIBRATED:
        if costs is None:
            raise ValueError(f"the {cfg.policy} policy needs a calibrated cost model")
        return cls(costs, acceptance_prior=acceptance_prior)
    return cls()
