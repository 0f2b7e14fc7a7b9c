"""Sampling: the distribution every emitted token is drawn from, its log-probabilities, and the noise.

`sampling_logprobs` is the single definition of "the policy's sampling distribution" (temperature,
then top-k, then top-p, renormalised). The engine samples from it and reports its log-probabilities;
speculative verification samples from the very same function, which is what makes it lossless.

The randomness is counter-based: the token at position t of request r is the inverse-CDF sample of
that distribution at a uniform u = hash(seed, r, t). A request's tokens are then a function of its
own logits only, not of what else runs in the batch, of the speculation policy, or of timing; and
since verification samples each position with that position's u, speculative and plain decoding
emit the same tokens (up to float rounding flipping a sample that lands on a CDF boundary). Each u
is used for exactly one emitted token, so samples stay exact draws of the distribution.

Why here, in `fastgrpo/models/`, and not in an engine: both sides of the sampling contract use it. The
embedded engine samples and verifies with it; the trainers (torch, DeepSpeed, Megatron's vocab-parallel
logprobs) score the sampled tokens with the same `sampling_logprobs`, whichever engine sampled them (the
tests hold both engines' log-probabilities to it). Nothing here runs a model, so it sits below the engines and
the trainers, which import it without importing an engine.
"""

from __future__ import annotations

import functools
import torch
from torch import Tensor

from fastgrpo.types import SamplingParams


def cuts(p: SamplingParams) -> bool:
    """Top-k or top-p cut the sampling distribution (which tokens can be sampled depends on the ranking)."""
    return not p.greedy and (p.top_k > 0 or p.top_p < 1.0)


def sampling_logprobs(logits: Tensor, p: SamplingParams, sampled: Tensor | None = None,
                      sets: Tensor | None = None) -> Tensor:
    """Log-probabilities of the sampling distribution, -inf outside the top-k / top-p set.

    Greedy decoding reports the temperature-1 log-probabilities (its own distribution is a point mass).
    The trainer scores tokens the engine sampled with this same function on its own logits. Which
    tokens top-k / top-p keep depends on the ranking, and the trainer's logits are a rounding error
    away from the engine's: a token near the cut can fall on the other side and change the
    normaliser. So the trainer passes `sets` ([..., K] token ids, -1 padded), the sets the engine
    sampled each token from, and the distribution is renormalised over exactly those (positions whose
    set is all -1 keep the set computed here). There, `sampled` ([...] token ids) are at least kept in
    the set (their log-probabilities stay finite).
    """
    logits = logits.float()
    if p.greedy:
        return torch.log_softmax(logits, dim=-1)
    logits = logits / p.temperature
    scaled = logits
    if not cuts(p):
        return torch.log_softmax(logits, dim=-1)
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
    if sampled is not None:
        idx = sampled[..., None]
        logits = logits.scatter(-1, idx, scaled.gather(-1, idx))
    if sets is not None:
        given = sets >= 0
        # (scatter_add: the padding's index 0 must not overwrite a real token 0)
        inside = torch.zeros(logits.shape, dtype=torch.int32, device=logits.device).scatter_add(-1, sets.clamp(min=0), given.int()) > 0
        logits = torch.where(given.any(-1, keepdim=True), scaled.masked_fill(~inside, float("-inf")), logits)
    return torch.log_softmax(logits, dim=-1)


def kept_sets(logprobs: Tensor) -> list[list[int]]:
    """The token ids each row of `logprobs` [R, V] can sample (finite entries): what an engine returns
    with each token when top-k / top-p cut, so that the trainer scores in the same set."""
    rows, ids = torch.isfinite(logprobs).nonzero(as_tuple=True)
    counts = torch.bincount(rows, minlength=logprobs.shape[0]).tolist()
    return [chunk.tolist() for chunk in ids.split(counts)]


_M32 = 0xFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32), in int64 without overflow (same bits on every device)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer finaliser (xorshift-multiply, constants of Wellons' "lowbias32")."""
    x = x & _M32
    x = _mul32(x ^ (x >> 16), 0x7FEB352D)
    x = _mul32(x ^ (x >> 15), 0x846CA68B)
    return x ^ (x >> 16)


@functools.lru_cache(maxsize=256)
def seed_key(seed: int) -> int:
    """The seed's part of the hash, mixed from its two 32-bit halves: once per seed, not per step."""
    return int(_mix32(torch.tensor(seed & _M32, device="cpu") + _mix32(torch.tensor((seed >> 32) & _M32, device="cpu"))))


def sampling_uniforms(seed: int | Tensor, request: Tensor, position: Tensor) -> Tensor:
    """Uniforms in (0, 1), float64 with 53 random bits, one per (seed, request, position) element.

    `seed` may be given as a 0-d tensor holding `seed_key(seed)`: a step function captured once as a
    graph reads the seed from that buffer, so one graph serves every seed."""
    request, position = torch.broadcast_tensors(request.long(), position.long())
    key = seed if isinstance(seed, Tensor) else seed_key(seed)
    h = _mix32(_mix32(request + key) + position)
    h2 = _mix32(h ^ 0x9E3779B9)
    bits = (h << 21) | (h2 >> 11)  # 32 + 21 bits
    return (bits.double() + 0.5) / 2.0**53


# total x BELOW is nextafter(total, 0), the double just below total, for every total from 2^-1021 up (a
# CDF's is about 1; or 0, for a row of -inf, which both leave 0): the exact product, total - total 2^-53,
# lies within half a unit in the last place of that neighbour and further from total, so it rounds to the
# neighbour. One kernel where nextafter needs two (the zeros it aims at)
BELOW = 1.0 - 2.0**-53


def sample(logprobs: Tensor, p: SamplingParams, uniforms: Tensor | None = None) -> Tensor:
    """One token per row of `logprobs` [..., V]: the inverse-CDF sample at `uniforms` [...]
    (from `sampling_uniforms`; fresh torch randomness if None). Tokens outside the top-k / top-p set
    have probability 0, so they own an empty CDF interval and are never returned."""
    if p.greedy:
        return logprobs.argmax(dim=-1)
    if uniforms is None:
        uniforms = torch.rand(logprobs.shape[:-1], dtype=torch.float64, device=logprobs.device)
    cdf = logprobs.double().exp().cumsum(-1)
    total = cdf[..., -1:]
    target = torch.minimum(uniforms[..., None] * total, total * BELOW)
    # (the clamp: a row of a padded batch that holds no sequence must still index the vocabulary)
    return torch.searchsorted(cdf, target, right=True)[..., 0].clamp(max=logprobs.shape[-1] - 1)
