"""The clipped GRPO policy loss, each option after its paper (docs/objective.md).

Per response token t of sequence i, advantage A_i, against the policy before the step's updates (old):
- the log-ratio: token level (PPO), log r_t = logp_t - old_t; sequence level (GSPO, Zheng et al.
  arXiv 2507.18071), log s_i = (1/|y_i|) sum_t (logp_t - old_t), the log of
  (pi(y_i|x) / pi_old(y_i|x))^(1/|y_i|), put on every token of the sequence in GSPO-token's form
  logp_t - sg(logp_t) + sg(log s_i): the same value, and the gradient of s_i spread over its tokens, so
  that with seq_mean aggregation this is GSPO's objective exactly;
- clamped to [-log_ratio_clamp, log_ratio_clamp] before exp (veRL's guard against an overflowing ratio);
- l_t = max(-r A, -clip(r, 1 - eps_low, 1 + eps_high) A), PPO's clipped surrogate as a loss; with
  dual-clip PPO (Ye et al. arXiv 1912.09729) a negative-advantage token's loss is min(l_t, -c A): bounded
  by c |A| however large r is;
- times w_t, the rollout correction's weight (`fastgrpo.grpo.correction`: TIS, masks, IcePop), plus
  kl_coef x the KL estimate to the reference (`kl_estimate`);
- aggregated over the minibatch (`loss_normaliser` gives the denominator that makes micro-batches and
  data-parallel shares add up to it): token_mean sum_{i,t} l / (tokens); seq_mean sum_i mean_t l / N;
  seq_mean_token_sum sum_{i,t} l / N; seq_mean_token_sum_norm sum_{i,t} l / (N L), L a constant (Dr. GRPO,
  Liu et al. arXiv 2503.20783: no length normalisation, so no bias towards long wrong answers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

AGGREGATIONS = ("token_mean", "seq_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")


@dataclass
class LossTerms:
    loss: Tensor  # scalar, already divided by the normaliser
    clipped_tokens: Tensor  # count of tokens whose clipped term was the active one
    dual_clipped_tokens: Tensor  # count of negative-advantage tokens held at dual_clip x |A|
    clamped_tokens: Tensor  # count of tokens whose policy log-ratio was beyond log_ratio_clamp
    kl_ref_sum: Tensor  # sum of the KL estimate over tokens (0 if no reference)


def loss_normaliser(aggregation: str, mask: Tensor, norm_tokens: int = 0) -> float:
    """The denominator of a minibatch's loss (`mask`: its response tokens, [N, T]): its token count for
    token_mean, its number of sequences N for seq_mean and seq_mean_token_sum, N x `norm_tokens` (Dr.
    GRPO's constant) for seq_mean_token_sum_norm. At least 1 (an empty minibatch trains nothing)."""
    if aggregation == "token_mean":
        return max(float(mask.sum()), 1.0)
    if aggregation in ("seq_mean", "seq_mean_token_sum"):
        return max(float(mask.shape[0]), 1.0)
    if aggregation == "seq_mean_token_sum_norm":
        if norm_tokens < 1:
            raise ValueError("seq_mean_token_sum_norm needs its constant: grpo.loss_norm_tokens >= 1 "
                             "(GRPOConfig.for_rollout resolves 0 to rollout.max_new_tokens)")
        return max(float(mask.shape[0]) * norm_tokens, 1.0)
    raise ValueError(f"unknown loss aggregation {aggregation!r}")


def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: str = "k3", clamp: float = 0.0) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi (Schulman, "Approximating KL
    divergence", 2020), with x = log pi - log pi_ref (clamped to +-`clamp` when > 0):
    k1 = x (unbiased, but negative on some tokens and high-variance); k2 = x^2 / 2 (biased, low variance;
    its gradient is the reverse KL's); k3 = exp(-x) + x - 1 (unbiased and non-negative)."""
    x = logp - ref_logp
    if clamp > 0:
        x = x.clamp(-clamp, clamp)
    if estimator == "k1":
        return x
    if estimator == "k2":
        return 0.5 * x.square()
    if estimator == "k3":
        return torch.exp(-x) + x - 1
    raise ValueError(f"unknown KL estimator {estimator!r}")


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
    ratio_level: str = "token",
    dual_clip: float = 0.0,
    log_ratio_clamp: float = 0.0,
    correction_weight: Tensor | None = None,
    ref_logp: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
) -> LossTerms:
    """logp, old_logp, mask, correction_weight, ref_logp: [N, T]; advantages: [N]. The module's formula;
    `normaliser` from `loss_normaliser` over the whole minibatch."""
    real = mask.bool()
    mask = mask.to(logp.dtype)
    delta = torch.where(real, logp - old_logp, torch.zeros_like(logp))
    if ratio_level == "sequence":
        seq = delta.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        log_ratio = logp - logp.detach() + seq.detach()
    elif ratio_level == "token":
        log_ratio = delta
    else:
        raise ValueError(f"unknown ratio level {ratio_level!r}")
    clamped_tokens = logp.new_zeros(())
    if log_ratio_clamp > 0:
        clamped_tokens = ((log_ratio.detach().abs() > log_ratio_clamp) & real).sum().to(logp.dtype)
        log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    adv = advantages[:, None].to(logp.dtype)
    unclipped = -ratio * adv
    clipped = -torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv
    per_token = torch.maximum(unclipped, clipped)
    clipped_tokens = ((clipped > unclipped) & real).sum().detach().to(logp.dtype)
    dual_clipped_tokens = logp.new_zeros(())
    if dual_clip > 0:
        bound = -dual_clip * adv  # c |A| where A < 0
        held = (adv < 0) & (per_token > bound)
        per_token = torch.where(held, bound.expand_as(per_token), per_token)
        dual_clipped_tokens = (held & real).sum().detach().to(logp.dtype)
    if correction_weight is not None:
        per_token = per_token * correction_weight
    kl_sum = logp.new_zeros(())
    if ref_logp is not None:
        kl = kl_estimate(logp, ref_logp, kl_estimator, log_ratio_clamp)
        kl_sum = (kl * mask).sum().detach()
        per_token = per_token + kl_coef * kl
    per_token = torch.where(real, per_token, torch.zeros_like(per_token))
    if aggregation == "seq_mean":
        loss = (per_token.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / normaliser
    elif aggregation in AGGREGATIONS:
        loss = per_token.sum() / normaliser
    else:
        raise ValueError(f"unknown loss aggregation {aggregation!r}")
    return LossTerms(loss, clipped_tokens, dual_clipped_tokens, clamped_tokens.detach(), kl_sum)
