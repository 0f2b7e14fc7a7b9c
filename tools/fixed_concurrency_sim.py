"""SIMULATED: `aware` at fixed concurrency against plain decoding and the best static tree, per GPU and model.

    python tools/fixed_concurrency_sim.py [--beta 1.3] [--levels 1,4,16,64,128] [--tokens 512]

`bench simulate`'s fixed-concurrency table alone (`gpu_fixed_concurrency`: B sequences kept running for
`tokens` each, EOS ignored, 256-token prompts, every policy fresh after one warm-up run, the static trees of
the GPU tables, `fixed_seeds` runs a cell), without its hour of CPU validation: the cited EAGLE-3 acceptance
with the width gain `beta` (the full run's fit is in bench/simulate.json, gpu_acceptance.beta). Prints, per
GPU, model and level, the mean seconds' `aware` / `off`, the best static tree / `off`, and `aware` / the best
static tree with the standard error of the per-run ratios (the issue's target: >= 0.97x)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> list[dict]:
    from fastgrpo.bench.simulate.acceptance import eagle_profile
    from fastgrpo.bench.simulate.gpu import gpu_fixed_concurrency
    from fastgrpo.bench.simulate.workload import longtail_case

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--beta", type=float, default=1.3, help="the width gain of a tree over a chain")
    p.add_argument("--levels", default="1,4,16,64,128", help="running sequences, comma-separated")
    p.add_argument("--tokens", type=int, default=512, help="tokens each sequence generates")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]
    rows = gpu_fixed_concurrency(eagle_profile(args.beta), levels, args.tokens, longtail_case(False)["prompt_len"],
                                 args.seed)
    print("| GPU | model | running | runs | aware / off | best static / off | aware / best static (SE) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['hardware']} | {r['model']} | {r['running']} | {r['seeds']} | {r['off_s'] / r['aware_s']:.2f}x | "
              f"{r['off_s'] / r['static_best_s']:.2f}x ({r['static_best']}) | {r['aware_over_best_static']:.3f}x "
              f"({r['aware_over_best_static_se']:.3f}) |", flush=True)
    print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()
