"""The rollout stage: `bench rollout`'s workloads on the device, every mode at each level of running
sequences and on a GRPO batch, repeated in rotated order, with the A/A pair as the noise floor."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

from fastgrpo.bench.gpu_check.harness import Check, log, spread, sync
from fastgrpo.bench.gpu_check.records import engine_info, generate_call, jsonable, policy_state
from fastgrpo.bench.gpu_check.targets import aware_verdict, grpo_ratio, level_ratio

# the rollout's modes: `static` twice under two names (the A/A pair: the same tree, policy and seeds, so
# their ratio is the run's noise floor), every fixed choice aware must match, and aware's two
SWEEP_MODES = ("off", "static", "static_aa", "fastgrpo", "tlt", "aware", "aware_per_sequence")
AA_PAIR = ("static", "static_aa")
FIXED_MODES = ("off", "static", "fastgrpo", "tlt")  # the GRPO batch adds bench rollout's static trees
AWARE_MODES = ("aware", "aware_per_sequence")
UNSHARED = "off_unshared_prefill"  # plain decoding, every sample prefilling its own copy of its prompt
# a workload's repetitions beyond Size.reps (while aware is within noise of its line) may take this share of the
# stage's time left when it started: at a few rows, where 3 calls decide least, they are the cheapest
EXTRA_SHARE = 0.05


def _shares(r: dict) -> dict[str, float]:
    """bench rollout's time shares (prefill, steps by running sequences) of one call."""
    from fastgrpo.bench.rollout import time_shares

    t = r["trace"]
    return time_shares({"seconds": r.get("wall_s", r["seconds"]), "prefill_s": r["prefill_s"],  # (the trace has the captures)
                        "trace": list(zip(t["running"], t["config"], t["emitted"], [ms / 1000 for ms in t["ms"]]))})


def level_row(B: int, runs: dict[str, list[dict]]) -> dict:
    """One level of the sweep from each mode's timed calls: median tokens/s and its standard error, the
    A/A pair's ratio (the noise floor: two identical policies), the best fixed choice and aware against
    it and against plain decoding."""
    row: dict[str, Any] = {"concurrency": B}
    for mode, rs in runs.items():
        tok = spread([r["tok_s"] for r in rs])
        row |= {f"{mode}_tok_s": tok["median"], f"{mode}_tok_s_se": tok["se"], f"{mode}_runs": tok["n"],
                f"{mode}_accept_len": statistics.median(r["accept_len"] for r in rs),
                f"{mode}_spec_fraction": statistics.median(r["spec_fraction"] for r in rs)}
    modes = list(runs)
    best = max(modes, key=lambda m: row[f"{m}_tok_s"])
    row |= {"best": best, "best_vs_off": row[f"{best}_tok_s"] / row["off_tok_s"]}
    fixed = [m for m in FIXED_MODES if m in runs]
    best_fixed = max(fixed, key=lambda m: row[f"{m}_tok_s"])
    row |= {"best_fixed": best_fixed, "best_fixed_tok_s": row[f"{best_fixed}_tok_s"]}
    if "aware" in runs:
        row |= {"aware_vs_best": row["aware_tok_s"] / row["best_fixed_tok_s"],
                "aware_vs_off": row["aware_tok_s"] / row["off_tok_s"], **aware_host_times(runs["aware"])}
    a, b = AA_PAIR
    if a in runs and b in runs:
        row["aa_ratio"] = row[f"{b}_tok_s"] / row[f"{a}_tok_s"]
    return row


def aware_host_times(rs: list[dict]) -> dict[str, float]:
    """aware's calls: the median seconds of its choices and updates (on every step's path) and their share of
    the call's time (what aware's host work costs it against a fixed policy), of its `ahead` in static steps
    and of the wait on the device after it (a wait left: the device's steps hid `ahead`; none: `ahead` was
    on the steps' path)."""
    return {"aware_policy_s": statistics.median(r.get("policy_s", 0.0) for r in rs),
            "aware_policy_share": statistics.median(r.get("policy_s", 0.0) / max(r["seconds"], 1e-12) for r in rs),
            "aware_ahead_s": statistics.median(r.get("ahead_s", 0.0) for r in rs),
            "aware_wait_s": statistics.median(r.get("wait_s", 0.0) for r in rs)}


