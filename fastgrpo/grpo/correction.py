"""Rollout correction: the engine that sampled a batch and the trainer that scores it compute slightly
different probabilities (kernels, precision, batch shapes), so the batch is off-policy by
rho_t = pi_trainer_old(y_t) / pi_engine(y_t) per sampled token. Each mode (`grpo.rollout_correction`)
turns rho into a constant weight on the policy-gradient term of every response token (the KL term is
left alone: it compares the policy with the reference, not with the engine):

- token_tis: w_t = min(rho_t, C): truncated importance sampling (Yao et al., "Your efficient RL
  framework secretly brings you off-policy RL training", 2025; veRL's token-level TIS);
- sequence_tis: w_t = min(prod_t' rho_t', C) for every token of the sequence (veRL's sequence-level IS:
  the sequence's own likelihood ratio, unbiased before truncation);
- token_mask: w_t = 1 if low <= rho_t <= high, else 0 (masked importance sampling, veRL's token-level
  rejection: a token whose probabilities disagree too much trains nothing);
- sequence_mask: w = 1 for the whole sequence if low <= prod_t rho_t <= high, else 0 (veRL's Seq-MIS);
- geometric_mask: the same on the geometric mean (prod_t rho_t)^(1/|y|), which does not grow with the
  length (veRL's Geo-RS; DeepSeek-V3.2's off-policy sequence masking thresholds the same per-token mean
  log-ratio, on negative-advantage sequences only);
- icepop: w_t = rho_t if low <= rho_t <= high, else 0 (IcePop, Ling team's Ring-1T, "Every Step
  Evolves", arXiv 2510.18855: a band mask that keeps the importance weight inside it).

C is `grpo.tis_cap`, [low, high] `GRPOConfig.mask_band()`. Comparisons are made on log rho, so a
sequence's product never overflows. A masked token still counts in the loss's normaliser (as in
IcePop's objective): it contributes zero, it does not shrink the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

MODES = ("none", "token_tis", "sequence_tis", "token_mask", "sequence_mask", "geometric_mask", "icepop")


@dataclass
class Correction:
    weight: Tensor  # [N, T] constant weight of the policy-gradient term
    masked: Tensor  # [N, T] bool: response tokens the mode set to zero
    truncated: Tensor  # [N, T] bool: response tokens whose weight was cut down to the cap


def rollout_correction(old_logp: Tensor, engine_logp: Tensor, mask: Tensor, mode: str, tis_cap: float = 2.0,
                       band: tuple[float, float] = (0.5, 2.0)) -> Correction | None:
    """The correction of `mode` (see the module) for log-probabilities [N, T] of the trainer before the
    step's updates and of the engine, over the response tokens `mask`; None for "none"."""
    if mode == "none":
        return None
    if mode not in MODES:
        raise ValueError(f"unknown rollout correction {mode!r}")
    real = mask.bool()
    log_rho = torch.where(real, (old_logp - engine_logp).detach(), torch.zeros_like(old_logp))
    no = torch.zeros_like(real)
    if mode in ("token_tis", "sequence_tis"):
        log_w = log_rho if mode == "token_tis" else log_rho.sum(-1, keepdim=True).expand_as(log_rho)
        weight = torch.exp(log_w).clamp(max=tis_cap)
        return Correction(weight, no, (log_w > math.log(tis_cap)) & real)
    low, high = math.log(band[0]), math.log(band[1])
    if mode in ("token_mask", "icepop"):
        stat = log_rho
    elif mode == "sequence_mask":
        stat = log_rho.sum(-1, keepdim=True).expand_as(log_rho)
    else:  # geometric_mask
        stat = (log_rho.sum(-1, keepdim=True) / real.sum(-1, keepdim=True).clamp(min=1)).expand_as(log_rho)
    keep = (stat >= low) & (stat <= high)
    weight = keep.to(old_logp.dtype)
    if mode == "icepop":
        weight = weight * torch.exp(log_rho.clamp(max=high))
    return Correction(weight, ~keep & real, no)
