"""bench simulate: this machine: the engine's costs, measured."""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np

from fastgrpo.bench.rollout import timed_generate
from fastgrpo.engines.embedded.calibrate import calibrate
from fastgrpo.speculation.cost_model import SWEEP, CostModel
from fastgrpo.speculation.policy import Off, Static
from fastgrpo.speculation.tlt import TLT
from fastgrpo.speculation.spec import SpecConfig
from fastgrpo.bench.simulate.costs import CpuCosts
from fastgrpo.bench.simulate.simulator import Recorder, replay_steps


def _lstsq(rows: list[list[float]], y: list[float]) -> tuple[float, ...]:
    coef, *_ = np.linalg.lstsq(np.asarray(rows, dtype=float), np.asarray(y, dtype=float), rcond=None)
    return tuple(float(c) for c in coef)


def _engine_run(engine, policy, requests, sampling, seed: int) -> dict:
    """One timed generate() call of `policy`, as `bench rollout` times it."""
    engine.set_speculation(policy)
    return timed_generate(engine, requests, sampling, seed)


# plain, then trees from the shallowest corner of aware's grid (a chain of one) out to the deepest, widest: the
# speculative steps' fit is read only between depths it measured (extrapolated, it can price a shape far off,
# and a simulated `aware` then chooses a shape the engine's would not)
PROFILE_CONFIGS = (None, "plain", SpecConfig(1, 1, 2), SpecConfig(3, 1, 4), SpecConfig(2, 2, 4), SpecConfig(4, 4, 12),
                   SpecConfig(5, 8, 24), SpecConfig(6, 8, 32))
PROFILE_LEVELS = (1, 2, 4, 8, 16, 32, 64)  # rows running; the grid a plain step's extra is read from
SHAPES_PER_LEVEL = 4  # shapes the validation's policies ran, profiled per level beyond PROFILE_CONFIGS
# (unique prompts, copies of each) of the measured prefills: copies 1 make the table by tokens
PREFILL_CASES = ((1, 1), (2, 1), (4, 1), (8, 1), (16, 1), (32, 1), (64, 1), (2, 8), (4, 8), (8, 8), (16, 2))


class CpuProfiler:
    """This machine's costs: the engine's calibration sweep (`engines/embedded/calibrate.calibrate`) and what the
    engine spends beyond it, measured on the engine with workloads that are NOT the validation's
    (other prompts, shorter answers, fixed tree shapes, on a grid of 1-64 running rows): the
    per-step residual of plain steps (by running rows) and speculative steps (fitted: an intercept per
    level of running rows, slopes by tokens verified, depth and each level's top-k x top-k candidates)
    over the sweep's forwards, prefill (by unique prompt tokens, and per copy joined), and the engine's
    time between steps.

    It measures in passes: a whole pass (the engine's calibration sweep, the prefills, the engine
    runs at every level of rows) before the validation, then level passes (the engine runs at some
    levels and the prefills of as many prompts, no sweep) which the validation interleaves with its
    own runs at those rows. This machine's speed drifts within minutes, so a profile measured
    minutes away from the runs it prices counts that drift as an error; a level pass sees
    the machine at the speed the validation's runs do. The sweep is the
    engine's own calibration (`aware` on the engine prices with it: the fastest of its rounds per
    size); a step's residual over the sweep absorbs the drift since. The engine runs keep the median
    pass, as the validation's medians do (the fastest pass made every priced step 2-11% cheaper than
    the validation's medians). Per run the step residual is the median step's (robust to one slow
    step). `curve`: use this sweep instead of measuring one (tests).

    Beyond its six trees it profiles, from the next pass on, the shapes the policies ran on the
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
                    if seconds is None:  # a step that captured a graph: no price in its time
                        continue
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
