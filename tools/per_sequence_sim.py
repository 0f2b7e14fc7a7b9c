"""SIMULATED: what `aware_per_sequence` gains over `aware`, and how much of it is the simulator's.

    python tools/per_sequence_sim.py [--seeds 4] [--full] [--hardware h100]
                                     [--model configs/models/llama-3.1-8b-instruct.json]

The quick long-tail workload (`bench simulate`'s, 16 prompts x 8, at most 128 running: all start at once and
run down; `--full`: the target case's 64 x 8, which keeps 128 running for most of the rollout) on the roofline
of one GPU and model, per seed (workload and draws), the second of two rollouts (the first is the
learning policies' warm-up), for four policies:

- `aware`;
- `aware` with a budget that keeps every node: the same choices, but the simulator then draws accepted
  lengths from the draft confidences of the verified nodes (`DraftConfidence`), as it does for any budget,
  instead of from the acceptance profile; the difference from `aware` is the simulator's, not a policy's;
- `aware_per_sequence`, a ragged verify (the eager engine's);
- `aware_per_sequence` at a static engine's widths (`simulate(static_widths=True)`: CUDA graphs).

Prints each policy's seconds per seed, their means, `aware`'s mean over each, and the mean seconds spent at
65-128 running (where a verify of 128 rows' trees is compute-bound, and a ragged verify's cuts save most)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> dict:
    import numpy as np
    import torch

    from fastgrpo.bench.simulate import simulate
    from fastgrpo.bench.simulate.acceptance import eagle_profile
    from fastgrpo.bench.simulate.gpu import GPU_MAX_BATCH, time_by_bucket
    from fastgrpo.bench.simulate.shape import GPU_BETA, load_model_shape
    from fastgrpo.bench.simulate.workload import longtail_case, longtail_of
    from fastgrpo.speculation.per_sequence import AwarePerSequence
    from fastgrpo.speculation.policy import Aware
    from fastgrpo.speculation.roofline import ACCELERATORS, Roofline, simulated_cost_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--hardware", choices=sorted(ACCELERATORS), default="h100")
    p.add_argument("--model", default=str(ROOT / "configs/models/llama-3.1-8b-instruct.json"))
    p.add_argument("--full", action="store_true", help="the target case's workload (64 x 8), not the quick one")
    args = p.parse_args(argv)

    class KeepEveryNode(Aware):
        """`aware` with a per-sequence budget that verifies every drafted node."""

        def select(self, scores, depth, config, running, widths=None):
            return torch.ones_like(scores, dtype=torch.bool)

    costs = Roofline(ACCELERATORS[args.hardware], load_model_shape(args.model, tp=1))
    policies = {"aware": (Aware, False), "aware, every node kept": (KeepEveryNode, False),
                "aware_per_sequence, ragged": (AwarePerSequence, False),
                "aware_per_sequence, static widths": (AwarePerSequence, True)}
    seconds: dict[str, list[float]] = {name: [] for name in policies}
    busy: dict[str, list[float]] = {name: [] for name in policies}  # seconds at 65-128 running
    for seed in range(args.seeds):
        workload = longtail_of(longtail_case(not args.full), seed)
        for name, (kind, static) in policies.items():
            policy, rng = kind(simulated_cost_model(costs)), np.random.default_rng(seed)
            runs = [simulate(workload, costs, eagle_profile(GPU_BETA), policy, GPU_MAX_BATCH, rng,
                             static_widths=static) for _ in range(2)]
            seconds[name].append(runs[-1].seconds)
            busy[name].append(time_by_bucket(runs[-1])["65-128"])
    aware = statistics.mean(seconds["aware"])
    size = "full" if args.full else "quick"
    print(f"SIMULATED {costs.name}, {size} long tail, {args.seeds} seeds (seconds a rollout):")
    for name, s in seconds.items():
        mean = statistics.mean(s)
        print(f"  {name:36s} {' '.join(f'{x:6.1f}' for x in s)}   mean {mean:6.2f}   aware / it {aware / mean:.3f}x"
              f"   at 65-128 running {statistics.mean(busy[name]):6.2f}")
    out = {"case": costs.name, "full": args.full, "seeds": args.seeds, "seconds": seconds, "at_65_128_s": busy}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
