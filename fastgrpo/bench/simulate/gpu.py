"""bench simulate: gPU scale (SIMULATED)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from fastgrpo.bench.rollout import STATIC_SWEEP
from fastgrpo.speculation.roofline import ACCELERATORS, MODELS, Roofline
from fastgrpo.speculation.spec import SpecConfig
from fastgrpo.bench.simulate.costs import Costs
from fastgrpo.bench.simulate.acceptance import AcceptanceProfile, DraftConfidence
from fastgrpo.bench.simulate.workload import SimRequest, Workload
from fastgrpo.bench.simulate.simulator import SimRun, sim_policies, simulate


GPU_STATICS = (*STATIC_SWEEP, SpecConfig(6, 8, 32), SpecConfig(6, 8, 64))
RHO_SWEEP = (0.0, 0.25, 0.75, 1.0)  # the draft confidence's informativeness, around the assumed 0.5
GPU_MAX_BATCH = 128  # rows an engine keeps running: bounded by KV memory at these lengths (our assumption)
# policies that learn: a warm-up rollout first, as in training
LEARNING = ("tlt", "aware", "aware_per_sequence", "aware_expert_blind")
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
                 modes: Sequence[str] | None = None, static_widths: bool = False) -> dict[str, dict]:
    """Every policy (or `modes`) on one workload: median simulated seconds of `reps` rollouts (learning
    policies after a warm-up rollout), with the median run kept for its trace. `static_widths`: `simulate`'s.
    Each policy draws from its own generator of `seed`: the same draws for every policy as far as they ask
    alike (common random numbers), and no policy's figure depends on which others ran before it."""
    policies = sim_policies(costs, statics, tlt_seed=seed)
    out = {}
    for mode, policy in policies.items():
        if modes is not None and mode not in modes:
            continue
        rng = np.random.default_rng(seed)
        runs = []
        for rep in range(reps + (mode in LEARNING)):
            run = simulate(workload, costs, acceptance, policy, max_batch, rng, confidence=confidence,
                           static_widths=static_widths)
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


def fixed_seeds(running: int) -> int:
    """Independent runs of a fixed-concurrency cell: enough that every cell draws at least 16 sequences'
    tokens, and three at the least. One sequence of 512 tokens is some 80 steps of a deep tree, and its
    acceptance draws alone move a policy's time by 5%: the best of ten static trees, each timed on one
    draw, is then the luckiest draw: one run a cell read `aware` at 0.94x of it at one running on H100 / 8B,
    where 16 runs read 1.00x (`python tools/fixed_concurrency_sim.py`)."""
    return max(3, math.ceil(16 / running))


def gpu_fixed_concurrency(acceptance: AcceptanceProfile, levels: Sequence[int], tokens: int, prompt_len: int,
                          seed: int) -> list[dict]:
    """B sequences kept running for `tokens` each (EOS ignored), every policy, per GPU and model, `fixed_seeds`
    runs of seeds seed, seed + 1, ...: each policy's mean seconds, the best static tree by its mean (a fixed
    choice made in advance, not the luckiest per run), and `aware` / that tree with the standard error of the
    per-run ratios (the runs of one seed are paired: common random numbers)."""
    out = []
    for hw in ACCELERATORS.values():
        for model in MODELS.values():
            costs = Roofline(hw, model)
            for B in levels:
                wl = Workload(f"fixed {B}", [SimRequest(i, prompt_len, tokens) for i in range(B)], tokens,
                              prompt_len + tokens + 1, known_lengths=True)
                runs = [{m: r["seconds"] for m, r in run_policies(wl, costs, acceptance, GPU_STATICS, max(B, 1), 1,
                                                                  seed + k).items()}
                        for k in range(fixed_seeds(B))]
                mean = {m: float(np.mean([r[m] for r in runs])) for m in runs[0]}
                best = min((m for m in mean if m.startswith("static_")), key=mean.get)
                ratios = [r[best] / r["aware"] for r in runs]
                out.append({"hardware": hw.name, "model": model.name, "running": B, "seeds": len(runs),
                            "off_s": mean["off"], "static_best_s": mean[best], "static_best": best[7:],
                            "fastgrpo_s": mean["fastgrpo"], "tlt_s": mean["tlt"], "aware_s": mean["aware"],
                            "aware_per_sequence_s": mean["aware_per_sequence"],
                            "aware_over_best_static": mean[best] / mean["aware"],
                            "aware_over_best_static_se": float(np.std(ratios, ddof=1) / np.sqrt(len(ratios)))})
    return out
