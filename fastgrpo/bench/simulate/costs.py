"""bench simulate: costs: the seconds of every kind of engine work, for one accelerator and model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from fastgrpo.config import SpeculationConfig
from fastgrpo.speculation.cost_model import CONTEXT, CostModel, piecewise_linear_at
from fastgrpo.speculation.spec import SpecConfig


# the config's default static tree (the GRPO batch's fixed trees are bench rollout's STATIC_SWEEP)
STATIC_DEFAULT = SpecConfig(SpeculationConfig.depth, SpeculationConfig.topk, SpeculationConfig.num_verify)


class Costs(Protocol):
    name: str
    # attention reads every row to the longest row's context (our engine's padded cache), not each
    # row's own (a paged cache): what a speculation policy is told the rows' context is
    padded: bool

    def target(self, B: int, n: int, ctx_max: int, ctx_sum: int) -> float:
        """One target forward of B rows x n new tokens over cached contexts (longest, summed)."""

    def draft(self, B: int, n: int, ctx_max: int, ctx_sum: int) -> float:
        """One draft forward (its decoder layer and the LM head) of B rows x n tokens."""

    def decode_step(self, B: int, ctx_max: int, ctx_sum: int, speculating: bool = False) -> float:
        """A plain step; `speculating`: under a speculating policy (the engine then keeps the states
        the draft will catch up on)."""

    def spec_step(self, c: SpecConfig, B: int, width: int, ctx_max: int, ctx_sum: int,
                  verified: float | None = None) -> float:
        """Catch-up of `width` states per row, the tree's levels, the verify forward, sampling, bookkeeping.
        `verified`: tokens verified per row on average (a per-sequence budget; default the whole tree)."""

    def prefill(self, unique: int, width: int, joined: int) -> float: ...

    def between_steps(self, B: int) -> float:
        """Engine time per decode step outside the timed step (scheduling, retiring, statistics)."""

    def per_call(self, sequences: int) -> float: ...


@dataclass
class CpuCosts:
    """This machine running the bench policy: the engine's own calibration sweep (target and draft
    forwards by tokens per forward, at the sweep's fixed context) plus what the engine spends that
    the sweep does not see, each measured on the engine (`CpuProfiler`): attention past the
    sweep's context, the step's work around its forwards (sampling, tree build and verification,
    cache bookkeeping), prefill, and the engine loop between steps.

    What is measured on a grid (running rows, prefill tokens) is interpolated piecewise linearly
    between the grid's points, not fitted by one line: a plain step's work beyond its forward and a
    prefill's time are not linear over 1-64 rows on this CPU (a 64-prompt prefill costs 2.4-2.7x a
    32-prompt one for 2.1x the tokens)."""

    curve: CostModel  # with the calibration's context rates (CostModel.context_s)
    # what the engine spends beyond the forwards (empty: nothing, as while the profile is being fitted)
    off_extra: dict[int, float] = field(default_factory=dict)  # a plain step beyond its forward, by running rows
    spec_extra: dict[int, float] = field(default_factory=dict)  # a speculative step beyond its forwards, by rows B,
    spec_slopes: tuple[float, ...] = (0.0, 0.0, 0.0)  # plus per token verified (B n), per level, per B depth top-k^2
    # a profiled shape's measured residual less the fit's, by rows: where a shape was measured it is
    # priced as measured (between two levels interpolated, beyond them the nearest level's)
    spec_measured: dict[SpecConfig, dict[int, float]] = field(default_factory=dict)
    prefill_table: dict[int, float] = field(default_factory=dict)  # a prefill by unique prompt tokens (x longest)
    copy_s: float = 0.0  # per row joined beyond its prompt's first (a group's samples share one prefill)
    other_fit: tuple[float, ...] = (0.0, 0.0, 0.0)  # outside the steps: per call, per step, per running row per step
    plain_extra: dict[int, float] = field(default_factory=dict)  # off_extra while a speculating policy runs
    name: str = "this CPU / bench policy"
    padded = True

    @staticmethod
    def _grid(table: dict[int, float], x: float) -> float:
        xs = sorted(table)
        return float(np.interp(x, xs, [table[k] for k in xs])) if xs else 0.0

    def _prefill_tokens(self, tokens: float) -> float:
        """Past the grid's largest point at its last segment's slope (a prefill of more rows than the
        engine holds happens in several calls); below its smallest (one prompt) as the sweep's target
        forward of one row scales (the profile's prompt is longer than some of the validation's: held
        flat, a 12-token prompt's prefill was priced 79% high)."""
        xs = sorted(self.prefill_table)
        if xs and tokens < xs[0]:
            scale = self.curve.target(max(tokens, 1), rows=1) / self.curve.target(xs[0], rows=1)
            return self.prefill_table[xs[0]] * scale
        if len(xs) < 2:
            return self._grid(self.prefill_table, tokens)
        return piecewise_linear_at(xs, [self.prefill_table[x] for x in xs], tokens)

    def _context(self, kind: str, B: int, n: int, ctx_max: int) -> float:
        """Context cost of (B rows, n tokens each, over ctx_max cached) beyond what the sweep's point of
        B n tokens (min(B n, 64) rows over CONTEXT) already holds."""
        tokens, rows = B * n, min(B * n, 64)
        rates = self.curve.context_s
        return rates[f"{kind}_row"] * (B * ctx_max - rows * CONTEXT) + rates[f"{kind}_token"] * tokens * (ctx_max - CONTEXT)

    def target(self, B: int, n: int, ctx_max: int, ctx_sum: int) -> float:
        base = self.curve.target(B * n)
        return max(base + self._context("target", B, n, ctx_max), 0.3 * base)

    def draft(self, B: int, n: int, ctx_max: int, ctx_sum: int) -> float:
        base = self.curve.draft(B * n)
        return max(base + self._context("draft", B, n, ctx_max), 0.3 * base)

    def decode_step(self, B: int, ctx_max: int, ctx_sum: int, speculating: bool = False) -> float:
        extra = self._grid(self.plain_extra if speculating and self.plain_extra else self.off_extra, B)
        return self._plus_extra(self.target(B, 1, ctx_max, ctx_sum), extra)

    @staticmethod
    def _plus_extra(forwards: float, extra: float) -> float:
        """A step's forwards plus its measured extra, which is negative where the engine's step costs
        less than the sweep's forwards at its shape (held at zero, such steps are priced high). Never
        below half the forwards: a guard against a fit extrapolated far from
        what it measured."""
        return max(forwards + extra, 0.5 * forwards)

    def spec_forwards(self, c: SpecConfig, B: int, width: int, ctx_max: int, verified: float | None = None) -> float:
        return (self.draft(B, width, ctx_max, 0) + (c.depth - 1) * self.draft(B, c.topk, ctx_max, 0)
                + self.target(B, verified or c.num_verify, ctx_max, 0))

    def spec_step(self, c: SpecConfig, B: int, width: int, ctx_max: int, ctx_sum: int,
                  verified: float | None = None) -> float:
        k, d, e = self.spec_slopes  # e: each level's top-k of top-k candidates per row
        n = verified or c.num_verify
        extra = (self._grid(self.spec_extra, B) + k * B * n + d * c.depth + e * B * c.depth * c.topk**2
                 + self._grid(self.spec_measured.get(c, {}), B))
        # never below a plain step of its rows: a speculative step runs the target over at least as many
        # tokens, and the draft besides (a fit read far from its shapes can say less)
        return max(self._plus_extra(self.spec_forwards(c, B, width, ctx_max, verified), extra),
                   self.decode_step(B, ctx_max, ctx_sum, speculating=True))

    def prefill(self, unique: int, width: int, joined: int) -> float:
        return max(self._prefill_tokens(unique * width) + self.copy_s * (joined - unique), 0.0)

    def between_steps(self, B: int) -> float:
        _, per_step, per_row = self.other_fit
        return max(per_step + per_row * B, 0.0)

    def per_call(self, sequences: int) -> float:
        return max(self.other_fit[0], 0.0)

    def to_json(self) -> dict:
        return {"curve": self.curve.to_json(), "off_extra": self.off_extra,
                "plain_extra": self.plain_extra,
                "spec_extra": self.spec_extra, "spec_slopes": self.spec_slopes,
                "spec_measured": {c.name: table for c, table in self.spec_measured.items()},
                "prefill_table": self.prefill_table,
                "copy_s": self.copy_s, "other_fit": self.other_fit}
