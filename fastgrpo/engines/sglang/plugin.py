"""fastgrpo's SGLang plugin: one scheduler method that sets the depth of each adaptive EAGLE slot.

SGLang (0.5.23) loads every `sglang.srt.plugins` entry point in each scheduler process before the
scheduler starts (plugins/__init__.py `load_plugins`, called from managers/scheduler.py
`run_scheduler_process`); fastgrpo's pyproject.toml declares `register` below as one. The method it
adds is reached from the engine's process with `Engine.collective_rpc(SET_STEPS, tiers=...)`, which
calls the named Scheduler method in every scheduler process (managers/scheduler.py
`handle_rpc_request`; its arguments must be flat scalars, so the table travels as JSON).

What the method touches (checked against the wheel's source by tests/test_sglang_conformance.py):
`Scheduler.draft_worker` (the EAGLE worker; None on a process without the draft), its
`adaptive_controller` (None unless `speculative_adaptive`), the controller's `params`
(`AdaptiveSpeculativeParams`) and their `_slots` ({lowest batch size: AdaptiveStepSlot}), and each
slot's `candidate_steps`, `current_steps` and `warmup_batches`. Setting `current_steps` takes effect
at the next decode batch (`activate_step_by_batch` reads it); an infinite `warmup_batches` keeps the
slot's EMA from ever moving it again, so fastgrpo's choice holds until the next call.
"""

from __future__ import annotations

import json
import logging

log = logging.getLogger(__name__)

SET_STEPS = "fastgrpo_set_adaptive_steps"


def set_adaptive_steps(scheduler, tiers: str) -> None:
    """Set each slot named in `tiers` (JSON {lowest batch size: steps}) to its steps, which must be
    one of the slot's candidates, and freeze it there."""
    controller = getattr(getattr(scheduler, "draft_worker", None), "adaptive_controller", None)
    if controller is None:  # a pipeline stage without the draft, or no adaptive speculation
        return
    slots = controller.params._slots
    table = {int(k): int(v) for k, v in json.loads(tiers).items()}
    if unknown := sorted(set(table) - set(slots)):
        raise ValueError(f"no adaptive slot for batch sizes {unknown}; the engine's slots are {sorted(slots)}")
    for key, steps in table.items():
        slot = slots[key]
        if steps not in slot.candidate_steps:
            raise ValueError(f"slot {key}: {steps} steps is not among its candidates {slot.candidate_steps}")
        slot.current_steps = steps
        slot.warmup_batches = float("inf")


def register() -> None:
    """The entry point: add SET_STEPS to SGLang's Scheduler (in the scheduler's own process)."""
    from sglang.srt.managers.scheduler import Scheduler

    setattr(Scheduler, SET_STEPS, set_adaptive_steps)
    log.info("fastgrpo: Scheduler.%s registered", SET_STEPS)
