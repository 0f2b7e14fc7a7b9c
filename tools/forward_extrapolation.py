"""How well does the cost model price a target forward past the sweep's last point (512 tokens)?

The cost model (fastgrpo/speculation/cost_model.py) prices a forward of more tokens than its curve's last
point on the last segment's slope (`piecewise_linear_at`); a tree of 24 nodes verified over 64 rows is a
1,536-token forward. This times the policy's target forward (random weights of `--size`) at 64 rows of n
tokens each over 128 cached tokens, for the sweep's sizes up to 512 and the larger ones asked for, in
`--rounds` rounds (median of `--reps` a size), and reports each larger size's measured time beside two
prices made from the points up to 512 of the same round: the cost model's (the last segment's slope) and a
line through the origin and the last point (what a compute-bound forward would cost per token).

    python tools/forward_extrapolation.py --size bench --threads 2 --rounds 2
"""

from __future__ import annotations

import argparse

import torch

from fastgrpo.engines.embedded.calibrate import _time
from fastgrpo.engines.embedded.model import InferenceModel, KVCache
from fastgrpo.models.policy import new_policy, policy_config
from fastgrpo.speculation.cost_model import CONTEXT, ROWS, SWEEP, piecewise_linear_at

SWEPT = tuple(t for t in SWEEP if t >= ROWS)  # the sweep's points at 64 rows (1, 2, 4, 8 tokens a row)


def forward_seconds(model: InferenceModel, cache: KVCache, tokens_per_row: int, reps: int) -> float:
    """The median of `reps` target forwards of ROWS rows of `tokens_per_row` tokens over CONTEXT cached ones,
    timed as the engine's calibration times its sweep (a forward leaves the cache's lengths as they were)."""
    ids = torch.randint(0, model.cfg.vocab_size, (ROWS, tokens_per_row))
    cache.lengths.fill_(CONTEXT)
    with torch.inference_mode():
        return _time(lambda: model.forward(ids, cache, slice(0, ROWS)), reps)


def measure(size: str, larger: tuple[int, ...], rounds: int, reps: int) -> list[dict]:
    """A row per (round, larger size): measured seconds and the two prices from that round's swept points."""
    positions = CONTEXT + max(larger) // ROWS + 1
    cfg = policy_config(size, 1000, positions, 1, 2, 0)
    model = InferenceModel(cfg, positions)
    model.load(new_policy(cfg, 0).state_dict().items())
    cache = KVCache(cfg, ROWS, positions)
    rows = []
    for r in range(rounds):
        seconds = {t: forward_seconds(model, cache, t // ROWS, reps) for t in (*SWEPT, *larger)}
        xs, ys = [float(t) for t in SWEPT], [seconds[t] for t in SWEPT]
        for t in larger:
            segment = piecewise_linear_at(xs, ys, t)
            origin = ys[-1] * t / xs[-1]
            rows.append({"round": r, "tokens": t, "measured_s": seconds[t], "segment_s": segment, "origin_s": origin,
                         "swept_s": dict(zip(SWEPT, ys)),
                         "segment_error": segment / seconds[t] - 1, "origin_error": origin / seconds[t] - 1})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="bench", help="the policy size (fastgrpo.models.policy.SIZES)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--larger", default="768,1024,1536", help="token counts past 512, multiples of 64")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args(argv)
    larger = tuple(int(t) for t in args.larger.split(","))
    if any(t <= SWEPT[-1] or t % ROWS for t in larger):
        ap.error(f"--larger: each size must be a multiple of {ROWS} above {SWEPT[-1]}, got {args.larger}")
    torch.set_num_threads(args.threads)
    rows = measure(args.size, larger, args.rounds, args.reps)
    print(f"target forward, {args.size} policy, {ROWS} rows over {CONTEXT} cached tokens, {args.threads} threads")
    for row in rows:
        if row["tokens"] == larger[0]:
            print(f"round {row['round']}: swept ms " + ", ".join(f"{t} {1e3 * s:.1f}" for t, s in row["swept_s"].items()))
        print(f"  {row['tokens']} tokens: measured {1e3 * row['measured_s']:.1f} ms; last segment "
              f"{1e3 * row['segment_s']:.1f} ({row['segment_error']:+.1%}); through the origin "
              f"{1e3 * row['origin_s']:.1f} ({row['origin_error']:+.1%})")
    return rows


if __name__ == "__main__":
    main()
