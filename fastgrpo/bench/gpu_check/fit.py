"""The simulator's GPU step price fitted to the steps the gpu check measured.

`bench simulate` prices a GPU's decode steps with `speculation/roofline.py`'s `Roofline`: bytes and flops
over the accelerator's achievable peak, plus fixed overheads per target forward, per draft forward, per
step and per speculative step (`Accelerator`'s constants, assumptions until a GPU measured them). In
that price a step is linear in four numbers:

    plain step       = s R(step) + a
    speculative step = s R(step) + a + o + d k

R is the roofline term with every overhead zero, s its scale (1 / the efficiency the profile assumes),
a the target forward's overhead plus the step's (they always come together), o the speculative step's
own, k a draft forward's and d the tree's depth (its draft forwards). `fit_overheads` finds the four,
all non-negative, that minimise the steps' squared relative error, and returns the accelerator they
make: the efficiencies divided by s, a split between target and step in the profile's own ratio. Each
measured step is set against the price before and after, and against a fit of the other levels alone
(held out), so that a fit that merely memorises its points shows.

numpy only (the GPU machine has no scipy): four unknowns, so the non-negative least squares is solved
exactly by trying every subset of the overheads, each by ordinary least squares.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fastgrpo.speculation.roofline import Accelerator, ModelShape, Roofline
from fastgrpo.speculation.spec import SpecConfig

OVERHEADS = ("target_overhead_s", "draft_overhead_s", "step_overhead_s", "spec_overhead_s")


@dataclass(frozen=True)
class StepPoint:
    """One measured step: its shape (None: plain), rows, the draft's catch-up width per row, the context
    it read per row, and its median seconds."""

    config: SpecConfig | None
    rows: int
    width: float
    context: float
    seconds: float
    level: int  # the running sequences it was measured at (the held-out fits leave one level out)


def price(hw: Accelerator, shape: ModelShape, p: StepPoint) -> float:
    """The simulator's seconds for step `p` on `hw`."""
    roof = Roofline(hw, shape)
    ctx_sum = int(round(p.rows * p.context))
    if p.config is None:
        return roof.decode_step(p.rows, int(p.context), ctx_sum)
    return roof.spec_step(p.config, p.rows, max(int(round(p.width)), 1), int(p.context), ctx_sum)


def _zero(hw: Accelerator) -> Accelerator:
    return dataclasses.replace(hw, **dict.fromkeys(OVERHEADS, 0.0))


def _design(hw: Accelerator, shape: ModelShape, points: Sequence[StepPoint]) -> np.ndarray:
    """Columns: R (roofline, no overheads), 1 (a), speculative (o), depth if speculative (k)."""
    zero = _zero(hw)
    rows = [[price(zero, shape, p), 1.0, float(p.config is not None), float(p.config.depth if p.config else 0)]
            for p in points]
    return np.asarray(rows, dtype=float)


def _nnls(A: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min |A x - y| with x >= 0 and x[0] > 0 (the roofline's scale), by ordinary least squares on every
    subset of the other columns (exact for four unknowns); the smallest residual among the feasible."""
    best, best_res = None, math.inf
    others = range(1, A.shape[1])
    for r in range(len(others) + 1):
        for subset in itertools.combinations(others, r):
            cols = [0, *subset]
            x_s, *_ = np.linalg.lstsq(A[:, cols], y, rcond=None)
            if x_s[0] <= 0 or any(v < 0 for v in x_s[1:]):
                continue
            x = np.zeros(A.shape[1])
            x[cols] = x_s
            res = float(np.sum((A @ x - y) ** 2))
            if res < best_res - 1e-18:
                best, best_res = x, res
    if best is None:  # nothing feasible (a roofline term the steps run faster than): the profile's scale
        best = np.zeros(A.shape[1])
        best[0] = 1.0
    return best


def fitted_accelerator(hw: Accelerator, x: Sequence[float]) -> Accelerator:
    """The accelerator whose price is s R + a (+ o + d k): efficiencies over s, a split between the
    target's and the step's overheads in `hw`'s ratio."""
    s, a, o, k = (float(v) for v in x)
    share = hw.target_overhead_s / max(hw.target_overhead_s + hw.step_overhead_s, 1e-30)
    return dataclasses.replace(hw, bw_eff=hw.bw_eff / s, flops_eff=hw.flops_eff / s, target_overhead_s=a * share,
                               step_overhead_s=a * (1 - share), spec_overhead_s=o, draft_overhead_s=k)


def fit(hw: Accelerator, shape: ModelShape, points: Sequence[StepPoint]) -> Accelerator:
    """The accelerator fitted to `points` (relative errors weighted alike)."""
    A = _design(hw, shape, points)
    y = np.asarray([p.seconds for p in points], dtype=float)
    w = 1.0 / y
    # a plain step at the fit's start is the profile's own price: s R + a with hw's constants
    x = _nnls(A * w[:, None], np.ones_like(y))
    return fitted_accelerator(hw, x)


def constants(hw: Accelerator) -> dict[str, float]:
    return {"bw_eff": hw.bw_eff, "flops_eff": hw.flops_eff} | {k: getattr(hw, k) for k in OVERHEADS}


def _errors(hw: Accelerator, shape: ModelShape, points: Sequence[StepPoint]) -> list[float]:
    return [price(hw, shape, p) / p.seconds - 1 for p in points]


def _summary(errors: Sequence[float]) -> dict[str, float]:
    return {"max_abs_error": max(abs(e) for e in errors), "median_abs_error": statistics.median(abs(e) for e in errors)}


def fit_overheads(hw: Accelerator, shape: ModelShape, points: Sequence[StepPoint]) -> dict[str, Any]:
    """The fit and its errors: before (`hw` as the simulator has it), after (the fit to every point), and
    held out (each level priced by a fit to the other levels; absent with one level)."""
    if not points:
        raise ValueError("no measured steps to fit the simulator to")
    after = fit(hw, shape, points)
    before_e, after_e = _errors(hw, shape, points), _errors(after, shape, points)
    held: list[float | None] = [None] * len(points)
    levels = sorted({p.level for p in points})
    if len(levels) > 1:
        for level in levels:
            rest = [p for p in points if p.level != level]
            other = fit(hw, shape, rest)
            for i, p in enumerate(points):
                if p.level == level:
                    held[i] = price(other, shape, p) / p.seconds - 1
    out: dict[str, Any] = {
        "profile": hw.name, "before": constants(hw), "after": constants(after),
        "error_before": _summary(before_e), "error_after": _summary(after_e),
        "points": [{"level": p.level, "rows": p.rows, "shape": "plain" if p.config is None else p.config.name,
                    "width": p.width, "context": p.context, "measured_ms": 1000 * p.seconds,
                    "before_ms": 1000 * price(hw, shape, p), "after_ms": 1000 * price(after, shape, p),
                    "error_before": eb, "error_after": ea, "error_held_out": eh}
                   for p, eb, ea, eh in zip(points, before_e, after_e, held)]}
    if all(e is not None for e in held):
        out["error_held_out"] = _summary([e for e in held if e is not None])
    return out
