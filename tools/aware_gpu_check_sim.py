"""The GPU check's rollout stage, SIMULATED on the step-cost truths of `fastgrpo/bench/simulate/truths.py`:
what its pass line (`aware` >= 0.97x the best fixed choice at every level) reads on a machine whose costs are
known.

The check (fastgrpo/bench/gpu_check/rollout_sweep.py) keeps one `aware` through the whole stage: at each
level of running sequences (1, 4, 16, 64, 256) a warm-up call and 3 timed calls of 64 tokens a row (EOS
ignored, so `aware` is told the rows' tokens left), then the GRPO batch (8 prompts x 8 samples, rows
ending at EOS: here lengths drawn log-normal around `--grpo-median` tokens, capped at 256), a warm-up and 3
timed calls. Each run of this tool replays that stage with a fresh `aware` and its own seeds; every fixed
choice (plain decoding and each candidate tree) runs the same timed calls' seeds, and the run's best fixed
choice is the one of least time over its 3 calls (the check takes the best of its few fixed modes: this is
stricter). Per truth and level: aware over the best fixed choice, the mean over the runs and the least,
and how many runs fell below 0.97x, the check's line; the calls' noise is the simulator's (3% a step,
acceptance's draws), not a GPU's.

    python tools/aware_gpu_check_sim.py [--runs 20] [--levels 1,4,16,64,256] [--tokens 64] [--calls 3]
                                        [--truths graphed,...] [--verdicts 9]

`--verdicts MOST` reads the stage as the check itself does instead: against its own few fixed modes, with
its verdict (met, within noise, not met: fastgrpo/bench/gpu_check/targets.py) after the 3 calls and after
the calls it adds while within noise, up to MOST.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
from collections import Counter

from fastgrpo.bench.simulate.truths import TRUTHS, gpu_calibration, rollout_seconds
from fastgrpo.speculation.policy import Aware, Off, Static, candidate_configs
from fastgrpo.speculation.spec import SpecConfig

LINE = 0.97  # the check's pass line for aware over the best fixed choice


def grpo_lengths(rows: int, median: float, cap: int = 256) -> list[int]:
    """A GRPO batch's lengths: log-normal around `median` (sigma 0.8), at least 8, at most the check's cap."""
    rng = random.Random(10_000)
    return [min(cap, max(8, int(rng.lognormvariate(math.log(median), 0.8)))) for _ in range(rows)]


def call_seed(run: int, rep: int, lengths: list[int]) -> int:
    """A workload's call `rep` (0: the warm-up) in replay `run`: every mode runs it with the same draws."""
    return 100_000 * run + 1000 * rep + len(lengths)


def fixed(c: SpecConfig | None) -> Off:
    return Off() if c is None else Static(c)


def expected_best(truth, lengths: list[int], seeds: int = 12) -> SpecConfig | None:
    """The fixed choice of least mean time over `seeds` calls of their own (none a replay's): the best by
    expectation, free of the luck of the 3 calls it is then compared on."""
    return min([None, *candidate_configs()],
               key=lambda c: sum(rollout_seconds(truth, lengths, fixed(c), 900_000 + s) for s in range(seeds)))


def stage(truth, run: int, workloads: list[tuple[str, list[int], bool, SpecConfig | None]],
          calls: int = 3) -> dict[str, tuple[float, float, float]]:
    """One replay of the rollout stage: per workload, the best fixed choice's time over aware's over the same
    timed calls (above 1, aware was faster), the best as the check takes it (of least time over these
    calls) and as expected (`expected_best`); and the latter held fixed over the former (a chooser that
    knew the truth, read through the same 3 calls: the line's own noise)."""
    aware = Aware(gpu_calibration())
    out = {}
    for name, lengths, known, best in workloads:
        seeds = [call_seed(run, rep, lengths) for rep in range(calls + 1)]
        rollout_seconds(truth, lengths, aware, seeds[0], known=known)  # the warm-up call
        aware_s = sum(rollout_seconds(truth, lengths, aware, s, known=known) for s in seeds[1:])
        times = {c: sum(rollout_seconds(truth, lengths, fixed(c), s) for s in seeds[1:])
                 for c in [None, *candidate_configs()]}
        out[name] = (min(times.values()) / aware_s, times[best] / aware_s, min(times.values()) / times[best])
    return out


