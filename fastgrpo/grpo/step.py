"""One GRPO optimisation step over a rollout batch, written once for every trainer.

The algorithm is here: `epochs` passes of `minibatches` optimiser steps; each minibatch's loss
(`grpo.loss.policy_loss`: token or sequence ratios, clip, dual clip, log-ratio clamp) normalised over the
whole minibatch (`grpo.loss.loss_normaliser`), so that micro-batches and data-parallel shares add up to
it; the rollout correction against the engine's log-probabilities (`grpo.correction`); the KL estimate
to the frozen reference; the statistics (what was clipped, held by the dual clip, clamped, masked or
truncated); and the NaN skip (a non-finite loss or gradient norm leaves the weights and the optimiser
untouched). Every trainer reaches every option of the objective through this one step. A trainer backend
(`StepBackend`: torch, Megatron-core, DeepSpeed) supplies only what depends on how it holds the model:
scoring a batch, a forward/backward of its share of rows micro-batch by micro-batch, an optimiser
update with clipping, and a sum over its ranks. This is veRL's split of losses from engines.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from fastgrpo.config import GRPOConfig
from fastgrpo.grpo.correction import rollout_correction
from fastgrpo.grpo.loss import loss_normaliser, policy_loss
from fastgrpo.types import RolloutBatch

# (rows of the batch, their micro-batch, position-aligned log-probabilities and entropy [n, width])
# -> the micro-batch's share of the minibatch loss, to backpropagate
LossFn = Callable[[list[int], RolloutBatch, Tensor, Tensor], Tensor]
STATS = ("loss", "clip", "entropy", "kl_engine", "kl_ref", "tokens", "dual_clip", "clamped", "masked", "truncated")


class StepBackend(Protocol):
    device: torch.device  # where its micro-batches, log-probabilities and statistics live
    model: torch.nn.Module  # in training mode for the step's duration

    def logprobs(self, batch: RolloutBatch) -> Tensor:
        """The policy's log-probabilities of every token of the batch, [N, L] position-aligned
        (column 0 padding), on every rank."""
        ...

    def reference_logprobs(self, batch: RolloutBatch) -> Tensor:
        """The same of the frozen reference policy (the KL term's)."""
        ...

    def zero_grad(self) -> None: ...

    def accumulate(self, batch: RolloutBatch, rows: list[int], loss_of: LossFn) -> None:
        """Forward and backward of this rank's share of `rows`, micro-batch by micro-batch: wherever
        the logits are, `loss_of` turns them into the loss that is backpropagated (gradients add up)."""
        ...

    def update(self, loss_finite: bool) -> float | None:
        """Clip and apply the accumulated gradient, unless the loss or the gradient norm is not
        finite; the norm of an applied update, None for a skipped one (weights unchanged)."""
        ...

    def all_sum(self, t: Tensor) -> Tensor:
        """`t` summed over the ranks that each hold part of the step's statistics (pipeline stages,
        data-parallel replicas); `t` itself in one process."""
        ...

    def lr(self) -> float: ...


def minibatch_loss(cfg: GRPOConfig, batch: RolloutBatch, rows: list[int], old: Tensor | None, ref: Tensor | None,
                   stats: Tensor) -> LossFn:
    """The loss function of the minibatch `rows`: each micro-batch's clipped, corrected GRPO loss (with
    the KL term) over the whole minibatch's normaliser; adds its statistics to `stats` (the order of
    STATS) without leaving the device. `old` None: on-policy (the ratio is 1, its gradient the policy
    gradient); a micro-batch without rows pads a rank's share and trains nothing."""
    normaliser = loss_normaliser(cfg.loss_aggregation, batch.response_mask[rows], cfg.loss_norm_tokens)

    def loss_of(micro_rows: list[int], micro: RolloutBatch, logp: Tensor, entropy: Tensor) -> Tensor:
        width = logp.shape[1]
        old_logp = old[micro_rows, :width] if old is not None and micro_rows else logp.detach()
        ref_logp = None if ref is None else ref[micro_rows, :width] if micro_rows else logp.detach()
        correction = rollout_correction(old_logp, micro.engine_logprobs, micro.response_mask, cfg.rollout_correction,
                                        cfg.tis_cap, cfg.mask_band())
        terms = policy_loss(logp, old_logp, micro.advantages, micro.response_mask, eps_low=cfg.eps_low,
                            eps_high=cfg.eps_high, aggregation=cfg.loss_aggregation, normaliser=normaliser,
                            ratio_level=cfg.ratio_level, dual_clip=cfg.dual_clip,
                            log_ratio_clamp=cfg.log_ratio_clamp,
                            correction_weight=None if correction is None else correction.weight,
                            ref_logp=ref_logp, kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator)
        m = micro.response_mask.to(logp.dtype)
        masked, truncated = ((logp.new_zeros(()), logp.new_zeros(())) if correction is None else
                             (correction.masked.sum().to(logp.dtype), correction.truncated.sum().to(logp.dtype)))
        # the engine/trainer mismatch at equal weights: against the log-probabilities before this step's
        # first update (old_logp), not the current ones, which after an update measure the policy's own move
        stats.add_(torch.stack([terms.loss.detach(), terms.clipped_tokens, (entropy.detach() * m).sum(),
                                ((micro.engine_logprobs - old_logp) * m).sum(), terms.kl_ref_sum, m.sum(),
                                terms.dual_clipped_tokens, terms.clamped_tokens, masked, truncated]).to(stats))
        return terms.loss

    return loss_of


def grpo_step(backend: StepBackend, batch: RolloutBatch, cfg: GRPOConfig) -> dict[str, float]:
    """Every optimiser step for one rollout batch, the model in training mode meanwhile; the metrics of
    the whole batch, on every rank."""
    backend.model.train()
    try:
        return _steps(backend, batch, cfg)
    finally:
        backend.model.eval()


def _steps(backend: StepBackend, batch: RolloutBatch, cfg: GRPOConfig) -> dict[str, float]:
    several = cfg.epochs * cfg.minibatches > 1
    old = backend.logprobs(batch) if several else None  # else old = current, from the same forward
    ref = backend.reference_logprobs(batch) if cfg.kl_coef > 0 else None
    per_minibatch = math.ceil(batch.size / cfg.minibatches)
    totals = torch.zeros(len(STATS), dtype=torch.float64, device=backend.device)  # every minibatch's, this rank's part
    loss_sum = norm_sum = 0.0
    updates = skipped = 0
    for _ in range(cfg.epochs):
        for start in range(0, batch.size, per_minibatch):
            rows = list(range(start, min(start + per_minibatch, batch.size)))
            stats = torch.zeros(len(STATS), dtype=torch.float64, device=backend.device)
            backend.zero_grad()
            backend.accumulate(batch, rows, minibatch_loss(cfg, batch, rows, old, ref, stats))
            # the skip decision needs the whole minibatch's loss on the host, on every rank alike
            loss = float(backend.all_sum(stats[:1].clone()))
            norm = backend.update(math.isfinite(loss))
            if norm is None:
                skipped += 1
                continue
            updates += 1
            loss_sum += loss
            norm_sum += norm
            totals += stats
    summed = dict(zip(STATS, backend.all_sum(totals).tolist()))
    tokens = max(summed["tokens"], 1.0)
    return {"loss": loss_sum / max(updates, 1), "grad_norm": norm_sum / max(updates, 1),
            "clip_fraction": summed["clip"] / tokens, "dual_clip_fraction": summed["dual_clip"] / tokens,
            "ratio_clamped_fraction": summed["clamped"] / tokens,
            "correction_masked_fraction": summed["masked"] / tokens,
            "correction_truncated_fraction": summed["truncated"] / tokens,
            "entropy": summed["entropy"] / tokens, "kl_ref": summed["kl_ref"] / tokens,
            "kl_engine_trainer": summed["kl_engine"] / tokens, "updates": float(updates),
            "skipped_updates": float(skipped), "lr": backend.lr()}
