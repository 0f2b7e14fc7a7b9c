"""Routing records for tests of routing replay (a module of its own, not conftest: the ranks of a test's
world import it, and conftest sets the thread count of whatever process imports it)."""

from __future__ import annotations

from pathlib import Path

import torch


def with_foreign_routing(batch, policy_dir: Path):
    """The batch with a routing record of another model of the policy's shape (other weights): most of
    its picks differ from the policy's own, so replaying it changes every sparse layer's output."""
    from transformers import AutoModelForCausalLM

    from fastgrpo.models.policy import load_policy
    from fastgrpo.models.routing import record_routing, stack_record

    torch.manual_seed(1)
    other = AutoModelForCausalLM.from_config(load_policy(policy_dir).config).eval()
    with torch.no_grad(), record_routing(other) as per_layer:
        other(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    batch.routing = stack_record(per_layer, *batch.input_ids.shape)
    batch.routing[batch.attention_mask == 0] = -1
    return batch