def verdicts(truth, run: int, workloads: list[tuple[str, list[int], bool, SpecConfig | None]], most: int,
             calls: int = 3) -> dict[str, tuple[str, str, int]]:
    """One replay of the stage as the check reads it (`--verdicts`): its fixed modes (plain decoding, the
    default static tree d4k4n12, fastgrpo's formula and TLT, which learns through the stage as aware does),
    each call's tokens a second, and the check's verdict (`targets.aware_verdict`: aware's median over the
    best fixed mode's, with its standard error; the A/A pair reads 1 here, as identical seeds run alike) after
    `calls` timed calls and after the calls the check adds while it is within noise, up to `most`. Per
    workload: the two verdicts and the calls taken."""
    from fastgrpo.bench.gpu_check.harness import spread
    from fastgrpo.bench.gpu_check.targets import aware_verdict, ratio_se
    from fastgrpo.speculation.policy import FastGRPOFormula
    from fastgrpo.speculation.tlt import TLT

    modes = {"off": Off(), "static": Static(SpecConfig(4, 4, 12)), "fastgrpo": FastGRPOFormula(), "tlt": TLT(),
             "aware": Aware(gpu_calibration())}
    out = {}
    for name, lengths, known, _ in workloads:
        tok_s: dict[str, list[float]] = {m: [] for m in modes}

        def verdict() -> str:
            s = {m: spread(v) for m, v in tok_s.items()}
            best = max((m for m in modes if m != "aware"), key=lambda m: s[m]["median"])
            ratio = s["aware"]["median"] / s[best]["median"]
            se = ratio_se(ratio, s["aware"]["median"], s["aware"]["se"], s[best]["median"], s[best]["se"])
            return aware_verdict(ratio, se, 1.0)

        first = None
        for rep in range(most + 1):  # rep 0: the warm-up
            if rep > calls and verdict() != "within noise":
                break
            for mode, policy in modes.items():
                seconds = rollout_seconds(truth, lengths, policy, call_seed(run, rep, lengths),
                                          known=known and mode == "aware")
                if rep:
                    tok_s[mode].append(sum(lengths) / seconds)
            if rep == calls:
                first = verdict()
        out[name] = (first, verdict(), len(tok_s["aware"]))
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20, help="replays of the stage, each a fresh aware and its own seeds")
    ap.add_argument("--levels", default="1,4,16,64,256")
    ap.add_argument("--tokens", type=int, default=64, help="each row's length at the fixed levels")
    ap.add_argument("--calls", type=int, default=3, help="timed calls a workload after its warm-up (the check's reps)")
    ap.add_argument("--grpo-rows", type=int, default=64)
    ap.add_argument("--grpo-median", type=float, default=120.0, help="the GRPO batch's median length")
    ap.add_argument("--truths", default=",".join(t.__name__ for t in TRUTHS), help="comma-separated")
    ap.add_argument("--verdicts", type=int, metavar="MOST",
                    help="the check's own modes and verdicts instead, calls added while within noise up to MOST")
    args = ap.parse_args(argv)
    if args.verdicts is not None and args.verdicts < args.calls:
        ap.error(f"--verdicts {args.verdicts}: the most calls must be at least --calls ({args.calls})")
    levels = [int(x) for x in args.levels.split(",")]
    out = []
    for truth in (t for t in TRUTHS if t.__name__ in args.truths.split(",")):
        workloads = [(f"{B}", [args.tokens] * B, True) for B in levels]
        workloads.append(("grpo", grpo_lengths(args.grpo_rows, args.grpo_median), False))
        if args.verdicts:
            workloads = [(name, lengths, known, None) for name, lengths, known in workloads]
            runs = [verdicts(truth, r, workloads, args.verdicts, args.calls) for r in range(args.runs)]
            for name, *_ in workloads:
                got = [r[name] for r in runs]
                row = {"truth": truth.__name__, "workload": name, "runs": args.runs,
                       "after_calls": dict(Counter(first for first, _, _ in got)),
                       "at_end": dict(Counter(end for _, end, _ in got)),
                       "mean_calls": statistics.mean(n for *_, n in got)}
                out.append(row)
                print(f"{row['truth']:17s} {name:>4s}: after {args.calls} calls {row['after_calls']}; with calls added "
                      f"while within noise (up to {args.verdicts}, {row['mean_calls']:.1f} on average) {row['at_end']}",
                      flush=True)
            continue
        workloads = [(name, lengths, known, expected_best(truth, lengths)) for name, lengths, known in workloads]
        runs = [stage(truth, r, workloads, args.calls) for r in range(args.runs)]
        for name, _, _, best in workloads:
            row = {"truth": truth.__name__, "workload": name, "expected_best_choice": best.name if best else "plain",
                   "runs": args.runs}
            for i, against in enumerate(("over_calls_best", "over_expected_best", "expected_best_over_calls_best")):
                ratios = [r[name][i] for r in runs]
                row[against] = {"mean": statistics.mean(ratios), "least": min(ratios),
                                "se": statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else 0.0,
                                "below_line": sum(x < LINE for x in ratios)}
            out.append(row)
            print(f"{row['truth']:17s} {name:>4s}: " + "; ".join(
                f"{label} {row[k]['mean']:.3f} (se {row[k]['se']:.3f}) least {row[k]['least']:.3f} "
                f"{row[k]['below_line']}/{args.runs} < {LINE}"
                for label, k in (("aware / calls' best", "over_calls_best"),
                                 (f"aware / expected best {row['expected_best_choice']}", "over_expected_best"),
                                 ("expected / calls' best", "expected_best_over_calls_best"))), flush=True)
    return out


if __name__ == "__main__":
    main()