def grpo_summary(runs: dict[str, list[dict]], fixed: tuple[str, ...]) -> dict:
    """The GRPO batch from each contender's timed calls: median seconds and standard errors, the best of
    the `fixed` choices, aware against it and against plain decoding (speed ratios: > 1 faster), the A/A
    pair's ratio (static_aa's speed over static's)."""
    from fastgrpo.bench.rollout import padding

    spreads = {m: spread([r["seconds"] for r in rs]) for m, rs in runs.items()}
    med = {m: s["median"] for m, s in spreads.items()}
    statics = {m: med[m] for m in med if m.startswith("static_") and m != AA_PAIR[1]}
    best_static = min(statics or {"static": med["static"]}, key=lambda m: med[m])
    best_fixed = min((m for m in fixed if m in med), key=lambda m: med[m])
    out = {"off_s": med["off"], "static_best_s": med[best_static], "static_best": best_static,
           "all_s": med, "se_s": {m: s["se"] for m, s in spreads.items()}, "runs": {m: s["n"] for m, s in spreads.items()},
           "tokens_median": {m: statistics.median(r["tokens"] for r in rs) for m, rs in runs.items()},
           "best_fixed": best_fixed, "best_fixed_s": med[best_fixed], "padding": {m: padding(rs) for m, rs in runs.items()}}
    out |= {f"{m}_s": med[m] for m in med if m in (*SWEEP_MODES, UNSHARED)}
    if "aware" in med:
        out |= {"aware_vs_best": med[best_fixed] / med["aware"], "aware_vs_off": med["off"] / med["aware"],
                "aware_accept_len": statistics.median(r["accept_len"] for r in runs["aware"]),
                **aware_host_times(runs["aware"])}
    a, b = AA_PAIR
    if a in med and b in med:
        out["aa_ratio"] = med[a] / med[b]
    return out


