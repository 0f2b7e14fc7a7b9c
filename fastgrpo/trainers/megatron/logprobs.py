"""Per-token log-probabilities and entropy of the sampling distribution from vocab-parallel logits.

Each tensor-parallel rank holds the logits of its slice of the (padded) vocabulary. At temperature T
with no top-k / top-p, the distribution needs three reductions over TP ranks and never the whole
vocabulary on one rank: the max (for stability; no gradient flows through it), the sum of exp, and
the target token's logit (held by exactly one rank). The entropy is log Z - E_p[z], one more sum.
Megatron's `reduce_from_tensor_model_parallel_region` all-reduces forward and passes the gradient
through unchanged backward, which is right here: every rank computes the same loss from the reduced
values, and each rank's gradient reaches its own logits.

With top-k or top-p the kept set depends on the whole vocabulary's ranking, so the logits are
gathered and scored by `sampling_logprobs`, the one definition the engine samples from. Padded
vocabulary rows (beyond the tokenizer's vocabulary) are never part of the distribution.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fastgrpo.models.sampling import sampling_logprobs
from fastgrpo.types import SamplingParams


def vocab_parallel_logprobs(logits: Tensor, tokens: Tensor, sampling: SamplingParams, vocab: int,
                            sets: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """logits [..., V/tp] of this TP rank, tokens [...] -> (log-probability of each token, entropy of
    the sampling distribution at that position), both [...]; `sets` [..., K]: the sets the engine
    sampled from (see `sampling_logprobs`)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import (gather_from_tensor_model_parallel_region,
                                                        reduce_from_tensor_model_parallel_region)

    group = parallel_state.get_tensor_model_parallel_group()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    per_rank = logits.shape[-1]
    first = tp_rank * per_rank
    if sampling.top_k or sampling.top_p < 1.0:
        full = gather_from_tensor_model_parallel_region(logits, group)[..., :vocab]
        logp_all = sampling_logprobs(full, sampling, sampled=tokens, sets=sets)
        logp = logp_all.gather(-1, tokens[..., None])[..., 0]
        entropy = -(logp_all.exp() * logp_all.masked_fill(torch.isinf(logp_all), 0.0)).sum(-1)
        return logp, entropy

    z = logits.float() / (sampling.temperature if not sampling.greedy else 1.0)
    padded = torch.arange(first, first + per_rank, device=z.device) >= vocab
    z = z.masked_fill(padded, float("-inf"))
    zmax = z.detach().max(-1, keepdim=True).values
    torch.distributed.all_reduce(zmax, op=torch.distributed.ReduceOp.MAX, group=group)
    z = z - zmax
    e = z.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(e.sum(-1), group)
    local = tokens - first
    mine = (local >= 0) & (local < per_rank)
    target = z.gather(-1, local.clamp(0, per_rank - 1)[..., None])[..., 0].masked_fill(~mine, 0.0)
    target = reduce_from_tensor_model_parallel_region(target, group)
    log_z = sum_exp.log()
    expected_z = reduce_from_tensor_model_parallel_region((e * z.masked_fill(padded, 0.0)).sum(-1), group) / sum_exp
    return target - log_z, log_z - expected_z
