"""`fastgrpo bench simulate`: one engine's rollout, simulated step by step, and checked against this CPU.

Why: speculation pays where a verify forward of tens of tokens costs about one plain forward (a GPU at
small batch) and where rollouts have a long tail (reasoning RL). Neither exists here. The simulator
replays the engine's scheduling (continuous batching: prefill whenever rows are free, every other
step a plain or speculative decode step of all running rows, finished rows leave at once) with the
REAL speculation policy objects deciding at every step, against a stated cost model of a named
accelerator and model, and accepted lengths drawn from a stated acceptance profile. It is trusted
only as far as, with this machine's measured costs and our engine's measured acceptance, it predicts
the real engine's rollout times, which the same command measures (the "validation" section).

Nothing here hands a policy the simulator's true costs: `aware` gets a cost model built by timing the
simulated forwards with the calibration sweep of `cost_model.calibrate` (same sizes, same fixed
context) and then corrects it, as on the engine, from the step seconds it observes.
"""

from __future__ import annotations

import datetime
import math
import platform
import random
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from fastgrpo.bench.rollout import STATIC_SWEEP, rotated, timed_generate
from fastgrpo.config import SpeculationConfig
from fastgrpo.engine.engine import DRAFT_WINDOW
from fastgrpo.speculation.cost_model import CONTEXT, SWEEP, CostModel, calibrate, piecewise_linear_at
from fastgrpo.speculation.per_sequence import AwarePerSequence
from fastgrpo.speculation.policy import Aware, FastGRPOFormula, Off, SpeculationPolicy, Static
from fastgrpo.speculation.roofline import ACCELERATORS, MODELS, Roofline, simulated_cost_model
from fastgrpo.speculation.tlt import TLT
from fastgrpo.speculation.tree import SpecConfig

# the config's default static tree (the GRPO batch's fixed trees are bench rollout's STATIC_SWEEP)
STATIC_DEFAULT = SpecConfig(SpeculationConfig.depth, SpeculationConfig.topk, SpeculationConfig.num_verify)


# ---------------------------------------------------------------------------------------------
# Costs: the seconds of every kind of engine work, for one accelerator and model
# ---------------------------------------------------------------------------------------------
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
        less than the sweep's forwards at its shape (a step of d4k4n12 at 64 rows 84 ms less, in
        `bench/simulate-quick-2026-11-26-run5.json` in git history; held at zero, such steps were priced 10-22% high
        in three runs). Never below half the forwards: a guard against a fit extrapolated far from
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
        return self._plus_extra(self.spec_forwards(c, B, width, ctx_max, verified), extra)

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


# ---------------------------------------------------------------------------------------------
# Acceptance: draft tokens accepted per sequence per speculative step
# ---------------------------------------------------------------------------------------------
@dataclass
class AcceptanceProfile:
    """P(a tree of shape c accepts >= d tokens) = prod over depths j <= d of cov_j(w), where
    cov_j(w) = 1 - (1 - alpha_j) w^-beta is the chance the target's token at depth j is among the
    w draft candidates kept under the path's node (alpha_j: the top-1 chance, beta: what width adds),
    and w = clamp((n - 1) / depth, 1, top-k) is the tree's fill (the same crude width the engine's
    AcceptanceModel uses as its prior). Shapes measured often enough are drawn from their measured
    histogram instead (`empirical`)."""

    alpha: list[float]  # top-1 acceptance at depth 1, 2, ... (the last repeats beyond)
    beta: float
    empirical: dict[SpecConfig, list[int]] = field(default_factory=dict)  # accepted counts per measured shape
    min_samples: int = 200
    source: str = ""

    def survival(self, c: SpecConfig) -> list[float]:
        """P(accepted >= d) for d = 1..depth."""
        if c in self.empirical and len(self.empirical[c]) >= self.min_samples:
            a = np.asarray(self.empirical[c])
            return [float((a >= d).mean()) for d in range(1, c.depth + 1)]
        w = min(max((c.num_verify - 1) / c.depth, 1.0), c.topk)
        depth = min(c.depth, c.num_verify - 1)
        out, reach = [], 1.0
        for j in range(1, c.depth + 1):
            alpha = self.alpha[min(j, len(self.alpha)) - 1]
            reach *= 0.0 if j > depth else 1 - (1 - alpha) * w ** (-self.beta)
            out.append(reach)
        return out

    def mean(self, c: SpecConfig) -> float:
        return 1.0 + sum(self.survival(c))

    def draw(self, c: SpecConfig, B: int, rng: np.random.Generator) -> np.ndarray:
        if c in self.empirical and len(self.empirical[c]) >= self.min_samples:
            return rng.choice(np.asarray(self.empirical[c]), size=B)
        s = np.asarray(self.survival(c))
        return (rng.random(B)[:, None] < s[None, :]).sum(1)  # survival is non-increasing in depth

    def to_json(self) -> dict:
        return {"alpha": self.alpha, "beta": self.beta, "source": self.source,
                "measured_mean_emitted": {c.name: 1 + float(np.mean(v)) for c, v in self.empirical.items()},
                "measured_samples": {c.name: len(v) for c, v in self.empirical.items()}}


