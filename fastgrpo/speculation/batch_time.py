"""A fixed-length batch's remaining time under a tree shape held to its end: what `Aware` ranks shapes by
where every row's length is known (EOS ignored), since rows of a tree end unevenly and the batch with its
slowest (docs/speculation.md, "A batch of known lengths")."""

from __future__ import annotations

import math

import numpy as np


def normal_cdf(x: np.ndarray) -> np.ndarray:
    """The standard normal's distribution function, by its tanh form (within 2e-4 of it; numpy has no erf)."""
    return 0.5 * (1.0 + np.tanh(0.7978845608 * (x + 0.044715 * x**3)))


def batch_seconds(left: np.ndarray, rows: np.ndarray, mean: np.ndarray, second: np.ndarray, at_batch: np.ndarray,
                  at_one: np.ndarray, batch: int) -> np.ndarray:
    """Per shape, held until the batch ends: the seconds until its last row ends. `rows[u]` rows have `left[u]`
    tokens left each (exact: EOS ignored); a row emits X tokens a step, E[X] `mean`, E[X^2] `second`; a step
    of n rows costs a + b n (`at_one` at one row, `at_batch` at `batch` rows). Steps run while any row does,
    so the batch costs a E[its last row's steps] + b E[all rows' steps]. A row's steps to emit L tokens, by
    renewal theory: mean (L - 1 + E[X (X + 1)] / (2 E[X])) / E[X] (its last step overshoots), variance
    L Var[X] / E[X]^3, taken as normal (plain decoding: exactly L). Rows of a tree end unevenly and the batch
    with its slowest, some two standard deviations past the mean at 64 rows, at a step cost that hardly
    falls with the rows: a tree's rate a step overstates what it saves a short batch."""
    mean, second = mean[:, None], second[:, None]
    mu = (left[None, :] - 1 + (second + mean) / (2 * mean)) / mean  # [shapes, row groups]
    sd = np.sqrt(left[None, :] * np.maximum(second - mean**2, 0.0) / mean**3)
    summed = (rows[None, :] * mu).sum(axis=1)
    # E[max] = sum over steps k of P(the last row runs past k): 1 below the longest row's lower reach, 0
    # above its upper (4.5 standard deviations); summed at up to 32 steps between (a stride beyond), with a
    # continuity correction, over the rows that can still be running there
    lo = np.maximum(np.floor((mu - 4.5 * sd).max(axis=1) - 0.5), 0.0)
    hi = np.ceil((mu + 4.5 * sd).max(axis=1))
    late = (mu + 4.5 * sd >= lo[:, None]).any(axis=0)
    mu, sd, rows = mu[:, late], sd[:, late], rows[late]
    stride = max(1.0, math.ceil(float((hi - lo).max(initial=0.0)) / 32))
    k = lo[:, None] + stride * np.arange(32)[None, :] + (stride - 1) / 2  # [shapes, steps]
    below = normal_cdf((k[:, :, None] + 0.5 - mu[:, None, :]) / np.maximum(sd, 1e-9)[:, None, :])
    all_ended = np.exp((rows * np.log(np.maximum(below, 1e-300))).sum(axis=2))
    last = lo + stride * np.where(k < hi[:, None], 1.0 - all_ended, 0.0).sum(axis=1)
    per_row = (at_batch - at_one) / (batch - 1) if batch > 1 else np.zeros_like(at_batch)
    per_row = np.maximum(per_row, 0.0)
    fixed = np.maximum(at_batch - per_row * batch, 0.0)
    return fixed * last + per_row * summed
