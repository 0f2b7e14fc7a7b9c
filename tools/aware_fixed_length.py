"""`aware` on batches whose rows all stop at one length (a bench's fixed-concurrency workload: EOS ignored, every
row the same tokens), SIMULATED on the step-cost truths of `fastgrpo/bench/simulate/truths.py`. Speculation lets
rows finish unevenly, and the last rows decode at fewer rows, where a step costs more a row (the tail), which
plain decoding never has; a tree chosen for its rate a step at the batch's rows is not the best for the batch.
Per truth, rows and length: the best tree a step at the full batch and its rate over plain decoding's; the best
fixed choice over the whole batch (plain or a static tree, by its mean seconds over the seeds) and plain's time
over it; `aware` (one object over a warm-up call and one call per seed, as `bench rollout` keeps it; told each
row's tokens left before each step, as the engine tells it where EOS is ignored, or with `--unknown` told
nothing: then it ranks trees by their goodput a step) against both, each a ratio of means over the same seeds,
with the standard error of the per-seed ratios (a short batch's time varies by several percent from seed to seed,
with the draws of acceptance): the batch's best over a step's best is what a step's rate costs as an objective; a
step's best held fixed over aware, what aware's learning costs in the batch.

    python tools/aware_fixed_length.py --rows 16,64 --tokens 48,128 --seeds 10 [--truths graphed,...] [--unknown]
"""

from __future__ import annotations

import argparse
import statistics

from fastgrpo.bench.simulate.truths import TRUTHS, best_fixed, gpu_calibration, rollout_seconds
from fastgrpo.speculation.policy import Aware, Off, Static, candidate_configs


def ratio(over: list[float], under: list[float]) -> tuple[float, float]:
    """sum(over) / sum(under), and the standard error of the per-seed ratios' mean."""
    each = [a / b for a, b in zip(over, under)]
    return sum(over) / sum(under), statistics.stdev(each) / len(each) ** 0.5 if len(each) > 1 else 0.0


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="16,64")
    ap.add_argument("--tokens", default="48,128", help="each row's length, comma-separated")
    ap.add_argument("--seeds", type=int, default=10, help="timed calls of aware, and runs of each fixed choice")
    ap.add_argument("--truths", default=",".join(t.__name__ for t in TRUTHS), help="comma-separated")
    ap.add_argument("--unknown", action="store_true",
                    help="aware is not told the rows' tokens left (it ranks trees by their rate a step)")
    args = ap.parse_args(argv)
    seeds = range(1, args.seeds + 1)
    out = []
    for truth in (t for t in TRUTHS if t.__name__ in args.truths.split(",")):
        for rows in (int(x) for x in args.rows.split(",")):
            for tokens in (int(x) for x in args.tokens.split(",")):
                lengths = [tokens] * rows
                per_step_rate, per_step = best_fixed(truth, rows)
                fixed = {c: [rollout_seconds(truth, lengths, Off() if c is None else Static(c), s) for s in seeds]
                         for c in [None, *candidate_configs()]}
                best = min(fixed, key=lambda c: sum(fixed[c]))
                aware = Aware(gpu_calibration())
                rollout_seconds(truth, lengths, aware, 0, known=not args.unknown)
                aware_s = [rollout_seconds(truth, lengths, aware, s, known=not args.unknown) for s in seeds]
                (best_over, best_se), (step_over, step_se) = ratio(fixed[best], aware_s), ratio(fixed[per_step], aware_s)
                row = {"truth": truth.__name__, "rows": rows, "tokens": tokens,
                       "per_step_best": per_step.name if per_step else "plain",
                       "per_step_over_plain": per_step_rate * truth(None, rows) / rows,
                       "batch_best": best.name if best else "plain",
                       "plain_over_best": ratio(fixed[None], fixed[best])[0],
                       "plain_over_aware": ratio(fixed[None], aware_s)[0],
                       "best_over_aware": best_over, "best_over_aware_se": best_se,
                       "step_best_over_aware": step_over, "step_best_over_aware_se": step_se}
                out.append(row)
                print(f"{row['truth']:18s} {rows:3d} rows x {tokens:4d} tokens: a step's best {row['per_step_best']:>8} "
                      f"{row['per_step_over_plain']:.2f}x plain; the batch's best {row['batch_best']:>8} "
                      f"{row['plain_over_best']:.2f}x plain; aware {row['plain_over_aware']:.2f}x plain, "
                      f"{best_over:.3f}x the batch's best / aware's time (se {best_se:.3f}), "
                      f"{step_over:.3f}x a step's best's (se {step_se:.3f})", flush=True)
    return out


if __name__ == "__main__":
    main()
