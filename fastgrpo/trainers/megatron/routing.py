"""Routing replay in the Megatron trainer: each router of a mixture of experts takes the experts the
engine recorded in rollout (the rule, and why: `fastgrpo/models/routing.py`).

The hook is megatron-core's own: a TopKRouter hands its `router_replay` object to
`topk_routing_with_score_function` (megatron/core/transformer/moe/router.py, `routing`), which asks it
for the top-k of the scores through `get_replay_topk(scores, topk, num_groups, group_topk,
default_compute_topk)` (moe_utils.py) and builds the routing probabilities and map from what it
returns. megatron-core's RouterReplay replays every token of a forward from one tensor per layer and
is told forward from recomputation by an action its caller switches globally; fastgrpo's record has
positions without a record (padding, a response's last token), which keep the router's own choice,
and a step counts the recorded picks the router would have changed. So each router of the policy gets
a `RecordedRouting`, fed by the trainer:

- before each micro-batch's forward, the trainer queues that micro-batch's record on each of the
  stage's routers, its tokens in the order the router sees them (`routed_order`);
- a forward takes the oldest queued record. Under full activation recompute a training forward runs
  each layer without autograd, and again with it in the backward, micro-batches in the order of their
  forwards (1F1B's steady state and the plain loop alike), so such a forward keeps its record for the
  recomputation, which takes it back in order.

The gate weights are this forward's: with the router's softmax after the top-k (Qwen3-MoE's
norm_topk_prob, megatron's `moe_router_pre_softmax=False`) the scores are the logits, and megatron
takes the softmax of the chosen ones, the recorded experts' probabilities renormalised; with the
softmax first it takes the chosen probabilities as they are. Either is what the Hugging Face router
computes for the same experts (`models/routing.replay_routing`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from fastgrpo.models.routing import impose


@dataclass
class QueuedRecord:
    """A micro-batch's record for one router: [tokens, k] expert ids in the router's token order (-1: no
    record, the router's own choice); `count`: its picks count toward the step's routing_mismatch (a
    training forward's real rows); `replay`: imposed, not only counted; `recomputed`: the forward runs
    again in the backward (training under activation recompute)."""

    experts: Tensor
    count: bool
    replay: bool
    recomputed: bool


class RecordedRouting:
    """One router's replay (module docstring): megatron-core's `router_replay` interface."""

    def __init__(self, recompute: bool):
        self.recompute = recompute
        self.queued: deque[QueuedRecord] = deque()
        self.to_recompute: deque[QueuedRecord] = deque()
        self.picks: Tensor | int = 0  # counted on the device, read once a step
        self.differ: Tensor | int = 0

    def queue(self, record: QueuedRecord) -> None:
        self.queued.append(record)

    def drop_queued(self) -> None:
        """Before a schedule call: nothing queued (a forward that failed must not leave its records to the
        next); each call's forwards and backwards take what it queues."""
        self.queued.clear()
        self.to_recompute.clear()

    def clear(self) -> None:
        """Between steps: nothing queued, nothing counted."""
        self.drop_queued()
        self.picks = self.differ = 0

    def get_replay_topk(self, scores: Tensor, topk: int, num_groups: int | None = None,
                        group_topk: int | None = None,
                        default_compute_topk: Callable[..., tuple[Tensor, Tensor]] | None = None
                        ) -> tuple[Tensor, Tensor]:
        values, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        recomputing = self.recompute and torch.is_grad_enabled() and bool(self.to_recompute)
        if recomputing:
            record = self.to_recompute.popleft()
        elif self.queued:
            record = self.queued.popleft()
            if record.recomputed:
                self.to_recompute.append(record)
        else:  # a forward without a record (the batch carries none): the router's own routing
            return values, own
        if record.experts.shape != own.shape:
            raise ValueError(f"the routing record covers {tuple(record.experts.shape)} (tokens, k) picks; the router "
                             f"routes {tuple(own.shape)}")
        imposed = impose(own, record.experts)
        if record.count and not recomputing:
            self.picks = self.picks + imposed.picks
            self.differ = self.differ + imposed.differ
        if not record.replay:
            return values, own
        return scores.gather(1, imposed.chosen), imposed.chosen


def routed_order(per_position: Tensor, padded: int, tp_shard: tuple[int, int] | None) -> Tensor:
    """`per_position` [n, width, ...] of a micro-batch in the order its routers see the tokens: padded on
    the right to `padded` positions (with -1, or False for a mask), sequence-major ([s, b] flattened,
    megatron's layout), and under sequence parallelism (`tp_shard`: this rank, of how many) this TP rank's
    contiguous shard of the sequence; [tokens, ...]."""
    fill = False if per_position.dtype == torch.bool else -1
    pad = [0, 0] * (per_position.dim() - 2) + [0, padded - per_position.shape[1]]
    ordered = torch.nn.functional.pad(per_position, pad, value=fill).transpose(0, 1)
    if tp_shard is not None:
        rank, size = tp_shard
        ordered = ordered.chunk(size)[rank]
    return ordered.reshape(-1, *per_position.shape[2:])
