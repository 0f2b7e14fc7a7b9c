"""`aware` over short calls on a machine that stalls: SIMULATED steps of the four step-cost truths of
`fastgrpo/bench/simulate/truths.py`, 3% noise on every step and a fraction of steps stalled (their time
multiplied), a fresh `aware` for each of `--seeds` runs of `--steps` steps (a call of a bench's fixed-concurrency
workload is 50-130 steps, a shared CPU stalls single steps by 2-3x). Prints, per truth and running count, aware's
throughput over the best fixed choice's (the stalls' mean cost charged to both): mean and least over the seeds,
and aware's share of speculative steps (`--trace`: the least seed's steps by shape).

    python tools/aware_stalls.py --steps 200 --seeds 10 --stalls 0,0.03:2.5,0.1:2
"""

from __future__ import annotations

import argparse
import itertools
import math
import random

from fastgrpo.bench.simulate.truths import TRUTHS, accepted, best_fixed, gpu_calibration
from fastgrpo.speculation.policy import Aware


def run(truth, running: int, steps: int, seed: int, chance: float, factor: float) -> tuple[float, float, str]:
    """aware's tokens a second, its share of speculative steps and its steps' shapes over one run (runs of
    one shape as SHAPExN, a stalled step marked *)."""
    rng = random.Random(seed)
    aware = Aware(gpu_calibration())
    tokens = seconds = 0.0
    speculative, shapes = 0, []
    for _ in range(steps):
        c = aware.choose(running, 512)
        t = truth(c, running) * math.exp(rng.gauss(0, 0.03))
        stalled = rng.random() < chance
        if stalled:
            t *= factor
        shapes.append(("*" if stalled else "") + (c.name if c else "plain"))
        acc = None if c is None else accepted(c, running, rng)
        emitted = running if acc is None else sum(a + 1 for a in acc)
        aware.observe(c, running, emitted, t, acc)
        tokens, seconds, speculative = tokens + emitted, seconds + t, speculative + (c is not None)
    runs = ((shape, len(list(same))) for shape, same in itertools.groupby(shapes))
    return tokens / seconds, speculative / steps, " ".join(f"{s}x{n}" if n > 1 else s for s, n in runs)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--running", default="1,4,16,64")
    ap.add_argument("--stalls", default="0,0.03:2.5,0.1:2",
                    help="comma-separated CHANCE:FACTOR (a step stalls with CHANCE, its time times FACTOR); 0: none")
    ap.add_argument("--trace", action="store_true", help="also print each cell's least seed's steps by shape")
    args = ap.parse_args(argv)
    rows = []
    for spec in args.stalls.split(","):
        chance, factor = (float(x) for x in spec.split(":")) if ":" in spec else (float(spec), 1.0)
        for truth in TRUTHS:
            for running in (int(x) for x in args.running.split(",")):
                best, shape = best_fixed(truth, running)
                best /= 1 + chance * (factor - 1)  # the stalls cost a fixed choice too
                runs = [run(truth, running, args.steps, seed, chance, factor) for seed in range(args.seeds)]
                ratios = [rate / best for rate, *_ in runs]
                row = {"stalls": chance, "factor": factor, "truth": truth.__name__, "running": running,
                       "best_fixed": shape.name if shape else "plain", "mean": sum(ratios) / len(ratios),
                       "least": min(ratios), "speculative": sum(s for _, s, _ in runs) / len(runs)}
                rows.append(row)
                print(f"stalls {chance:4.2f} x{factor:<3g} {truth.__name__:18s} running {running:3d} "
                      f"(best fixed {row['best_fixed']:>8}): aware / best fixed mean {row['mean']:.3f}, "
                      f"least {row['least']:.3f}; {row['speculative']:.0%} speculative", flush=True)
                if args.trace:
                    print("    least seed's steps: " + runs[ratios.index(row["least"])][2], flush=True)
    return rows


if __name__ == "__main__":
    main()
