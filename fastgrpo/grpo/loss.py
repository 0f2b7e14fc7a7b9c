"""The clipped GRPO policy loss with truncated importance sampling and an optional k3 KL term.

Per response token t of sequence i, with rho = exp(logp - logp_old):
    l_t = -min(rho * A_i, clip(rho, 1 - eps_low, 1 + eps_high) * A_i) * w_t + beta * k3_t
w_t = min(pi_trainer_old / pi_engine, cap) corrects for the small numeric gap between the engine
that sampled the tokens and the trainer that scores them (truncated importance sampling);
k3 = exp(ref - logp) - (ref - logp) - 1 is an unbiased, non-negative KL(pi || pi_ref) estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class LossTerms:
    loss: Tensor  # scalar, already divided by the normaliser
    clipped_tokens: Tensor  # count of tokens whose clipped term was the active one
    kl_ref_sum: Tensor  # sum of k3 over tokens (0 if no reference)


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float,
    eps_high: float,
    aggregation: str,
    normaliser: float,
    tis_weight: Tensor | None = None,
    ref_logp: Tensor | None = None,
    kl_coef: float = 0.0,
) -> LossTerms:
    """logp, old_logp, mask, tis_weight, ref_logp: [N, T]; advantages: [N].

    `normaliser` makes micro-batches add up to the minibatch's loss: the minibatch's token count
    for "token_mean", its number of sequences for "seq_mean".
    """
    mask = mask.to(logp.dtype)
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if tis_weight is not None:
        per_token = per_token * tis_weight
    kl_sum = logp.new_zeros(())
    if ref_logp is not None:
        d = ref_logp - logp
        k3 = torch.exp(d) - d - 1
        kl_sum = (k3 * mask).sum().detach()
        per_token = per_token + kl_coef * k3
    if aggregation == "token_mean":
        loss = (per_token * mask).sum() / normaliser
    elif aggregation == "seq_mean":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / normaliser
    else:
        raise ValueError(f"unknown loss aggregation {aggregation!r}")
    clipped_tokens = ((clipped < unclipped).to(mask.dtype) * mask).sum().detach()
    return LossTerms(loss, clipped_tokens, kl_sum)
