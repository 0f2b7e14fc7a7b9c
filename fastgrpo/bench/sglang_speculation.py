"""`fastgrpo bench sglang-tiers`: `aware` on SGLang against SGLang's own speculation, SIMULATED.

The case is bench simulate's H100 / Llama-3-8B long-tail GRPO rollout (64 prompts x 8 samples,
lognormal lengths of mean 3,000 tokens capped at 16,384; at most 128 rows running), priced by the
same roofline (speculation/roofline.py) with every decode step padded to the CUDA-graph batch size
SGLang would run it at, and accepted drafts drawn from the same cited EAGLE-3 profile. Policies, all
as SGLang can run them (speculation/sglang_tiers.py):
- `off`: SGLang without speculation;
- `static_*`: SGLang's static EAGLE, every shape of bench simulate's GPU sweep plus every chain of
  1-7 steps; the best is reported;
- `sglang_adaptive`: SGLang's adaptive EAGLE with its default tiers and EMA;
- `aware_sglang`: aware's chain per captured size, refreshed between generate calls, priced by the
  same roofline the simulator runs (SGLang has no calibration of its own forwards, so a deployment
  prices with the roofline too: here it is exact, the optimistic case), and `aware_sglang_misprices`,
  priced by a roofline whose efficiencies and overheads are off by a third;
- `aware` (reference, not runnable on SGLang): aware with trees and per-step decisions.
Learning policies (the two adaptive ones and aware) get a warm-up rollout first, as in training where
the engine lives across steps. Each policy's rollout is repeated; medians, ratios and the bootstrapped
standard error of each ratio are reported.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from fastgrpo.bench.simulate import GPU_STATICS, eagle_profile, longtail_workload, simulate
from fastgrpo.speculation.policy import Aware, Off, SpeculationPolicy, Static
from fastgrpo.speculation.roofline import H100, LLAMA3_8B, Roofline, simulated_cost_model
from fastgrpo.speculation.sglang_tiers import (MAX_STEPS, AwareTiers, SGLangAdaptive, chain, pad,
                                               plain_capture_sizes, spec_capture_sizes)
from fastgrpo.speculation.spec import SpecConfig

MAX_RUNNING = 128  # bench simulate's GPU_MAX_BATCH: SGLang's max_running_requests here
# the width gain of a tree over a chain (AcceptanceProfile.beta) as our draft's fit in bench simulate's
# full run (bench/simulate.json gpu_acceptance.beta); it prices static trees only (chains do not use it)
BETA = 0.9
LEARNING = ("sglang_adaptive", "aware_sglang", "aware_sglang_misprices", "aware")


class Padded:
    """Costs of a decode step run at the CUDA-graph batch size it is padded to (the padded rows add
    tokens to every matmul, no context). Prefill is not padded."""

    def __init__(self, costs: Roofline, sizes: list[int]):
        self.costs, self.sizes = costs, sizes
        self.name, self.padded = costs.name, costs.padded

    def decode_step(self, B: int, ctx_max: int, ctx_sum: int, speculating: bool = False) -> float:
        return self.costs.decode_step(pad(B, self.sizes), ctx_max, ctx_sum, speculating)

    def spec_step(self, c: SpecConfig, B: int, width: int, ctx_max: int, ctx_sum: int,
                  verified: float | None = None) -> float:
        return self.costs.spec_step(c, pad(B, self.sizes), width, ctx_max, ctx_sum, verified)

    def __getattr__(self, name: str):  # target, draft, prefill, between_steps, per_call
        return getattr(self.costs, name)


def policies(spec_costs: Padded, max_context: int) -> dict[str, SpeculationPolicy]:
    sizes = spec_capture_sizes(MAX_RUNNING)
    calibrated = simulated_cost_model(spec_costs)
    statics = {c.name: c for c in (*GPU_STATICS, *(chain(d) for d in range(1, MAX_STEPS + 1)))}
    # aware_sglang prices steps with a roofline (SGLang offers no calibration of its forwards): the
    # simulator's own, the optimistic case, and one whose efficiencies and overheads are off by a
    # third, so that what a wrong price costs is measured too
    wrong = replace(spec_costs.costs.hw, bw_eff=0.6, flops_eff=0.8, target_overhead_s=0.8e-3, spec_overhead_s=0.1e-3)
    return ({"off": Off()} | {f"static_{n}": Static(c) for n, c in statics.items()}
            | {"sglang_adaptive": SGLangAdaptive(capture_sizes=sizes), "aware_sglang": AwareTiers(spec_costs, sizes, max_context),
               "aware_sglang_misprices": AwareTiers(Roofline(wrong, spec_costs.costs.model), sizes, max_context),
               "aware": Aware(calibrated)})


def ratio_se(num: list[float], den: list[float], rng: np.random.Generator, resamples: int = 2000) -> float:
    """Bootstrapped standard error of median(num) / median(den), the two resampled independently."""
    a, b = np.asarray(num), np.asarray(den)
    r = (np.median(rng.choice(a, (resamples, len(a))), axis=1) / np.median(rng.choice(b, (resamples, len(b))), axis=1))
    return float(np.std(r))


def bench_sglang_tiers(cfg, quick: bool, output: Path, extra: list[str] | None = None) -> dict:
    from fastgrpo.bench.report import command_line, publish

    t0 = time.perf_counter()
    reps = 2 if quick else 5
    lt = dict(prompts=16 if quick else 64, group=8, mean=3000.0, sigma=1.0, max_new=8192 if quick else 16384,
              prompt_len=256)
    workload = longtail_workload(lt["prompts"], lt["group"], lt["mean"], lt["sigma"], lt["max_new"], lt["prompt_len"],
                                 cfg.seed)
    accept = eagle_profile(BETA)
    roof = Roofline(H100, LLAMA3_8B)
    spec_costs, plain_costs = Padded(roof, spec_capture_sizes(MAX_RUNNING)), Padded(roof, plain_capture_sizes(MAX_RUNNING))
    rng = np.random.default_rng(cfg.seed)
    seconds: dict[str, list[float]] = {}
    extras: dict[str, dict] = {}
    for mode, policy in policies(spec_costs, workload.max_context).items():
        costs = plain_costs if mode == "off" else spec_costs
        runs = [simulate(workload, costs, accept, policy, MAX_RUNNING, rng)
                for _ in range(reps + (mode in LEARNING))][1 if mode in LEARNING else 0:]
        seconds[mode] = [r.seconds for r in runs]
        if mode == "aware_sglang":
            extras[mode] = {"table": {str(k): v for k, v in policy.table.items()},
                            "candidates": {str(k): v for k, v in policy.candidates.items()}}
        print(f"SIMULATED {mode}: median {np.median(seconds[mode]):.1f}s over {len(runs)} rollouts", flush=True)
    med = {m: float(np.median(s)) for m, s in seconds.items()}
    statics = {m: s for m, s in med.items() if m.startswith("static_")}
    best = min(statics, key=statics.get)
    best_chain = min((m for m in statics if "k1n" in m), key=statics.get)
    compare = {"sglang_adaptive": "aware_sglang vs SGLang's default adaptive tiers",
               best: "aware_sglang vs SGLang's best static EAGLE", best_chain: "aware_sglang vs the best static chain",
               "off": "aware_sglang vs no speculation", "aware": "aware_sglang vs aware with trees (not on SGLang)",
               "aware_sglang_misprices": "aware_sglang vs itself priced by a wrong roofline"}
    ratios = {m: {"what": what, "speedup": med[m] / med["aware_sglang"],
                  "se": ratio_se(seconds[m], seconds["aware_sglang"], rng)} for m, what in compare.items()}
    result = {
        "meta": {"date": datetime.date.today().isoformat(), "quick": quick, "repetitions": reps, "seed": cfg.seed,
                 "case": f"{roof.name}, {workload.name}", "max_running": MAX_RUNNING, "acceptance": accept.to_json(),
                 "workload": lt, "seconds": time.perf_counter() - t0, "simulated": True},
        "seconds": seconds, "median_s": med, "best_static": best[7:], "best_static_chain": best_chain[7:],
        "ratios": ratios, "aware_sglang": extras.get("aware_sglang", {}),
        "targets": {"vs_default_adaptive": 1.10, "vs_best_static": 1.05},
    }
    publish(result, output, command_line("sglang-tiers", quick, output, extra), markdown)
    return result


def markdown(result: dict, command: str) -> str:
    m, r = result["meta"], result["ratios"]
    lines = [f"SIMULATED, not measured. `{command}` ({m['date']}; {m['case']}; at most {m['max_running']} running; "
             f"{m['repetitions']} rollouts per policy, learning ones after a warm-up rollout; every decode step "
             f"padded to SGLang's CUDA-graph size).", "",
             "| policy (as SGLang runs it) | median rollout s | aware_sglang speed-up (± s.e.) |", "|---|---:|---:|"]
    for mode, s in sorted(result["median_s"].items(), key=lambda kv: kv[1]):
        if mode.startswith("static_") and mode[7:] not in (result["best_static"], result["best_static_chain"]):
            continue
        ratio = r.get(mode)
        label = {"sglang_adaptive": "SGLang adaptive, default tiers", "off": "SGLang, no speculation",
                 "aware": "aware, trees (reference: not runnable on SGLang)",
                 "aware_sglang": "**aware_sglang** (chains per captured size, refreshed per call)",
                 "aware_sglang_misprices": "aware_sglang priced by a roofline a third off"}.get(
                     mode, f"SGLang static EAGLE {mode[7:]}")
        lines.append(f"| {label} | {s:.1f} | " + (f"{ratio['speedup']:.3f}x ± {ratio['se']:.3f}" if ratio else "—") + " |")
    t = result["targets"]
    lines += ["", f"Targets: at least {t['vs_default_adaptive']:.2f}x the default adaptive tiers "
              f"({r['sglang_adaptive']['speedup']:.3f}x) and {t['vs_best_static']:.2f}x the best static EAGLE "
              f"({r['static_' + result['best_static']]['speedup']:.3f}x)."]
    return "\n".join(lines)


# -- `fastgrpo bench sglang-tiers`: its sub-parser (fastgrpo/bench/command.py) --
def add_arguments(parser) -> None:
    """`fastgrpo bench sglang-tiers`'s own flags (--quick, --output, --config and overrides are every benchmark's)."""
    parser.set_defaults(needs="config")  # simulated only: no policy runs
    parser.set_defaults(run=from_cli)


def from_cli(args, cfg) -> dict:
    return bench_sglang_tiers(cfg, args.quick, args.output, extra=args.extra)
