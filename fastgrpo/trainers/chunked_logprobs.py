"""Per-token log-probabilities and entropy from the final hidden states, a chunk of tokens at a time.

The GRPO loss needs two numbers per scored token: the sampled token's log-probability under the
sampling distribution and that distribution's entropy. Computing them from the whole sequence's
logits holds [tokens, vocab] in fp32 several times over (the logits, their log-softmax, the
gradient): one 18K-token sequence over Qwen's 152K vocabulary is 10.4 GiB per copy, the largest
activation of a long-sequence step. `chunked_scores` holds at most `chunk_tokens` positions' logits
at once, in the forward and in the backward:

- forward: each chunk of hidden states is projected onto the vocabulary, scored, and its logits
  dropped before the next chunk; only the scores ([tokens] each) and the inputs are kept;
- backward: each chunk's logits are recomputed from its hidden states (one more LM-head matmul per
  chunk: the price of the memory), the gradient of its scores is taken with respect to those logits,
  and turned into the chunk's rows of the hidden states' gradient and its share of the weight's
  gradient right there, before the next chunk.

The result is the unchunked computation's to rounding: each position's score is a function of its
own logits alone, and the hidden states' gradient is computed row by row in both. The weight's
gradient sums over chunks; the sum is kept in fp32 and cast to the weight's dtype once, so in bf16
each chunk's product is rounded once (as the unchunked matmul rounds once) and the sum over chunks
adds no bf16 rounding.

`score(logits, tokens, sets)` is the trainer's own scoring of one chunk of logits: `token_scores`
(the torch and DeepSpeed trainers; the sampling distribution of `models.sampling.sampling_logprobs`)
or Megatron's vocab-parallel `vocab_parallel_logprobs` on this TP rank's slice of the vocabulary.
The latter reduces over the TP ranks per chunk; every TP rank runs the same chunks in the same order,
in the forward and in the backward's recompute, so its collectives pair up, and its log-sum-exp
over the vocabulary stays the whole vocabulary's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from fastgrpo.models.sampling import sampling_logprobs
from fastgrpo.types import SamplingParams

# (logits [n, V'], tokens [n], sets [n, K] or None) -> (log-probability [n], entropy [n]), fp32
Score = Callable[[Tensor, Tensor, "Tensor | None"], tuple[Tensor, Tensor]]


def token_scores(logits: Tensor, tokens: Tensor, sampling: SamplingParams,
                 sets: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """logits [..., V] -> (log-probability of each of `tokens` [...], entropy [...]) under the
    sampling distribution (`sampling_logprobs`: temperature, top-k, top-p; `sets` [..., K] the sets
    the engine sampled from). Tokens outside a top-k / top-p set have probability 0 and add nothing to
    the entropy."""
    logp_all = sampling_logprobs(logits, sampling, sampled=tokens, sets=sets)
    logp = logp_all.gather(-1, tokens[..., None])[..., 0]
    entropy = -(logp_all.exp() * logp_all.masked_fill(torch.isinf(logp_all), 0.0)).sum(-1)
    return logp, entropy


def chunked_scores(hidden: Tensor, weight: Tensor, tokens: Tensor, score: Score, chunk_tokens: int,
                   sets: Tensor | None = None, bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """hidden [..., H] (each position's final hidden state), weight [V', H] (the LM head, or this TP
    rank's vocabulary shard of it), tokens [...] -> (log-probability, entropy) [...] each in fp32:
    `score(F.linear(hidden, weight, bias), tokens, sets)`, with at most `chunk_tokens` positions'
    logits alive at once in the forward and the backward (module docstring). `chunk_tokens` 0, or no
    more positions than it: one plain autograd pass (nothing to save by chunking, nothing recomputed).
    The hidden states are taken in the weight's dtype (bf16 hidden states meet bf16 weights)."""
    shape = tokens.shape
    h = hidden.reshape(-1, hidden.shape[-1]).to(weight.dtype)
    flat_tokens = tokens.reshape(-1)
    flat_sets = None if sets is None else sets.reshape(-1, sets.shape[-1])
    if chunk_tokens <= 0 or flat_tokens.numel() <= chunk_tokens:
        logp, entropy = score(F.linear(h, weight, bias), flat_tokens, flat_sets)
    else:
        logp, entropy = _ChunkedScores.apply(h, weight, bias, flat_tokens, flat_sets, score, chunk_tokens)
    return logp.reshape(shape), entropy.reshape(shape)


class _ChunkedScores(torch.autograd.Function):
    """`chunked_scores` over [n, H] hidden states in chunks of `chunk` rows, recomputing each chunk's
    logits in the backward (module docstring)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, tokens: Tensor, sets: Tensor | None,
                score: Score, chunk: int) -> tuple[Tensor, Tensor]:
        logps, entropies = [], []
        for rows in _chunks(hidden.shape[0], chunk):
            logits = F.linear(hidden[rows], weight, bias)
            logp, entropy = score(logits, tokens[rows], None if sets is None else sets[rows])
            del logits  # (the chunk's logits go before the next chunk's come)
            logps.append(logp.float())
            entropies.append(entropy.float())
        ctx.save_for_backward(hidden, weight, bias, tokens, sets)
        ctx.score, ctx.chunk = score, chunk
        return torch.cat(logps), torch.cat(entropies)

    @staticmethod
    def backward(ctx, grad_logp: Tensor, grad_entropy: Tensor):
        hidden, weight, bias, tokens, sets = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # the weight's and bias's gradients summed over chunks in fp32, cast to their dtype once
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_bias else None
        for rows in _chunks(hidden.shape[0], ctx.chunk):
            h = hidden[rows]
            with torch.enable_grad():
                logits = F.linear(h, weight.detach(), None if bias is None else bias.detach()).requires_grad_()
                logp, entropy = ctx.score(logits, tokens[rows], None if sets is None else sets[rows])
                (grad_logits,) = torch.autograd.grad((logp, entropy), logits, (grad_logp[rows], grad_entropy[rows]))
            del logits, logp, entropy
            if need_hidden:
                grad_hidden[rows] = grad_logits @ weight
            if need_weight:
                if weight.dtype == torch.float32:
                    grad_weight.addmm_(grad_logits.t(), h)
                else:  # the chunk's product in the weight's dtype (as the unchunked matmul's), added in fp32
                    grad_weight.add_(grad_logits.t() @ h)
            if need_bias:
                grad_bias += grad_logits.sum(0).float()
            del grad_logits
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None, None)


def _chunks(n: int, chunk: int) -> list[slice]:
    return [slice(start, min(start + chunk, n)) for start in range(0, n, chunk)]
