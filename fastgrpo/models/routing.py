"""Routing replay for a mixture of experts: the experts a token was routed to in rollout, recorded,
and imposed on the trainer's forwards.

Why: an engine and a trainer compute the router's logits in different precisions and kernels, and
top-k over near-ties flips: about 10% of router choices differ between inference and training, and
GRPO on Qwen3-30B-A3B without replay collapsed in 3 of 3 runs where every run with it finished (R3,
arXiv 2510.11370). Replay makes the trainer compute the policy the engine sampled from, expert for
expert, while the gate weights still come from the trainer's own router logits, so the router keeps
its gradient.

The record: for each token position, each sparse layer's top-k expert ids, [N, L, layers, k] int16,
-1 where nothing was recorded (padding, and the last token of a response, which the engine sampled but
never ran). A position without a record keeps the trainer's own routing: its hidden state feeds only
its own and later positions' outputs, and the last position of a sequence predicts nothing trained.

`routing_mismatch` is the share of recorded (token, layer, slot) picks the trainer's own router did not
pick (as sets per token and layer: top-k order does not change the output), measured in the same
forward before the record is imposed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from fastgrpo.models.families import MOE_BLOCKS

NONE = -1  # a position with no recorded routing


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router (`gate`) of each sparse block of a Hugging Face mixture of experts, in layer order;
    [] for a dense model. (A DeepSpeed engine: its `module`.)"""
    model = getattr(model, "module", model)
    block = MOE_BLOCKS.get(getattr(model.config, "model_type", ""))
    return [m.gate for m in model.modules() if block and type(m).__name__ == block]


def bytes_per_token(sparse_layers: int, top_k: int) -> int:
    """What the record costs a token in the batch: one int16 expert id per (sparse layer, slot)."""
    return 2 * sparse_layers * top_k


@dataclass
class Mismatch:
    """Counts of recorded picks, and of those the trainer's router did not pick, over a step: device
    tensors once counted (read on the host once a step, not once a layer)."""

    picks: Tensor | int = 0
    differ: Tensor | int = 0

    @property
    def fraction(self) -> float:
        return float(self.differ) / float(self.picks) if float(self.picks) else 0.0


@dataclass
class Imposed:
    """A record imposed on one router's forward of T tokens (`impose`)."""

    chosen: Tensor  # [T, k] the experts the forward runs: the recorded ones where a token has a record, else its own
    picks: Tensor  # the recorded picks (tokens with a record x k)
    differ: Tensor  # of them, those the router's own top-k set lacks (top-k order does not change the output)


def impose(own: Tensor, recorded: Tensor) -> Imposed:
    """The router's own top-k experts `own` [T, k] under the record `recorded` [T, k] (-1: no record):
    every trainer's rule (the Hugging Face hook below, Megatron's `RecordedRouting`, the expert load)."""
    recorded = recorded.to(own.device, torch.long)
    known = (recorded >= 0).all(-1)
    lacks = ~(recorded[:, :, None] == own[:, None, :]).any(-1)
    return Imposed(torch.where(known[:, None], recorded, own), known.sum() * recorded.shape[-1],
                   (lacks & known[:, None]).sum())


@contextlib.contextmanager
def record_routing(model: torch.nn.Module) -> Iterator[list[Tensor]]:
    """For the forwards inside: each sparse layer's chosen experts [tokens, k], appended in call order
    (one forward of a model with S sparse layers appends S tensors)."""
    out: list[Tensor] = []
    hooks = [r.register_forward_hook(lambda m, i, o: out.append(o[2].detach().to(torch.int16)))
             for r in routers(model)]
    try:
        yield out
    finally:
        for h in hooks:
            h.remove()


def stack_record(per_layer: list[Tensor], batch: int, width: int) -> Tensor:
    """`record_routing`'s tensors of one forward of [batch, width] tokens as [batch, width, layers, k]."""
    return torch.stack([t.reshape(batch, width, -1) for t in per_layer], 2)


@contextlib.contextmanager
def replay_routing(model: torch.nn.Module, routing: Tensor | None, replay: bool = True
                   ) -> Iterator[Mismatch]:
    """For each forward inside (one forward of the rows `routing` [N, L, layers, k] describes, or
    several of them in turn, such as a recomputation in backward): each sparse layer routes each
    recorded token to its recorded experts (`replay`), with gate weights from this forward's router
    logits (softmax, the recorded experts' probabilities, renormalised when the router renormalises);
    and the yielded `Mismatch` counts how many recorded picks the router itself would have changed.
    `routing` None: nothing is replayed or counted."""
    found = Mismatch()
    layers = routers(model)
    if routing is None or not layers:
        yield found
        return
    if routing.shape[2] != len(layers):
        raise ValueError(f"the routing record has {routing.shape[2]} sparse layers; the model has {len(layers)}")

    def hook(index: int):
        def replace(router: torch.nn.Module, inputs, output):
            logits, scores, own = output
            recorded = routing[:, :, index].reshape(-1, routing.shape[-1])
            if recorded.shape[0] != own.shape[0]:
                raise ValueError(f"sparse layer {index}: the routing record covers {recorded.shape[0]} tokens, "
                                 f"the forward {own.shape[0]}")
            imposed = impose(own, recorded)
            found.picks = found.picks + imposed.picks
            found.differ = found.differ + imposed.differ
            if not replay:
                return output
            chosen = imposed.chosen
            weight = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, chosen)
            if getattr(router, "norm_topk_prob", False):
                weight = weight / weight.sum(-1, keepdim=True)
            return logits, weight.to(scores.dtype), chosen.to(own.dtype)
        return replace

    hooks = [r.register_forward_hook(hook(i)) for i, r in enumerate(layers)]
    try:
        yield found
    finally:
        for h in hooks:
            h.remove()