@dataclass(frozen=True)
class DraftConfidence:
    """What a per-sequence budget sees: each row's tree as `levels` levels of w = the profile's fill
    nodes (w chains from the root), each node carrying a 1/w share of its level's reach, where the
    draft's estimate that row r's step accepts >= j tokens is

        s_hat_r(j) = rho * [L_r >= j] + (1 - rho) * s(j)

    L_r: the row's accepted length with the whole tree, drawn from the profile as for every other
    policy; s(j): the profile's survival. rho (0: the draft cannot tell rows apart, 1: it knows each
    outcome) is an ASSUMPTION stated with every result; the estimate is calibrated over rows
    (E s_hat = s). The accepted path runs along one of the w chains, uniformly: a row accepts
    min(L_r, the levels along that chain whose node was verified)."""

    rho: float = 0.5

    def tree(self, profile: AcceptanceProfile, c: SpecConfig, B: int,
             rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """(scores [B, levels * w] cumulative log-probabilities, depth [B, levels * w], L [B], w)."""
        w = max(1, min((c.num_verify - 1) // c.depth, c.topk))
        s = np.asarray(profile.survival(c))
        L = profile.draw(c, B, rng)
        reach = self.rho * (L[:, None] >= np.arange(1, c.depth + 1)[None]) + (1 - self.rho) * s[None]
        with np.errstate(divide="ignore"):
            scores = np.log(np.repeat(reach / w, w, axis=1))
        depth = np.repeat(np.arange(1, c.depth + 1), w)[None].repeat(B, 0)
        return scores, depth, L, w

    @staticmethod
    def accepted(nodes: np.ndarray, L: np.ndarray, w: int, rng: np.random.Generator) -> np.ndarray:
        """Accepted lengths given the verified nodes [B, levels * w] (level-major, chain k at offset k)."""
        B = len(L)
        chain = rng.integers(0, w, size=B)
        on_path = nodes.reshape(B, -1, w)[np.arange(B), :, chain]  # [B, levels]
        kept = np.cumprod(on_path, axis=1).sum(1)  # levels verified along the row's chain
        return np.minimum(L, kept)


def fit_acceptance(measured: dict[SpecConfig, list[int]], source: str) -> AcceptanceProfile:
    """alpha_j = alpha_1 gamma^(j-1) and beta fitted (grid search) to the mean accepted length of
    every measured shape, weighted by its samples; the measured histograms are kept."""
    data = [(c, float(np.mean(v)), len(v)) for c, v in measured.items() if v]
    best, best_err = ([0.6], 0.5), float("inf")
    for a1 in np.linspace(0.05, 0.97, 47):
        for gamma in np.linspace(0.6, 1.2, 13):
            alpha = [min(a1 * gamma ** j, 0.99) for j in range(8)]
            for beta in np.linspace(0.0, 1.5, 16):
                p = AcceptanceProfile(alpha, beta)
                err = sum(n * (p.mean(c) - 1 - m) ** 2 for c, m, n in data)
                if err < best_err:
                    best, best_err = (alpha, float(beta)), err
    return AcceptanceProfile(best[0], best[1], {c: list(v) for c, v in measured.items()}, source=source)


def eagle_profile(beta: float) -> AcceptanceProfile:
    """An EAGLE-3 draft on Llama-3.1-8B-Instruct sampling at temperature 1: a chain of 7 draft tokens
    emits tau = 3.34 tokens per step on GSM8K (3.49 HumanEval, 2.77 MT-bench), as measured with
    proper rejection sampling for the public checkpoint yuhuili/EAGLE3-LLaMA3.1-Instruct-8B in the
    model card of nebius/EAGLE3-Llama-3.3-70B-Instruct (the EAGLE-3 paper, arXiv 2503.01840, reports
    longer ones at temperature 0, which a GRPO rollout does not use). A constant per-depth alpha
    reproducing tau = 3.34 for the chain; what width adds (`beta`) is not in that figure and is taken
    from our own draft's fit (an assumption: a real draft's top-k may gain more or less)."""
    lo, hi = 0.01, 0.99
    for _ in range(60):  # 1 + a + ... + a^7 = 3.34
        a = (lo + hi) / 2
        lo, hi = (a, hi) if sum(a**j for j in range(8)) < 3.34 else (lo, a)
    return AcceptanceProfile([a], beta, source="EAGLE-3, Llama-3.1-8B, T=1, GSM8K tau 3.34 (chain of 7)")


# ---------------------------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SimRequest:
    prompt: int  # prompt identity (samples of one prompt share its prefill)
    prompt_len: int
    length: int  # response tokens the target generates (EOS included), before any cap


@dataclass
class Workload:
    name: str
    requests: list[SimRequest]
    max_new: int
    max_context: int
    description: str = ""


def grpo_workload(name: str, prompt_lens: Sequence[int], lengths: Sequence[Sequence[int]], max_new: int,
                  max_context: int, description: str = "") -> Workload:
    """A GRPO batch: lengths[p] holds the responses of prompt p (its group)."""
    reqs = [SimRequest(p, prompt_lens[p], L) for p, group in enumerate(lengths) for L in group]
    return Workload(name, reqs, max_new, max_context, description)


def longtail_workload(n_prompts: int, group: int, mean: float, sigma: float, max_new: int, prompt_len: int,
                      seed: int) -> Workload:
    """Long-tailed reasoning responses: lognormal lengths of the given mean and log-space sigma, capped
    at max_new (capped ones are the truncated tail). Defaults (bench_simulate) are ASSUMPTIONS
    shaped after published reasoning-RL statistics, not fitted to a figure: DAPO (arXiv 2503.14476)
    trains with responses of up to 16,384 tokens (plus a 4,096-token overlong buffer) and mean lengths
    that grow into the thousands; TLT (arXiv 2511.16665) describes the same persistent long tail, a
    few responses near the cap dominating the step. A prompt's samples share a per-prompt difficulty
    factor (half of the log-variance), as samples of one problem do."""
    rng = np.random.default_rng(seed)
    mu = math.log(mean) - sigma**2 / 2
    lengths = []
    for _ in range(n_prompts):
        shift = rng.normal(0, sigma / math.sqrt(2))
        lengths.append([int(min(max(rng.lognormal(mu + shift, sigma / math.sqrt(2)), 1), max_new))
                        for _ in range(group)])
    return grpo_workload(f"long-tail reasoning (lognormal mean {mean:.0f}, sigma {sigma}, cap {max_new})",
                         [prompt_len] * n_prompts, lengths, max_new, prompt_len + max_new + 1)


def resampled_workload(name: str, prompt_lens: Sequence[int], groups: Sequence[Sequence[int]], n_prompts: int,
                       max_new: int, max_context: int, seed: int) -> Workload:
    """n_prompts groups drawn with replacement from measured (prompt length, group lengths)."""
    rng = random.Random(seed)
    pick = [rng.randrange(len(groups)) for _ in range(n_prompts)]
    return grpo_workload(name, [prompt_lens[i] for i in pick], [groups[i] for i in pick], max_new, max_context)


# ---------------------------------------------------------------------------------------------
# The simulator
# ---------------------------------------------------------------------------------------------
class Rows:
    """The running batch as the engine keeps it: rows 0..B-1, a finished row replaced by the last."""

    def __init__(self):
        self.req = np.zeros(0, dtype=np.int64)
        self.prompt_len = np.zeros(0, dtype=np.int64)
        self.generated = np.zeros(0, dtype=np.int64)
        self.limit = np.zeros(0, dtype=np.int64)
        self.behind = np.zeros(0, dtype=np.int64)  # target states the draft has not seen

    @property
    def n(self) -> int:
        return len(self.req)

    def add(self, req: Sequence[int], prompt_len: Sequence[int], limit: Sequence[int]) -> None:
        """Prefilled rows: the first token is sampled from the prefill's logits."""
        cat = np.concatenate
        self.req = cat([self.req, np.asarray(req, dtype=np.int64)])
        self.prompt_len = cat([self.prompt_len, np.asarray(prompt_len, dtype=np.int64)])
        self.generated = cat([self.generated, np.ones(len(req), dtype=np.int64)])
        self.limit = cat([self.limit, np.asarray(limit, dtype=np.int64)])
        self.behind = cat([self.behind, np.asarray(prompt_len, dtype=np.int64)])

    def context(self) -> tuple[int, int]:
        """(longest, summed) cached tokens of the running rows."""
        ctx = self.prompt_len + self.generated - 1
        return int(ctx.max()), int(ctx.sum())

    def catch_up_width(self) -> int:
        return int(min(self.behind.max(), DRAFT_WINDOW))

    def step_off(self) -> int:
        self.generated += 1
        self.behind += 1
        return self.n

    def step_spec(self, accepted: np.ndarray) -> int:
        emitted = np.minimum(accepted + 1, self.limit - self.generated)
        self.generated += emitted
        self.behind = accepted + 1
        return int(emitted.sum())

    def retire(self) -> list[int]:
        """Finished requests, removed in the engine's order (the last row moves into a freed one)."""
        done = self.generated >= self.limit
        if not done.any():
            return []
        order = list(range(self.n))
        fin = done.tolist()
        out, row = [], 0
        while row < len(order):
            if not fin[order[row]]:
                row += 1
                continue
            out.append(int(self.req[order[row]]))
            order[row] = order[-1]
            order.pop()
        idx = np.asarray(order, dtype=np.int64)
        for a in ("req", "prompt_len", "generated", "limit", "behind"):
            setattr(self, a, getattr(self, a)[idx])
        return out


@dataclass
class SimRun:
    seconds: float
    prefill_s: float
    decode_steps: int
    spec_steps: int
    emitted: int
    policy_s: float  # wall time of the policy's own choose/observe calls
    trace: list[tuple[float, int, str, int, float]]  # per decode step: end time, running, config, emitted, seconds
    finished_order: list[int]


def simulate(workload: Workload, costs: Costs, acceptance: AcceptanceProfile | None, policy: SpeculationPolicy,
             max_batch: int, rng: np.random.Generator, policy_clock: bool = False,
             share_prefill: bool = True, confidence: DraftConfidence = DraftConfidence()) -> SimRun:
    """One engine.generate() call, step by step (the engine's loop: fastgrpo/engine/engine.py).

    `policy` is called exactly as the engine calls it: choose(running) before a step while
    speculating, observe(config, running, emitted, seconds, accepted) after, with the simulated
    step seconds; a policy with a per-sequence budget (`select`) picks the nodes to verify from the
    draft confidences of `confidence`, and the step costs what it verifies. With `policy_clock` the
    policy's own wall time is added to the clock (on this CPU the engine spends it between steps, and
    it is the same code on the same machine)."""
    reqs = workload.requests
    speculating = policy.name != "off"
    select = getattr(policy, "select", None)
    if (begin := getattr(policy, "begin", None)) is not None:  # a policy that decides once per generate call
        begin()
    if speculating and acceptance is None:
        raise ValueError("a speculating policy needs an acceptance profile")
    waiting = deque(range(len(reqs)))
    rows = Rows()
    clock = prefill_s = policy_s = 0.0
    steps = spec_steps = emitted_total = 0
    trace: list[tuple[float, int, str, int, float]] = []
    finished: list[int] = []
    while waiting or rows.n:
        if waiting and rows.n < max_batch:
            joined = [waiting.popleft() for _ in range(min(len(waiting), max_batch - rows.n))]
            keys = [reqs[i].prompt if share_prefill else i for i in joined]
            unique = {k: reqs[i].prompt_len for k, i in zip(keys, joined)}
            s = costs.prefill(len(unique), max(unique.values()), len(joined))
            prefill_s += s
            clock += s
            rows.add(joined, [reqs[i].prompt_len for i in joined],
                     [max(1, min(reqs[i].length, workload.max_new, workload.max_context - reqs[i].prompt_len))
                      for i in joined])
        else:
            B = rows.n
            ctx_max, ctx_sum = rows.context()
            t = time.perf_counter()
            config = policy.choose(B, ctx_max if costs.padded else ctx_sum / B) if speculating else None
            policy_s_step = time.perf_counter() - t
            if config is None:
                seconds = costs.decode_step(B, ctx_max, ctx_sum, speculating)
                accepted = None
                emitted = rows.step_off()
            elif select is None:
                seconds = costs.spec_step(config, B, rows.catch_up_width(), ctx_max, ctx_sum)
                accepted = acceptance.draw(config, B, rng)
                emitted = rows.step_spec(accepted)
                spec_steps += 1
            else:
                scores, depth, L, w = confidence.tree(acceptance, config, B, rng)
                t = time.perf_counter()
                nodes = select(torch.from_numpy(scores), torch.from_numpy(depth), config, B).numpy()
                policy_s_step += time.perf_counter() - t
                seconds = costs.spec_step(config, B, rows.catch_up_width(), ctx_max, ctx_sum,
                                          verified=float(1 + nodes.sum() / B))
                accepted = confidence.accepted(nodes, L, w, rng)
                emitted = rows.step_spec(accepted)
                spec_steps += 1
            t = time.perf_counter()
            policy.observe(config, B, emitted, seconds, None if accepted is None else accepted.tolist())
            policy_s_step += time.perf_counter() - t
            policy_s += policy_s_step
            clock += seconds + costs.between_steps(B) + (policy_s_step if policy_clock else 0.0)
            steps += 1
            emitted_total += emitted
            trace.append((clock, B, "off" if config is None else config.name, emitted, seconds))
        finished += rows.retire()
    clock += costs.per_call(len(reqs))
    return SimRun(clock, prefill_s, steps, spec_steps, emitted_total, policy_s, trace, finished)


def replay_steps(records: list[tuple[SpecConfig | None, int, list[int] | None]], prompt_lens: Sequence[int],
                 limits: Sequence[int]) -> list[tuple[int, int, int]]:
    """(running, catch-up width, longest context) before each decode step of a real engine run whose
    requests all joined in its first prefill, from the configs and accepted lengths its policy saw."""
    rows = Rows()
    rows.add(list(range(len(prompt_lens))), prompt_lens, limits)
    rows.retire()
    out = []
    for config, running, accepted in records:
        assert running == rows.n, (running, rows.n)
        out.append((rows.n, rows.catch_up_width(), rows.context()[0]))
        if config is None or accepted is None:
            rows.step_off()
        else:
            rows.step_spec(np.asarray(accepted, dtype=np.int64))
        rows.retire()
    return out


# ---------------------------------------------------------------------------------------------
# Policies
# ---------------------------------------------------------------------------------------------
def sim_policies(costs: Costs, statics: Sequence[SpecConfig], calibration_error: Callable[[str, int], float] | None = None,
                 tlt_seed: int = 0) -> dict[str, SpeculationPolicy]:
    """Fresh policy objects for the simulated machine; `aware` calibrated on the simulated forwards."""
    out: dict[str, SpeculationPolicy] = {"off": Off()}
    out |= {f"static_{c.name}": Static(c) for c in statics}
    out["fastgrpo"] = FastGRPOFormula()
    out["tlt"] = TLT(seed=tlt_seed)
    out["aware"] = Aware(simulated_cost_model(costs, calibration_error))
    out["aware_per_sequence"] = AwarePerSequence(simulated_cost_model(costs, calibration_error))
    return out


class Recorder:
    """A policy as the engine sees it, recording every decision and what followed (the engine's
    own trace has no accepted lengths)."""

    def __init__(self, policy: SpeculationPolicy):
        self.policy = policy
        self.name = policy.name
        self.tag: Any = None
        self.log: list[tuple[Any, SpecConfig | None, int, int, float, list[int] | None]] = []

    def choose(self, running: int, context: float | None = None) -> SpecConfig | None:
        return self.policy.choose(running, context)

    def __getattr__(self, name: str) -> Any:  # select(), for a per-sequence budget
        return getattr(self.policy, name)

    def observe(self, config: SpecConfig | None, running: int, emitted: int, seconds: float,
                accepted: list[int] | None = None) -> None:
        self.policy.observe(config, running, emitted, seconds, accepted)
        self.log.append((self.tag, config, running, emitted, seconds, None if accepted is None else list(accepted)))


# ---------------------------------------------------------------------------------------------
# This machine: the engine's costs, measured
# ---------------------------------------------------------------------------------------------
def _lstsq(rows: list[list[float]], y: list[float]) -> tuple[float, ...]:
    coef, *_ = np.linalg.lstsq(np.asarray(rows, dtype=float), np.asarray(y, dtype=float), rcond=None)
    return tuple(float(c) for c in coef)


def _engine_run(engine, policy, requests, sampling, seed: int) -> dict:
    """One timed generate() call of `policy`, as `bench rollout` times it."""
    engine.set_speculation(policy)
    return timed_generate(engine, requests, sampling, seed)


PROFILE_CONFIGS = (None, "plain", SpecConfig(3, 1, 4), SpecConfig(2, 2, 4), SpecConfig(4, 4, 12), SpecConfig(5, 8, 24),
                   SpecConfig(6, 8, 32))  # plain, then trees out to the deepest, widest corner of aware's grid
PROFILE_LEVELS = (1, 2, 4, 8, 16, 32, 64)  # rows running; the grid a plain step's extra is read from
SHAPES_PER_LEVEL = 4  # shapes the validation's policies ran, profiled per level beyond PROFILE_CONFIGS
# (unique prompts, copies of each) of the measured prefills: copies 1 make the table by tokens
PREFILL_CASES = ((1, 1), (2, 1), (4, 1), (8, 1), (16, 1), (32, 1), (64, 1), (2, 8), (4, 8), (8, 8), (16, 2))


class CpuProfiler:
    """This machine's costs: the engine's calibration sweep (`cost_model.calibrate`) and what the
    engine spends beyond it, measured on the engine with workloads that are NOT the validation's
    (other prompts, shorter answers, fixed tree shapes, on a grid of 1-64 running rows): the
    per-step residual of plain steps (by running rows) and speculative steps (fitted: an intercept per
    level of running rows, slopes by tokens verified, depth and each level's top-k x top-k candidates)
    over the sweep's forwards, prefill (by unique prompt tokens, and per copy joined), and the engine's
    time between steps.

    It measures in passes: a whole pass (the engine's calibration sweep, the prefills, the engine
    runs at every level of rows) before the validation, then level passes (the engine runs at some
    levels and the prefills of as many prompts, no sweep) which the validation interleaves with its
    own runs at those rows. This machine's speed drifts within minutes (the sweep's one-token
    forward 9.9-17.9 ms across the seven passes of one run, 2026-11-26), so a profile measured
    minutes away from the runs it prices priced that drift as an error (the engine's own
    one-sequence runs priced 11-23% high for four of five policies in that run); a level pass sees
    the machine at the speed the validation's runs do. The sweep is the
    engine's own calibration (`aware` on the engine prices with it: the fastest of its rounds per
    size); a step's residual over the sweep absorbs the drift since. The engine runs keep the median
    pass, as the validation's medians do (the fastest pass made every priced step 2-11% cheaper than
    the validation's medians). Per run the step residual is the median step's (robust to one slow
    step). `curve`: use this sweep instead of measuring one (tests).

    Beyond its five trees it profiles, from the next pass on, the shapes the policies ran on the
    workloads so far (`add_shapes`: the most used per level of rows), and prices a shape it measured
    as measured: through the fit alone, the learning policies' steps at one running sequence were
    priced 16% (`aware`) and 12% (`tlt`) low in one run (BENCHMARKS.md section 8)."""

    def __init__(self, engine, prompts: list[list[int]], temperature: float, top_p: float,
                 log: Callable[[str], None], tokens: int = 24, curve: CostModel | None = None):
        from fastgrpo.types import Request, SamplingParams

        self.engine, self.log, self.tokens, self.fixed_curve = engine, log, tokens, curve
        self.seconds = 0.0
        t0 = time.perf_counter()
        self.pool = prompts[len(prompts) // 2:]  # the validation uses the first prompts
        self.greedy1 = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=1)
        self.sampling = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=tokens, ignore_eos=True)
        cap = engine.max_batch  # one prefill per call: the table is per prefill
        self.prefill_cases = sorted({(min(unique, cap), max(min(copies, cap // min(unique, cap)), 1))
                                     for unique, copies in PREFILL_CASES})
        self.levels = sorted({min(B, cap) for B in PROFILE_LEVELS})
        self.passes = 0
        self.sweeps: list[tuple[int, CostModel]] = []  # (pass, its sweep) of each whole pass (unless `curve`)
        # each run with the pass that measured it
        self.prefill_runs: dict[tuple[int, int], list[tuple[int, dict]]] = {}
        self.step_runs: dict[tuple[int, Any], list[tuple[int, dict, Recorder]]] = {}
        self.shapes: dict[int, list[SpecConfig]] = {B: [] for B in self.levels}  # profiled beyond PROFILE_CONFIGS
        _engine_run(engine, Off(), [Request(self.pool[0])], self.greedy1, 0)  # warm-up
        self.seconds += time.perf_counter() - t0

    @property
    def first_sweep(self) -> CostModel:
        """The engine's calibration as `aware` on the engine gets it: the first pass's sweep."""
        return self.fixed_curve or self.sweeps[0][1]

    def nearest_level(self, running: int) -> int:
        """The profiled level of rows nearest `running` (in ratio)."""
        return min(self.levels, key=lambda B: abs(math.log2(B / running)))

    def add_shapes(self, steps: Sequence[tuple[int, SpecConfig | None]]) -> None:
        """Profile from the next pass on the shapes of these (running rows, shape) steps, each at the
        level of rows nearest its running rows (in ratio), the most used first, SHAPES_PER_LEVEL a level."""
        used: dict[int, Counter] = {}
        for running, c in steps:
            if c is not None and c not in PROFILE_CONFIGS:
                used.setdefault(self.nearest_level(running), Counter())[c] += 1
        for level, counts in used.items():
            for c, _ in counts.most_common():
                if len(self.shapes[level]) < SHAPES_PER_LEVEL and c not in self.shapes[level]:
                    self.shapes[level].append(c)

    def measure_pass(self, levels: Collection[int] | None = None) -> int:
        """A whole pass, or only the engine runs at `levels` of rows and the prefills of as many
        unique prompts (no sweep): a piece to interleave with the validation's runs at those rows.
        Returns the pass's index."""
        from fastgrpo.types import Request

        t0, r, engine, pool = time.perf_counter(), self.passes, self.engine, self.pool
        if levels is None and self.fixed_curve is None:
            self.sweeps.append((r, calibrate(engine.model, engine.draft)))  # as the engine calibrates
        levels = self.levels if levels is None else sorted(levels)
        for unique, copies in self.prefill_cases:
            if unique in levels:
                reqs = [Request(pool[u % len(pool)]) for u in range(unique) for _ in range(copies)]
                run = _engine_run(engine, Off(), reqs, self.greedy1, r)
                self.prefill_runs.setdefault((unique, copies), []).append((r, run))
        for B in levels:
            reqs = [Request(pool[(3 * i) % len(pool)], max_new_tokens=self.tokens) for i in range(B)]
            for c in (*PROFILE_CONFIGS, *self.shapes[B]):
                # "plain": plain steps under a speculating policy (TLT with threshold 0 never speculates)
                rec = Recorder(Off() if c is None else TLT(threshold=0) if c == "plain" else Static(c))
                run = _engine_run(engine, rec, reqs, self.sampling, 500 + r)
                self.step_runs.setdefault((B, c), []).append((r, run, rec))
        self.passes += 1
        self.seconds += time.perf_counter() - t0
        return r

    def costs(self, passes: Collection[int] | None = None) -> tuple[CpuCosts, dict]:
        """The profile from every pass so far, or from `passes` alone (a shape none of them measured:
        from every pass that did). The context rates, a small difference of two timings, come from
        every pass's sweep either way."""
        curve, pool, levels, tokens = self.fixed_curve, self.pool, self.levels, self.tokens

        def chosen(runs: list[tuple]) -> list[tuple]:
            """The (pass, ...) entries of the chosen passes, or all of them if none is of those."""
            return [run for run in runs if passes is None or run[0] in passes] or runs

        prefill_runs = {k: [run for _, run in chosen(v)] for k, v in self.prefill_runs.items()}
        step_runs = {k: [(run, rec) for _, run, rec in chosen(v)] for k, v in self.step_runs.items()}
        if curve is None:
            sweeps = [sweep for _, sweep in chosen(self.sweeps)]
            every = [sweep for _, sweep in self.sweeps]
            curve = CostModel({t: min(s.target_s[t] for s in sweeps) for t in SWEEP},
                              {t: min(s.draft_s[t] for s in sweeps) for t in SWEEP},
                              context_s={k: statistics.median(s.context_s[k] for s in every)
                                         for k in every[0].context_s})
        context = curve.context_s
        forwards = CpuCosts(curve)  # the sweep's forwards alone: what the residuals are over

        prefill_table, copy_rows, copy_y, call_rows, call_y = {}, [], [], [], []
        for (unique, copies), runs in sorted(prefill_runs.items(), key=lambda kv: kv[0][1]):  # copies 1 first
            width = max(len(pool[u % len(pool)]) for u in range(unique))
            seconds = statistics.median(run["prefill_s"] for run in runs)
            if copies == 1:
                prefill_table[unique * width] = seconds
            else:  # what the copies add beyond the unique prompts' prefill
                copy_rows.append([unique * (copies - 1)])
                copy_y.append(seconds - CpuCosts._grid(prefill_table, unique * width))
            call_rows.append([1.0, 0.0, 0.0])
            call_y.append(statistics.median(run["seconds"] - run["prefill_s"] for run in runs))
        copy_s = max(_lstsq(copy_rows, copy_y)[0], 0.0) if copy_rows else 0.0
        off_extra, plain_extra, spec_rows, spec_y, spec_cases, spec_residual = {}, {}, [], [], [], {}
        for (B, c), runs in step_runs.items():
            plens = [len(pool[(3 * i) % len(pool)]) for i in range(B)]
            per_pass, other = [], []
            for run, rec in runs:
                steps = replay_steps([(cfg, running, acc) for _, cfg, running, _, _, acc in rec.log], plens, [tokens] * B)
                residuals = []
                for (running, width, ctx), (_, cfg, _, _, seconds, acc) in zip(steps, rec.log):
                    if cfg is None or acc is None:
                        residuals.append(seconds - forwards.target(running, 1, ctx, 0))
                    else:
                        residuals.append(seconds - forwards.spec_forwards(cfg, running, width, ctx))
                per_pass.append(statistics.median(residuals[2:] or residuals))
                other.append(run["seconds"] - run["prefill_s"] - sum(s[3] for s in run["trace"]))
            residual = statistics.median(per_pass)
            if c is None:
                off_extra[B] = residual
            elif c == "plain":
                plain_extra[B] = residual
            else:
                # an intercept per level of rows (a step's fixed work is not linear in them), shared slopes
                spec_rows.append([*(float(B == b) for b in levels), B * c.num_verify, c.depth, B * c.depth * c.topk**2])
                spec_y.append(residual)
                spec_cases.append((B, c))
                spec_residual[f"B{B} {c.name}"] = residual
            rec = runs[0][1]
            call_rows.append([1.0, len(rec.log), sum(running for _, _, running, _, _, _ in rec.log)])
            call_y.append(statistics.median(other))
        spec_fit = _lstsq(spec_rows, spec_y)
        spec_extra, spec_slopes = dict(zip(levels, spec_fit[:len(levels)])), spec_fit[len(levels):]
        spec_measured: dict[SpecConfig, dict[int, float]] = {}
        for (B, c), x, y in zip(spec_cases, spec_rows, spec_y):
            spec_measured.setdefault(c, {})[B] = y - float(np.dot(x, spec_fit))
        other_fit = _lstsq(call_rows, call_y)
        costs = CpuCosts(curve, off_extra, spec_extra, spec_slopes, spec_measured, prefill_table, copy_s, other_fit,
                         plain_extra)
        info = {"seconds": self.seconds, "levels": levels,
                "passes": sorted(passes) if passes is not None else list(range(self.passes)),
                "runs_by_level": {B: len(step_runs[(B, None)]) for B in levels},
                "configs": ["off" if c is None else c if isinstance(c, str) else c.name for c in PROFILE_CONFIGS],
                "shapes_profiled": {B: [c.name for c in shapes] for B, shapes in self.shapes.items()},
                "tokens": tokens, "sweep_rounds_target_1_s": [s.target_s[1] for _, s in self.sweeps],
                "spec_residual_s": spec_residual,
                "fit_rms_s": {"spec": _rms(spec_rows, spec_y, spec_fit), "other": _rms(call_rows, call_y, other_fit),
                              "copies": _rms(copy_rows, copy_y, (copy_s,)) if copy_rows else 0.0}}

        if passes is not None:  # a window's profile is not logged, the profile of every pass is
            return costs, info

        def ms(table: dict[int, float]) -> str:
            return ", ".join(f"{k}: {1e3 * v:.2f}" for k, v in sorted(table.items()))

        self.log(
            f"cpu costs measured in {info['seconds']:.0f}s ({self.passes} passes, runs by level "
            f"{info['runs_by_level']}): target forward 1 / 64 / 512 "
            f"tokens {1e3 * curve.target(1):.1f} / {1e3 * curve.target(64):.1f} / {1e3 * curve.target(512):.1f} ms "
            f"(sweep rounds at 1 token: {', '.join(f'{1e3 * x:.1f}' for x in info['sweep_rounds_target_1_s'])} ms); "
            f"a row beyond its tokens {1e3 * curve.target_row_s:.3f} ms; "
            f"context: {', '.join(f'{k} {1e9 * v:.1f}' for k, v in context.items())} ns per cached token; "
            f"plain step beyond its forward by rows (ms): {ms(off_extra)}; while speculating: {ms(plain_extra)}; "
            f"speculative step beyond its forwards by rows (ms): {ms(spec_extra)}, slopes {spec_slopes}; prefill by tokens (ms): {ms(prefill_table)}, "
            f"{1e3 * copy_s:.2f} ms per copy; other {other_fit}")
        return costs, info


def _rms(rows: list[list[float]], y: list[float], coef: tuple[float, ...]) -> float:
    pred = np.asarray(rows) @ np.asarray(coef)
    return float(np.sqrt(np.mean((pred - np.asarray(y)) ** 2)))


# ---------------------------------------------------------------------------------------------
# Validation: the real engine and the simulator on the same workloads
# ---------------------------------------------------------------------------------------------
# every policy the GRPO batch compares but the static sweep: `aware_per_sequence` learns here what
# `aware` does (run on the GRPO batch alone, it met it untaught, where `aware` had learned on the sweep:
# 3.5 speculative steps of 84.5 against `aware`'s 19 of 60.5, bench/simulate-quick-2026-11-26-run5.json in git history)
SWEEP_MODES = ("off", "static", "fastgrpo", "tlt", "aware", "aware_per_sequence")
VALIDATION_REPLAYS = 5  # the simulated protocol's replays (simulated runs are cheap; the engine's are not)
REPETITIONS = 3  # the validation's default repetitions R (`bench simulate --repetitions`)
LEVEL_PASSES = 8  # level passes amid a fixed-concurrency workload's timed runs at R = 3 (and one before them)


def _grpo_modes() -> list[str]:
    return ["off", *[f"static_{c.name}" for c in STATIC_SWEEP], "fastgrpo", "tlt", "aware", "aware_per_sequence"]


def validate(engine, engine_policies: dict[str, SpeculationPolicy], profiler: CpuProfiler, prompts: list[list[int]],
             temperature: float, top_p: float, levels: Sequence[int], tokens: int, n_prompts: int, group: int,
             max_new: int, max_context: int, reps: int, log: Callable[[str], None], seed: int = 0,
             static_cfg: SpecConfig = STATIC_DEFAULT, replays: int = 1) -> dict:
    """Every case twice: on the engine (medians of interleaved repetitions after a warm-up, the
    protocol of `bench rollout`) and in the simulator (the same protocol with fresh simulated
    policies; the acceptance of each workload is the engine's, measured in these same runs). A case
    of B sequences repeats max(2 reps, 16 reps / B) times: a run of few sequences lasts a few dozen
    steps, and how many it takes is itself a draw (what the draft gets accepted), so its median
    needs more runs to settle than a batch's does. The GRPO batch repeats 2 reps times: the learning
    policies (`tlt`'s bandit above all) settle on different shapes from one run to the next. Level
    passes of the cpu profile come amid each workload's repetitions (at its level of rows; every
    level up to its rows after each of the GRPO batch's), each profiling the shapes the policies ran
    so far, and a workload is simulated and its engine runs priced with the profile of those passes:
    this machine's speed drifts within minutes, and with whole passes between the workloads (the
    profile of a workload from the passes either side of it, 2026-11-26) the engine's own
    one-sequence runs were priced 11-13% high for three of five policies in one run. The simulated protocol
    is replayed `replays` times with fresh policies (TLT's bandit seeded per replay), its median
    taken over all their runs: the simulator's own draws (acceptance, the learning policies' path)
    then add little to the engine's (one replay's simulated `tlt` runs on the GRPO batch spread 27%
    min to max, 2026-11-25)."""
    from fastgrpo.types import Request, SamplingParams

    recs = {m: Recorder(p) for m, p in engine_policies.items()}
    measured: dict[str, list[float]] = {}
    runs: dict[str, list[tuple]] = {}  # each engine run with its steps, to price once the profile is done
    workload_of: dict[str, str] = {}

    def ran(workload: str) -> list[tuple[int, SpecConfig | None]]:
        """(running rows, shape) of every step the policies took on this workload."""
        return [(running, c) for rec in recs.values() for tag, c, running, *_ in rec.log if tag[0] == workload]

    def run_engine(case: str, mode: str, reqs, sampling, seed: int, rep: int) -> dict:
        start = len(recs[mode].log)
        r = _engine_run(engine, recs[mode], reqs, sampling, seed)
        if rep:
            workload_of[case] = recs[mode].tag[0]
            measured.setdefault(case, []).append(r["seconds"])
            runs.setdefault(case, []).append((r, recs[mode].log[start:], [q.prompt_ids for q in reqs], mode != "off"))
        return r

    def level_pass(workload: str, levels: Collection[int]) -> None:
        """A piece of the profile amid a workload's runs, with the shapes its policies ran so far."""
        profiler.add_shapes(ran(workload))
        window.setdefault(workload, set()).add(profiler.measure_pass(levels))

    # the fixed-concurrency sweep (EOS ignored)
    sampling = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=tokens, ignore_eos=True)
    sweep_prompts: dict[int, list[int]] = {}
    window: dict[str, set[int]] = {}  # the profile passes amid each workload's engine runs
    for B in levels:
        reqs = [Request(prompts[i % len(prompts)], max_new_tokens=tokens) for i in range(B)]
        sweep_prompts[B] = [len(r.prompt_ids) for r in reqs]
        # passes as often at any R: more runs to price, priced by more passes (the profile's own noise
        # shrinks with the engine's)
        every = max(1, round(level_reps(REPETITIONS, B) / LEVEL_PASSES))
        for rep in range(level_reps(reps, B) + 1):
            for mode in rotated(list(SWEEP_MODES), rep):
                recs[mode].tag = (f"sweep_B{B}", B, rep)
                run_engine(f"sweep_B{B}_{mode}", mode, reqs, sampling, 1000 * rep + B, rep)
            if rep % every == 0:  # the first after the warm-up: passes either side of the timed runs
                level_pass(f"sweep_B{B}", [profiler.nearest_level(B)])
        log(f"engine, {B} running: " + ", ".join(f"{m} {statistics.median(measured[f'sweep_B{B}_{m}']):.2f}s"
                                                 for m in SWEEP_MODES))
    # the GRPO batch (the policy's own lengths): its rows retire from all running to one, so its
    # passes are of every level up to its rows
    reqs = [Request(p) for p in prompts[:n_prompts] for _ in range(group)]
    grpo_levels = [B for B in profiler.levels if B <= profiler.nearest_level(len(reqs))]
    sampling = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_new)
    grpo_lengths: dict[int, list[int]] = {}
    grpo_reps = 2 * reps
    for rep in range(grpo_reps + 1):
        for mode in rotated(_grpo_modes(), rep):
            recs[mode].tag = ("grpo", 0, rep)
            r = run_engine(f"grpo_{mode}", mode, reqs, sampling, 77 + rep, rep)
            grpo_lengths.setdefault(rep, r["lengths"])
        level_pass("grpo", grpo_levels)  # after each: with three, its plain steps were priced 20% high
    costs, cost_info = profiler.costs()
    local = {w: profiler.costs(passes)[0] for w, passes in window.items()}
    log("a plain step at its level beyond the sweep's forward, by workload from the passes amid its runs (ms): "
        + ", ".join(f"{w} {1e3 * local[w].off_extra[profiler.nearest_level(B)]:.2f}" for w, B in
                    [*((f"sweep_B{B}", B) for B in levels), ("grpo", 1)]))
    log("engine, GRPO batch: " + ", ".join(f"{m} {statistics.median(measured[f'grpo_{m}']):.2f}s" for m in _grpo_modes()))

    accepted = whole_tree_acceptance(recs.values(), [f"sweep_B{B}" for B in levels] + ["grpo"])
    profiles = {w: fit_acceptance(a, f"our draft on the bench policy, measured ({w} workload)")
                for w, a in accepted.items()}
    # the same protocol, simulated, replayed `replays` times with fresh policies: the prediction is
    # the median over all replays' runs, not one more draw as noisy as the engine's own median
    rng, t_sim = np.random.default_rng(seed), time.perf_counter()
    predicted: dict[str, list[float]] = {}
    sim_steps: dict[str, list[tuple[int, int]]] = {}  # (decode steps, speculative steps) per simulated run
    plens = [len(p) for p in prompts[:n_prompts]]
    for replay in range(replays):
        policies = sim_policies(costs, STATIC_SWEEP, tlt_seed=replay)
        policies["static"] = Static(static_cfg)
        for B in levels:
            wl = Workload(f"sweep{B}", [SimRequest(i, sweep_prompts[B][i], tokens) for i in range(B)], tokens,
                          max_context)
            for rep in range(level_reps(reps, B) + 1):
                for mode in SWEEP_MODES:
                    run = simulate(wl, local[f"sweep_B{B}"], profiles[f"sweep_B{B}"], policies[mode],
                                   engine.max_batch, rng, policy_clock=True)
                    if rep:
                        predicted.setdefault(f"sweep_B{B}_{mode}", []).append(run.seconds)
                        sim_steps.setdefault(f"sweep_B{B}_{mode}", []).append((run.decode_steps, run.spec_steps))
        for rep in range(grpo_reps + 1):
            lengths = grpo_lengths[rep]
            wl = grpo_workload("grpo", plens, [lengths[p * group:(p + 1) * group] for p in range(n_prompts)],
                               max_new, max_context)
            for mode in _grpo_modes():
                run = simulate(wl, local["grpo"], profiles["grpo"], policies[mode], engine.max_batch, rng,
                               policy_clock=True)
                if rep:
                    predicted.setdefault(f"grpo_{mode}", []).append(run.seconds)
                    sim_steps.setdefault(f"grpo_{mode}", []).append((run.decode_steps, run.spec_steps))
    log(f"the validation simulated {replays} times in {time.perf_counter() - t_sim:.0f}s")
    meas = {k: statistics.median(v) for k, v in measured.items()}
    pred = {k: statistics.median(v) for k, v in predicted.items()}
    error = {k: pred[k] / meas[k] - 1 for k in meas}
    log("validation errors: " + ", ".join(f"{k} {100 * e:+.0f}%" for k, e in error.items()))
    # the error split by where it arises: the profile pricing the engine's own steps and its time
    # around them, apart from the simulated trajectory (decisions, acceptance draws)
    parts = {k: [price_engine_run(local[workload_of[k]], *run) for run in case_runs]
             for k, case_runs in runs.items()}
    breakdown = {k: {part: statistics.median(run[part] for run in case_parts) for part in case_parts[0]}
                 for k, case_parts in parts.items()}
    for k, b in breakdown.items():
        b["trajectory_error"] = pred[k] / b["priced_s"] - 1 if b["priced_s"] > 0 else None
        b["simulated_steps"] = statistics.median(n for n, _ in sim_steps[k])
        b["simulated_spec_steps"] = statistics.median(n for _, n in sim_steps[k])
    log("the profile pricing the engine's own runs: " + ", ".join(
        f"{k} steps {100 * b['steps_error']:+.0f}% total {100 * b['priced_error']:+.0f}%" for k, b in breakdown.items()))
    bench_lengths = [lengths for rep, lengths in sorted(grpo_lengths.items())]
    return {"cpu_predicted_s": pred, "cpu_measured_s": meas, "error": error,
            "cpu_measured_min_s": {k: min(v) for k, v in measured.items()},
            "cpu_measured_runs_s": measured,
            "cpu_measured_median_se": {k: median_se(v, np.random.default_rng(seed)) for k, v in measured.items()},
            "cpu_measured_spread_s": {k: [min(v), max(v)] for k, v in measured.items()},
            "cpu_predicted_spread_s": {k: [min(v), max(v)] for k, v in predicted.items()},
            "runs": {k: {"engine": len(measured[k]), "simulated": len(predicted[k])} for k in measured},
            "profile_passes": {w: sorted(passes) for w, passes in window.items()},
            "off_extra_s": {w: c.off_extra for w, c in local.items()},
            "max_abs_error": max(abs(e) for e in error.values()), "breakdown": breakdown,
            "acceptance": {w: p.to_json() for w, p in profiles.items()},
            "grpo_lengths": bench_lengths, "grpo_prompt_lens": plens, "group": group,
            "engine_accept_len": {m: _mean_emitted(recs[m].log) for m in recs}, "_profiles": profiles,
            "_costs": (costs, cost_info)}


def whole_tree_acceptance(recorders: Iterable[Recorder], workloads: Sequence[str]) -> dict[str, dict[SpecConfig, list[int]]]:
    """Accepted lengths per workload (its prompts) and tree shape, pooled over the policies that
    verify whole trees: the profile is what a whole tree of a shape accepts. A per-sequence budget's
    steps verify part of their tree (its log names the whole shape), so pooled they would pull the
    shape's draws down for every policy, and the simulated budget would then cut an already cut tree."""
    accepted: dict[str, dict[SpecConfig, list[int]]] = {w: {} for w in workloads}
    for rec in recorders:
        if hasattr(rec, "select"):  # a per-sequence budget, as `simulate` tells it
            continue
        for tag, config, _, _, _, acc in rec.log:
            if config is not None and acc is not None:
                accepted[tag[0]].setdefault(config, []).extend(acc)
    return accepted


def price_engine_run(costs: CpuCosts, run: dict, log: list, prompts: Sequence[Sequence[int]],
                     speculating: bool) -> dict[str, float]:
    """A real engine run (all requests joined in its first prefill) priced by the profile step by
    step, at the shapes it actually ran, beside what it measured: which part of a validation error is
    the profile's (steps, prefill, time around the steps) and which the simulated trajectory's."""
    steps = replay_steps([(cfg, running, acc) for _, cfg, running, _, _, acc in log], [len(p) for p in prompts],
                         run["lengths"])
    priced_steps = sum(costs.decode_step(running, ctx, 0, speculating)
                       if cfg is None or acc is None else costs.spec_step(cfg, running, width, ctx, 0)
                       for (running, width, ctx), (_, cfg, _, _, _, acc) in zip(steps, log))
    measured_steps = sum(seconds for *_, seconds, _ in log)
    spec_steps = sum(cfg is not None and acc is not None for _, cfg, _, _, _, acc in log)
    unique = {tuple(p) for p in prompts}
    priced_prefill = costs.prefill(len(unique), max(map(len, unique)), len(prompts))
    priced_around = sum(costs.between_steps(running) for running, _, _ in steps) + costs.per_call(len(prompts))
    priced = priced_steps + priced_prefill + priced_around
    return {"measured_s": run["seconds"], "priced_s": priced,
            "steps_s": measured_steps, "steps_error": priced_steps / measured_steps - 1,
            "prefill_s": run["prefill_s"], "prefill_priced_s": priced_prefill,
            "around_s": run["seconds"] - run["prefill_s"] - measured_steps, "around_priced_s": priced_around,
            "priced_error": priced / run["seconds"] - 1, "steps": len(log), "spec_steps": spec_steps}


def median_se(values: Sequence[float], rng: np.random.Generator, resamples: int = 2000) -> float:
    """The relative standard error of the median of `values`, bootstrapped: how far a median of this
    many runs moves on this machine, from one set of runs to the next. A validation error well
    inside it is this machine's noise, not the simulator's."""
    x = np.asarray(values, dtype=float)
    medians = np.median(rng.choice(x, size=(resamples, len(x)), replace=True), axis=1)
    return float(np.std(medians) / np.median(x))


def level_reps(reps: int, B: int) -> int:
    """Twice `bench rollout`'s repetitions at least: of three runs on this machine one can be far
    off the others (64 sequences under `off`: 3.41, 4.42 and 6.04 s, 2026-11-26)."""
    return max(2 * reps, math.ceil(16 * reps / B))


def _mean_emitted(log: list) -> float | None:
    acc = [a for _, config, _, _, _, accepted in log if config is not None and accepted for a in accepted]
    return 1 + float(np.mean(acc)) if acc else None


# ---------------------------------------------------------------------------------------------
# GPU scale (SIMULATED)
# ---------------------------------------------------------------------------------------------
GPU_STATICS = (*STATIC_SWEEP, SpecConfig(6, 8, 32), SpecConfig(6, 8, 64))
RHO_SWEEP = (0.0, 0.25, 0.75, 1.0)  # the draft confidence's informativeness, around the assumed 0.5
GPU_MAX_BATCH = 128  # rows an engine keeps running: bounded by KV memory at these lengths (our assumption)
LEARNING = ("tlt", "aware", "aware_per_sequence")  # policies that learn: a warm-up rollout first, as in training
BUCKETS = ((1, 4), (5, 16), (17, 32), (33, 64), (65, 128), (129, 10**9))


def bucket_name(lo: int, hi: int) -> str:
    return f"{lo}-{hi}" if hi < 10**9 else f">{lo - 1}"


def time_by_bucket(run: SimRun) -> dict[str, float]:
    """Seconds of the rollout in prefill and in decode steps by running sequences."""
    out = {"prefill": run.prefill_s} | {bucket_name(lo, hi): 0.0 for lo, hi in BUCKETS}
    for _, running, _, _, seconds in run.trace:
        lo, hi = next(b for b in BUCKETS if b[0] <= running <= b[1])
        out[bucket_name(lo, hi)] += seconds
    return out


def run_policies(workload: Workload, costs: Costs, acceptance: AcceptanceProfile, statics: Sequence[SpecConfig],
                 max_batch: int, reps: int, seed: int, confidence: DraftConfidence = DraftConfidence(),
                 modes: Sequence[str] | None = None) -> dict[str, dict]:
    """Every policy (or `modes`) on one workload: median simulated seconds of `reps` rollouts (learning
    policies after a warm-up rollout), with the median run kept for its trace."""
    policies = sim_policies(costs, statics, tlt_seed=seed)
    rng = np.random.default_rng(seed)
    out = {}
    for mode, policy in policies.items():
        if modes is not None and mode not in modes:
            continue
        runs = []
        for rep in range(reps + (mode in LEARNING)):
            run = simulate(workload, costs, acceptance, policy, max_batch, rng, confidence=confidence)
            if rep or mode not in LEARNING:
                runs.append(run)
        runs.sort(key=lambda r: r.seconds)
        out[mode] = {"seconds": runs[len(runs) // 2].seconds, "run": runs[len(runs) // 2]}
    return out


def gpu_results(acceptance: AcceptanceProfile, workloads: list[Workload], reps: int, seed: int,
                log: Callable[[str], None]) -> tuple[list[dict], dict]:
    rows, detail = [], {}
    for hw_key, hw in ACCELERATORS.items():
        for model_key, model in MODELS.items():
            costs = Roofline(hw, model)
            for wl in workloads:
                t = time.perf_counter()
                res = run_policies(wl, costs, acceptance, GPU_STATICS, GPU_MAX_BATCH, reps, seed)
                statics = {m: r["seconds"] for m, r in res.items() if m.startswith("static_")}
                best = min(statics, key=statics.get)
                row = {"hardware": hw.name, "model": model.name, "workload": wl.name, "acceptance": acceptance.source,
                       "off_s": res["off"]["seconds"], "static_best_s": statics[best], "static_best": best[7:],
                       "fastgrpo_s": res["fastgrpo"]["seconds"], "tlt_s": res["tlt"]["seconds"],
                       "aware_s": res["aware"]["seconds"], "aware_per_sequence_s": res["aware_per_sequence"]["seconds"],
                       "statics_s": {m[7:]: s for m, s in statics.items()},
                       "requests": len(wl.requests), "max_batch": GPU_MAX_BATCH,
                       "tokens": sum(min(r.length, wl.max_new) for r in wl.requests),
                       "time_by_bucket": {m: time_by_bucket(res[m]["run"])
                                          for m in ("off", "fastgrpo", "tlt", "aware", "aware_per_sequence")}
                                         | {"static_best": time_by_bucket(res[best]["run"])},
                       "aware_spec_fraction": res["aware"]["run"].spec_steps / max(res["aware"]["run"].decode_steps, 1)}
                rows.append(row)
                detail[(hw_key, model_key, wl.name)] = res
                log(f"SIMULATED {hw.name} {model.name} {wl.name[:40]}: off {row['off_s']:.1f}s, static best "
                    f"{row['static_best_s']:.1f}s ({row['static_best']}), fastgrpo {row['fastgrpo_s']:.1f}s, "
                    f"tlt {row['tlt_s']:.1f}s, aware {row['aware_s']:.1f}s, aware_per_sequence "
                    f"{row['aware_per_sequence_s']:.1f}s ({time.perf_counter() - t:.0f}s)")
    return rows, detail


def gpu_fixed_concurrency(acceptance: AcceptanceProfile, levels: Sequence[int], tokens: int, prompt_len: int,
                          seed: int) -> list[dict]:
    """B sequences kept running for `tokens` each (EOS ignored), every policy, per GPU and model."""
    out = []
    for hw in ACCELERATORS.values():
        for model in MODELS.values():
            costs = Roofline(hw, model)
            for B in levels:
                wl = Workload(f"fixed {B}", [SimRequest(i, prompt_len, tokens) for i in range(B)], tokens,
                              prompt_len + tokens + 1)
                res = run_policies(wl, costs, acceptance, GPU_STATICS, max(B, 1), 1, seed)
                statics = {m: r["seconds"] for m, r in res.items() if m.startswith("static_")}
                out.append({"hardware": hw.name, "model": model.name, "running": B, "off_s": res["off"]["seconds"],
                            "static_best_s": min(statics.values()), "fastgrpo_s": res["fastgrpo"]["seconds"],
                            "tlt_s": res["tlt"]["seconds"], "aware_s": res["aware"]["seconds"],
                            "aware_per_sequence_s": res["aware_per_sequence"]["seconds"]})
    return out


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------
def bench_simulate(cfg, quick: bool, output: Path, extra: list[str] | None = None, reps: int | None = None) -> dict:
    from fastgrpo.backends.embedded import build_engine, speculation_policy
    from fastgrpo.bench.report import command_line, publish
    from fastgrpo.models.policy import load_policy, num_parameters
    from fastgrpo.models.tokenizer import load_tokenizer
    from fastgrpo.tasks.source import encode_problems, load_task

    def log(msg: str) -> None:
        print(msg, flush=True)

    t0 = time.perf_counter()
    policy, tokenizer = load_policy(cfg.model.path), load_tokenizer(cfg.model.path)
    policy.eval()
    # the draft is loaded for a static policy: no cached calibration is read or written here
    engine = build_engine(cfg, policy.config, tokenizer, policy.state_dict().items(), speculation="static")
    _, evals = load_task(cfg.task)
    prompts = [e.prompt_ids for e in encode_problems(evals, tokenizer, cfg.model.max_context, "eval")]
    sc = cfg.speculation
    static_cfg = SpecConfig(sc.depth, sc.topk, sc.num_verify)
    temperature, top_p = cfg.rollout.temperature, cfg.rollout.top_p
    # the cpu profile: the engine's calibration sweep and the engine's costs beyond it, measured in
    # this run: a whole pass first, then level passes amid the validation's runs; the engine's
    # `aware` gets the first pass's sweep (no cached calibration is read or written), the simulated
    # `aware` a simulated sweep of the cpu profile, as on any simulated machine
    profiler = CpuProfiler(engine, prompts, temperature, top_p, log)
    profiler.measure_pass()
    engine_policies: dict[str, SpeculationPolicy] = {m: speculation_policy(engine, cfg, m)
                                                      for m in ("off", "static", "fastgrpo")}
    engine_policies["aware"] = Aware(profiler.first_sweep)
    engine_policies["aware_per_sequence"] = AwarePerSequence(profiler.first_sweep)
    engine_policies |= {f"static_{c.name}": Static(c) for c in STATIC_SWEEP}
    engine_policies["tlt"] = TLT(seed=cfg.seed)

    reps = reps or REPETITIONS
    v = dict(levels=(1, 4, 16, 64), tokens=48 if quick else 128, n_prompts=4 if quick else 8, group=8,
             max_new=128 if quick else cfg.rollout.max_new_tokens)
    val = validate(engine, engine_policies, profiler, prompts, temperature, top_p, v["levels"], v["tokens"],
                   v["n_prompts"], v["group"], v["max_new"], cfg.model.max_context, reps, log, seed=cfg.seed,
                   static_cfg=static_cfg, replays=VALIDATION_REPLAYS)
    profiles = val.pop("_profiles")
    costs, cost_info = val.pop("_costs")

    # GPU scale: an EAGLE-3 acceptance profile (cited) with our draft's measured width gain
    accept = eagle_profile(profiles["grpo"].beta)
    n_prompts, group = (16, 8) if quick else (64, 8)
    lt = dict(mean=3000.0, sigma=1.0, max_new=8192 if quick else 16384, prompt_len=256)
    groups = [val["grpo_lengths"][1][p * val["group"]:(p + 1) * val["group"]] for p in range(v["n_prompts"])]
    workloads = [
        resampled_workload(f"bench task (measured lengths, {n_prompts}x{group})", val["grpo_prompt_lens"], groups,
                           n_prompts, v["max_new"], cfg.model.max_context, cfg.seed),
        longtail_workload(n_prompts, group, lt["mean"], lt["sigma"], lt["max_new"], lt["prompt_len"], cfg.seed),
    ]
    sim_reps = 1 if quick else 3
    results, detail = gpu_results(accept, workloads, sim_reps, cfg.seed, log)
    fixed = gpu_fixed_concurrency(accept, (1, 4, 16, 64, 128), 128 if quick else 512, lt["prompt_len"], cfg.seed)
    key = ("h100", "llama3-8b", workloads[1].name)
    # how much the per-sequence budget owes to the assumed informativeness of the draft's confidence
    sensitivity = []
    for rho in RHO_SWEEP:
        res = run_policies(workloads[1], Roofline(ACCELERATORS["h100"], MODELS["llama3-8b"]), accept, (), GPU_MAX_BATCH,
                           sim_reps, cfg.seed, DraftConfidence(rho), modes=("aware_per_sequence",))
        sensitivity.append({"rho": rho, "aware_per_sequence_s": res["aware_per_sequence"]["seconds"]})
        log(f"SIMULATED {' / '.join(key)}, rho {rho}: aware_per_sequence {sensitivity[-1]['aware_per_sequence_s']:.1f}s")
    running = {m: _downsample([(t, b) for t, b, _, _, _ in detail[key][m]["run"].trace]) for m in ("off", "tlt", "aware")}
    result = {
        "meta": {"date": datetime.date.today().isoformat(), "quick": quick, "cores": torch.get_num_threads(),
                 "torch": torch.__version__, "machine": platform.machine(),
                 "policy_parameters": num_parameters(policy), "temperature": temperature, "repetitions": reps,
                 "policy": cfg.model.path, "sft_steps": cfg.sft.examples // cfg.sft.batch_size,
                 "draft_steps": cfg.draft.pretrain_steps,
                 "validation_workloads": v, "gpu_max_batch": GPU_MAX_BATCH, "gpu_repetitions": sim_reps,
                 "longtail": lt | {"prompts": n_prompts, "group": group}},
        "cpu_costs": costs.to_json() | {"measurement": cost_info},
        "validation": val,
        "gpu_acceptance": accept.to_json(),
        "results": results,
        "fixed_concurrency": fixed,
        "running_over_time": {"case": " / ".join(key), "series": running},
        "per_sequence_rho": {"case": " / ".join(key), "assumed": DraftConfidence().rho, "aware_s": detail[key]["aware"]["seconds"],
                             "sweep": sensitivity},
    }
    result["meta"]["seconds"] = time.perf_counter() - t0
    command = command_line("simulate", quick, output, (extra or []) + ([f"--repetitions {reps}"] if reps != REPETITIONS else []))
    publish(result, output, command, markdown, plot=lambda path: plot_all(result, path))
    output.with_suffix(".md").write_text(markdown(result, command) + "\n")  # the section, for BENCHMARKS.md
    return result


def _downsample(series: list, points: int = 2000) -> list:
    """At most about `points` entries, the last one kept (a plot needs no more)."""
    step = max(1, len(series) // points)
    return series[::step] + ([series[-1]] if series and (len(series) - 1) % step else [])


def plot_all(result: dict, path: Path) -> None:
    """Rollout time per policy (the main PNG), the running batch over time and time by concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = ("off", "static_best", "fastgrpo", "tlt", "aware")
    rows = result["results"]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.16
    for j, m in enumerate(modes):
        ax.bar([i + (j - 2) * width for i in range(len(rows))], [r["off_s"] / r[f"{m}_s"] for r in rows], width, label=m)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{r['hardware']}\n{r['model']}\n{r['workload'][:18]}" for r in rows], fontsize=6)
    ax.axhline(1.0, color="k", lw=0.5)
    ax.set_ylabel("speed-up over off (rollout time of off / policy)")
    ax.set_title("SIMULATED: GRPO-batch rollout time per speculation policy")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for m, series in result["running_over_time"]["series"].items():
        ax.step([t for t, _ in series], [b for _, b in series], where="post", label=m)
    ax.set_xlabel("simulated seconds")
    ax.set_ylabel("running sequences")
    ax.set_title(f"SIMULATED: running batch over time\n{result['running_over_time']['case']}", fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path.with_name(path.stem + "-running.png"), dpi=120)
    plt.close(fig)

    row = next(r for r in rows if r["hardware"] == "H100 SXM" and "8B" in r["model"] and "long-tail" in r["workload"])
    fig, ax = plt.subplots(figsize=(6, 4))
    parts = list(next(iter(row["time_by_bucket"].values())))
    bottom = [0.0] * len(row["time_by_bucket"])
    names = list(row["time_by_bucket"])
    for part in parts:
        vals = [row["time_by_bucket"][m][part] for m in names]
        ax.bar(names, vals, bottom=bottom, label=part if part == "prefill" else f"running {part}")
        bottom = [b + x for b, x in zip(bottom, vals)]
    ax.set_ylabel("simulated seconds")
    ax.set_title(f"SIMULATED: where the rollout's time goes, by running sequences\n{row['hardware']} / {row['model']}, "
                 "long-tail workload", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path.with_name(path.stem + "-buckets.png"), dpi=120)
    plt.close(fig)

    val = result["validation"]
    fig, ax = plt.subplots(figsize=(5, 5))
    keys = list(val["cpu_measured_s"])
    xs, ys = [val["cpu_measured_s"][k] for k in keys], [val["cpu_predicted_s"][k] for k in keys]
    ax.scatter(xs, ys, s=12)
    lim = (min(xs + ys) * 0.8, max(xs + ys) * 1.2)
    ax.plot(lim, lim, "k", lw=0.5)
    ax.fill_between(lim, [x * 0.9 for x in lim], [x * 1.1 for x in lim], alpha=0.15, label="within 10%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured seconds (engine, this CPU)")
    ax.set_ylabel("predicted seconds (simulator, cpu profile)")
    ax.set_title("Validation: simulator against the engine (measured)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path.with_name(path.stem + "-validation.png"), dpi=120)
    plt.close(fig)


def _noise_summary(error: dict[str, float], se: dict[str, float]) -> str:
    """How the misses compare with the measured medians' own noise."""
    ses = sorted(se.values())
    beyond = [k for k, e in error.items() if abs(e) > 0.10 + 2 * se[k]]
    return (f" The measured medians' own standard error (bootstrap over each case's repetitions) is "
            f"{100 * statistics.median(ses):.1f}% (median case) to {100 * ses[-1]:.1f}%; "
            f"{len(beyond)} case(s) miss 10% by more than two of their standard errors"
            + (f" ({', '.join(beyond)})." if beyond else ".")
            + " The profile's own noise (its runs at the same shapes) is not in these standard errors.")


def markdown(result: dict, command: str) -> str:
    m, val = result["meta"], result["validation"]
    v, reps = m["validation_workloads"], m["repetitions"]
    stem = Path(command.split("--output")[-1].strip()).stem if "--output" in command else "simulate"
    runs = next(iter(val.get("runs", {}).values()), None)  # older results: one replay, no counts
    replayed = f", replayed {runs['simulated'] // runs['engine']} times with fresh policies, median over all" if runs else ""
    lines = [f"Command: `{command}`", "",
             f"Date {m['date']}; {m['cores']} CPU threads ({m['machine']}), torch {m['torch']}; policy "
             f"`{m.get('policy', '?')}` ({m['policy_parameters'] / 1e6:.1f}M parameters, {m.get('sft_steps', '?')} SFT "
             f"steps; its draft {m.get('draft_steps', '?')} warm-start steps); temperature {m['temperature']}.", "",
             "### Validation: the simulator against the engine on this CPU (measured and predicted)", "",
             f"The engine (medians of interleaved repetitions after a warm-up) and the simulator "
             f"(same protocol{replayed}, cpu profile: the engine's calibration sweep plus the step, prefill and loop costs "
             f"measured on other workloads, in passes amid each validation workload's repetitions at its rows, "
             f"with the tree shapes the policies ran; acceptance measured on "
             f"the engine in these runs, per workload). Fixed concurrency: {v['tokens']} tokens per sequence, EOS "
             f"ignored (runs of B sequences repeated max({2 * reps}, {16 * reps} / B) times); GRPO batch: {v['n_prompts']} "
             f"prompts x {v['group']}, the policy's own lengths (max {v['max_new']}), {2 * reps} repetitions. Where each error arises: "
             "*profile* is the profile pricing the engine's own runs step by step at the shapes they ran (its "
             "cost model alone), *trajectory* the simulated runs against those priced runs (the policies' "
             "decisions and the acceptance draws).", "",
             "| case | measured s (median) | its standard error | measured s (fastest - slowest) | predicted s | error "
             "| error against the fastest | profile | trajectory |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    se = val.get("cpu_measured_median_se", {})  # older results: none
    mins = val.get("cpu_measured_min_s", val["cpu_measured_s"])
    err_min = {k: val["cpu_predicted_s"][k] / mins[k] - 1 for k in val["cpu_measured_s"]}
    split = val.get("breakdown", {})
    for k in val["cpu_measured_s"]:
        b = split.get(k)
        parts = "- | - |" if b is None else f"{100 * b['priced_error']:+.1f}% | {100 * b['trajectory_error']:+.1f}% |"
        slowest = val.get("cpu_measured_spread_s", {}).get(k, [None, None])[1]
        lines.append(f"| {k} | {val['cpu_measured_s'][k]:.3g} | " + (f"{100 * se[k]:.1f}%" if k in se else "-")
                     + f" | {mins[k]:.3g}"
                     + ("" if slowest is None else f" - {slowest:.3g}") + f" | {val['cpu_predicted_s'][k]:.3g} | "
                     f"{100 * val['error'][k]:+.1f}% | {100 * err_min[k]:+.1f}% | " + parts)
    within = sum(abs(e) <= 0.10 for e in val["error"].values())
    within_min = sum(abs(e) <= 0.10 for e in err_min.values())
    lines += ["", f"{within} of {len(val['error'])} cases within 10% of the median (largest error "
              f"{100 * val['max_abs_error']:.1f}%); {within_min} within 10% of the fastest repetition (largest "
              f"{100 * max(map(abs, err_min.values())):.1f}%)."
              + (f" The profile prices the engine's own runs within {100 * max(abs(b['priced_error']) for b in split.values()):.1f}% in every case."
                 if split else "") + (_noise_summary(val["error"], se) if se else ""),
              "", f"![SIMULATED vs measured]({stem}-validation.png)", "",
              "### SIMULATED: GRPO-batch rollout at GPU scale", "",
              "Every number in this section is SIMULATED (stated cost model, cited acceptance profile: "
              f"{result['gpu_acceptance']['source']}; what width adds from our draft's fit, beta "
              f"{result['gpu_acceptance']['beta']:.2f}). Validation errors of the instrument: above "
              f"(largest {100 * val['max_abs_error']:.1f}%).", "",
              "| hardware | model | workload | off s | best static s | fastgrpo s | tlt s | aware s | aware / off | "
              "aware / fastgrpo | aware / tlt | aware / best static | per-sequence s | per-sequence / aware |",
              "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["results"]:
        a = r["aware_s"]
        ps = r.get("aware_per_sequence_s")
        lines.append(f"| {r['hardware']} | {r['model']} | {r['workload']} | {r['off_s']:.3g} | {r['static_best_s']:.3g} "
                     f"({r['static_best']}) | {r['fastgrpo_s']:.3g} | {r['tlt_s']:.3g} | {a:.3g} | "
                     f"{r['off_s'] / a:.2f}x | {r['fastgrpo_s'] / a:.2f}x | {r['tlt_s'] / a:.2f}x | "
                     f"{r['static_best_s'] / a:.2f}x | " + ("- | - |" if ps is None else f"{ps:.3g} | {a / ps:.2f}x |"))
    if "per_sequence_rho" in result:
        rho = result["per_sequence_rho"]
        lines += ["", f"The per-sequence budget's draft confidences are SIMULATED with informativeness rho = "
                  f"{rho['assumed']} (an assumption: `DraftConfidence`). On {rho['case']}, per-sequence / aware by rho: "
                  + ", ".join(f"{x['rho']}: {rho['aware_s'] / x['aware_per_sequence_s']:.2f}x" for x in rho["sweep"])
                  + "."]
    lines += ["", f"![SIMULATED rollout time per policy]({stem}.png)",
              f"![SIMULATED running batch over time]({stem}-running.png)",
              f"![SIMULATED time by concurrency]({stem}-buckets.png)", "",
              "SIMULATED fixed concurrency (aware / off, and the best of the others / off):", "",
              "| hardware | model | running | aware / off | best static / off | fastgrpo / off | tlt / off | "
              "per-sequence / off |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["fixed_concurrency"]:
        ps = r.get("aware_per_sequence_s")
        lines.append(f"| {r['hardware']} | {r['model']} | {r['running']} | {r['off_s'] / r['aware_s']:.2f}x | "
                     f"{r['off_s'] / r['static_best_s']:.2f}x | {r['off_s'] / r['fastgrpo_s']:.2f}x | "
                     f"{r['off_s'] / r['tlt_s']:.2f}x | " + ("- |" if ps is None else f"{r['off_s'] / ps:.2f}x |"))
    return "\n".join(lines)
