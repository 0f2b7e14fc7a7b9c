"""`aware` on batches whose rows all stop at one length (a bench's fixed-concurrency workload: EOS ignored,
every row the same tokens), SIMULATED on `tests/test_aware_steps.py`'s step-cost truths. Speculation lets rows
finish unevenly, and the last rows decode at fewer rows, where a step costs more a row (the tail), which plain
decoding never has; a tree chosen for its rate a step at the batch's rows is not the best for the batch. Per
truth, rows and length: the best tree a step at the full batch and its rate over plain decoding's; the best
fixed choice over the whole batch (plain or a static tree, its seconds at seed 1) and plain's time over it; `aware` (one object over a
warm-up call and `--calls` timed calls, as `bench rollout` keeps it) against both: the batch's best over
a step's best is what a step's rate costs as an objective; a step's best held fixed over aware, what aware's
learning costs in the batch (each bucket of the tail met cold in the warm-up call).

    python tools/aware_fixed_length.py --rows 16,64 --tokens 48,128 --calls 3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_aware_steps import TRUTHS, best_fixed, gpu_calibration, rollout_seconds  # noqa: E402

from fastgrpo.speculation.policy import Aware, Off, Static, candidate_configs  # noqa: E402


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="16,64")
    ap.add_argument("--tokens", default="48,128", help="each row's length, comma-separated")
    ap.add_argument("--calls", type=int, default=3, help="aware's timed calls, after a warm-up call")
    args = ap.parse_args(argv)
    out = []
    for truth in TRUTHS:
        for rows in (int(x) for x in args.rows.split(",")):
            for tokens in (int(x) for x in args.tokens.split(",")):
                lengths = [tokens] * rows
                plain = rollout_seconds(truth, lengths, Off(), 1)
                per_step_rate, per_step = best_fixed(truth, rows)
                fixed = {c: rollout_seconds(truth, lengths, Static(c), 1) for c in candidate_configs()} | {None: plain}
                best = min(fixed, key=fixed.get)
                aware = Aware(gpu_calibration())
                rollout_seconds(truth, lengths, aware, 0)
                aware_s = sum(rollout_seconds(truth, lengths, aware, s) for s in range(1, args.calls + 1)) / args.calls
                row = {"truth": truth.__name__, "rows": rows, "tokens": tokens,
                       "per_step_best": per_step.name if per_step else "plain",
                       "per_step_over_plain": per_step_rate * truth(None, rows) / rows,
                       "batch_best": best.name if best else "plain", "plain_over_best": plain / fixed[best],
                       "plain_over_aware": plain / aware_s, "best_over_aware": fixed[best] / aware_s,
                       "step_best_over_aware": fixed[per_step] / aware_s}
                out.append(row)
                print(f"{row['truth']:18s} {rows:3d} rows x {tokens:4d} tokens: a step's best {row['per_step_best']:>8} "
                      f"{row['per_step_over_plain']:.2f}x plain; the batch's best {row['batch_best']:>8} {row['plain_over_best']:.2f}x "
                      f"plain; aware {row['plain_over_aware']:.2f}x plain, {row['best_over_aware']:.3f}x the batch's best "
                      f"/ aware's time, {row['step_best_over_aware']:.3f}x a step's best's", flush=True)
    return out


if __name__ == "__main__":
    main()
