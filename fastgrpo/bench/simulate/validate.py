"""bench simulate: validation: the real engine and the simulator on the same workloads."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Collection, Iterable, Sequence

import numpy as np

from fastgrpo.bench.rollout import STATIC_SWEEP, rotated
from fastgrpo.speculation.policy import SpeculationPolicy, Static
from fastgrpo.speculation.spec import SpecConfig
from fastgrpo.bench.simulate.costs import CpuCosts, STATIC_DEFAULT
from fastgrpo.bench.simulate.acceptance import fit_acceptance
from fastgrpo.bench.simulate.workload import SimRequest, Workload, grpo_workload
from fastgrpo.bench.simulate.simulator import Recorder, replay_steps, sim_policies, simulate
from fastgrpo.bench.simulate.profile import CpuProfiler, _engine_run


# every policy the GRPO batch compares but the static sweep: `aware_per_sequence` learns here what
# `aware` does (run on the GRPO batch alone, it would meet it untaught, where `aware` learned on the sweep)
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
    this machine's speed drifts within minutes, and a profile measured minutes away from the runs it
    prices counts that drift as the simulator's error. The simulated protocol
    is replayed `replays` times with fresh policies (TLT's bandit seeded per replay), its median
    taken over all their runs: the simulator's own draws (acceptance, the learning policies' path)
    then add little to the engine's (one replay of a learning policy such as `tlt` spreads widely)."""
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
                          max_context, known_lengths=True)
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
    """Twice `bench rollout`'s repetitions at least: of three runs on a shared machine one can be far
    off the others."""
    return max(2 * reps, math.ceil(16 * reps / B))


def _mean_emitted(log: list) -> float | None:
    acc = [a for _, config, _, _, _, accepted in log if config is not None and accepted for a in accepted]
    return 1 + float(np.mean(acc)) if acc else None