def rollout(c: Check) -> dict:
    """`bench rollout`'s workloads on the run's device, repeated until they decide: the modes of
    SWEEP_MODES (an A/A pair among them) at each level of running sequences and on a GRPO batch (with
    bench rollout's static trees and unshared prefill), `reps` timed calls each after a warm-up, and up to
    `extra_reps` more while aware is within noise of its line (targets.py), the modes' order rotated every
    repetition. Kept with the results: every call (time, tokens, the
    configurations it ran by concurrency, its per-step trace, graph captures), aware's state after each of
    its calls, and its calibrated cost model (calibrated here first, timed)."""
    from fastgrpo.bench.rollout import STATIC_SWEEP, rotated
    from fastgrpo.engines.embedded.build import build_engine, speculation_policy
    from fastgrpo.speculation.policy import Static
    from fastgrpo.types import Request, SamplingParams

    cfg, size = c.cfg, c.size
    policy, text = c.policy()
    prompts = c.prompts(text)
    # the engine with its draft and aware's cost model, calibrated on this device (timed: it runs once per
    # machine and model shape, then comes from speculation.cost_model_dir)
    t = time.perf_counter()
    engine = build_engine(c.with_batch(max(max(size.levels), size.grpo_prompts * 8)), policy.config, text,
                          policy.state_dict().items(), speculation="aware")
    sync()
    calibration_s = time.perf_counter() - t
    del policy
    policies = {mode: speculation_policy(engine, cfg, "static" if mode == AA_PAIR[1] else mode) for mode in SWEEP_MODES}
    cost_model = jsonable(getattr(policies["aware"], "costs", None))
    log(f"rollout: engine on {engine.device} ({engine.dtype}) built with aware's cost model in {calibration_s:.1f}s; "
         + (f"{c.stage_left():.0f}s left in the budget" if math.isfinite(c.stage_left()) else "no budget"))
    out: dict[str, Any] = {"modes": list(SWEEP_MODES), "fixed_modes": list(FIXED_MODES), "aa_pair": list(AA_PAIR),
                           "levels": [], "levels_skipped_for_time": [], "tokens_per_sequence": size.sweep_tokens,
                           "repetitions": size.reps, "extra_repetitions": size.extra_reps,
                           "calibration_s": calibration_s, "grpo_prompts": size.grpo_prompts,
                           "engine": engine_info(engine), "cost_model": cost_model, "calls": [], "aware_states": []}

    def record(workload: str, mode: str, rep: int, order: list[str], r: dict, policy) -> None:
        out["calls"].append({"workload": workload, "mode": mode, "rep": rep, "position": order.index(mode)}
                            | {k: v for k, v in r.items() if k != "lengths"})
        if mode in AWARE_MODES:
            state = policy_state(policy)
            if state.get("costs") == cost_model:  # the calibration, unchanged: saved once, as cost_model
                state["costs"] = "unchanged: rollout.cost_model"
            out["aware_states"].append({"workload": workload, "mode": mode, "rep": rep, "configs": r["configs"],
                                        "probes": state.get("probes"), "state": state})

    def run_reps(workload: str, contenders: dict, requests, sampling, seed, undecided, unshared: str | None = None
                 ) -> tuple[dict, float]:
        """The contenders' calls, rotated: a warm-up and `size.reps` timed repetitions, then more while
        `undecided(runs)` (aware within noise of its line), up to `size.extra_reps` and EXTRA_SHARE of the
        stage's time left; and the seconds of the warm-up and the first `size.reps` (what the next level's
        are estimated from)."""
        runs: dict[str, list[dict]] = {m: [] for m in contenders}
        allowance, t, fixed_s = EXTRA_SHARE * c.stage_left(), time.perf_counter(), 0.0
        for rep in range(size.reps + size.extra_reps + 1):  # rep 0 warms up (and teaches the learning policies)
            if rep > size.reps:
                rep_s = fixed_s / (size.reps + 1)
                if not undecided(runs) or (rep - size.reps) * rep_s > allowance or rep_s > c.stage_left():
                    break
            order = rotated(list(contenders), rep)
            for mode in order:
                r = generate_call(engine, contenders[mode], requests, sampling, seed(rep), share_prefill=mode != unshared)
                record(workload, mode, rep, order, r, contenders[mode])
                if rep:
                    runs[mode].append(r)
            if rep == size.reps:
                fixed_s = time.perf_counter() - t
        engine.share_prefill = True
        return runs, fixed_s

    # the GRPO batch's generate calls: every mode, the static sweep and unshared prefill, each reps + 1 times
    calls = (len(SWEEP_MODES) + len(STATIC_SWEEP) + 1) * (size.reps + 1)
    sweep: list[dict] = []
    t = time.perf_counter()
    level_s = 0.0
    sampling = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                              max_new_tokens=size.sweep_tokens, ignore_eos=True)
    for B in size.levels:
        # within the budget: a level costs at most about twice the one before (the engine's steps cost much
        # the same at 4x the sequences until the GPU is busy), and the GRPO batch needs its least (64 tokens)
        step_s = sweep[-1]["concurrency"] / sweep[-1]["off_tok_s"] if sweep else 0.0
        if sweep and c.stage_left() < 2 * level_s + calls * 64 * step_s:
            out["levels_skipped_for_time"].append(B)
            continue
        t1 = time.perf_counter()
        requests = [Request(prompts[i % len(prompts)], max_new_tokens=size.sweep_tokens) for i in range(B)]
        runs, level_s = run_reps(f"sweep_{B}", policies, requests, sampling, lambda rep, B=B: 1000 * rep + B,
                                 lambda runs, B=B: aware_verdict(*level_ratio(level_row(B, runs))) == "within noise")
        row = level_row(B, runs) | {"seconds": time.perf_counter() - t1}
        sweep.append(row)
        out["levels"].append(B)
        log(f"concurrency {B:3d}: " + ", ".join(f"{m} {row[f'{m}_tok_s']:.0f}±{row[f'{m}_tok_s_se']:.0f}"
                                                for m in SWEEP_MODES)
            + f" tok/s | A/A {row['aa_ratio']:.3f}, aware / best fixed ({row['best_fixed']}) {row['aware_vs_best']:.2f}")
        c.partial("rollout", out | {"sweep": sweep})
    out["sweep"], out["sweep_s"] = sweep, time.perf_counter() - t
    # the GRPO batch's length cap, lowered (to 32 at least) if its calls would not fit in what is left, priced
    # at plain decoding's step at the nearest concurrency measured, with half again for the other modes
    max_new = size.grpo_max_new
    if sweep and math.isfinite(c.stage_left()):
        near = min(sweep, key=lambda r: abs(r["concurrency"] - 8 * size.grpo_prompts))
        step_s = near["concurrency"] / near["off_tok_s"]
        max_new = min(max_new, max(32, int(c.stage_left() / (1.5 * calls * step_s))))
    out["grpo_max_new"] = max_new
    t = time.perf_counter()
    contenders = dict(policies) | {f"static_{s.depth}_{s.topk}_{s.num_verify}": Static(s) for s in STATIC_SWEEP}
    contenders[UNSHARED] = policies["off"]  # plain decoding with every sample prefilling its own prompt
    requests = [Request(p) for p in prompts[: size.grpo_prompts] for _ in range(8)]
    grpo_sampling = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, max_new_tokens=max_new)
    fixed = (*FIXED_MODES, *(m for m in contenders if m.startswith("static_") and m != AA_PAIR[1]))
    runs, _ = run_reps("grpo", contenders, requests, grpo_sampling, lambda rep: 77 + rep,
                       lambda runs: aware_verdict(*grpo_ratio(grpo_summary(runs, fixed))) == "within noise",
                       unshared=UNSHARED)
    g = grpo_summary(runs, fixed)
    # the shares of each mode's median-time repetition (medians of each part would not add up to 1)
    g["time_shares"] = {m: _shares(sorted(runs[m], key=lambda r: r["seconds"])[len(runs[m]) // 2])
                        for m in ("off", "aware")}
    out["grpo_batch"], out["grpo_batch_s"] = g, time.perf_counter() - t
    log("GRPO batch: " + ", ".join(f"{m} {s:.2f}s" for m, s in g["all_s"].items())
        + f" | A/A {g['aa_ratio']:.3f}, aware / best fixed ({g['best_fixed']}) {g['aware_vs_best']:.2f}, "
          f"aware / off {g['aware_vs_off']:.2f}")
    out["engine"] = engine_info(engine)
    out["cost_model_after"] = jsonable(getattr(policies["aware"], "costs", None))
    if out["levels_skipped_for_time"] or max_new < size.grpo_max_new:
        log(f"rollout: to stay within the budget, skipped levels {out['levels_skipped_for_time']} and capped the "
             f"GRPO batch at {max_new} new tokens (planned {size.grpo_max_new})")
    return out
