"""Sampling: the distribution every emitted token is drawn from, and its log-probabilities.

`sampling_logprobs` is the single definition of "the policy's sampling distribution" (temperature,
then top-k, then top-p, renormalised). The engine samples from it and reports its log-probabilities;
speculative verification (later) samples from the very same function, which is what makes it lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 256
    ignore_eos: bool = False  # benchmarks: keep every sequence running for exactly max_new_tokens

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sampling_logprobs(logits: Tensor, p: SamplingParams) -> Tensor:
    """Log-probabilities of the sampling distribution, -inf outside the top-k / top-p set.

    Greedy decoding reports the temperature-1 log-probabilities (its own distribution is a point mass).
    """
    logits = logits.float()
    if p.greedy:
        return torch.log_softmax(logits, dim=-1)
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token if the tokens ranked above it already cover top_p (the first always stays)
        drop_sorted = (probs.cumsum(-1) - probs) >= p.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


def sample(logprobs: Tensor, p: SamplingParams, generator: torch.Generator | None) -> Tensor:
    """One token per row of `logprobs` [..., V]."""
    if p.greedy:
        return logprobs.argmax(dim=-1)
    flat = logprobs.reshape(-1, logprobs.shape[-1]).exp()
    return torch.multinomial(flat, 1, generator=generator).view(logprobs.shape[:-1])
