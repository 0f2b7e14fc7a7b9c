"""Does an engine speculating with `aware` pay for it in the steps it decodes plainly?

`fastgrpo bench guarantee` accounts aware's plain steps against off's median step at the same running
count across whole workloads; this checks the question directly: one engine, one workload of N running
sequences that never speculates (aware declines at that batch on this CPU), rolled out alternately with
`off` and with `aware` (and `aware` with the draft's deferred states not kept), and each call's median
plain-step seconds at N running compared, paired over repetitions.

    python tools/plain_step_ab.py --config configs/tiny_cpu_plain.yaml --running 16 --threads 2
"""

from __future__ import annotations

import argparse
import statistics

import torch

from fastgrpo.config import load_config
from fastgrpo.engines.embedded import engine as embedded
from fastgrpo.engines.embedded.build import build_engine, speculation_policy
from fastgrpo.models.policy import load_policy
from fastgrpo.models.tokenizer import load_text_format
from fastgrpo.types import Request, SamplingParams


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny_cpu_plain.yaml")
    ap.add_argument("--running", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repetitions", type=int, default=5)
    args = ap.parse_args(argv)
    cfg = load_config(args.config, [])
    policy, text = load_policy(cfg.model.path), load_text_format(cfg.model.path, cfg.task)
    torch.set_num_threads(args.threads)
    engine = build_engine(cfg, policy.config, text, policy.state_dict().items(), speculation="aware")
    policies = {"off": speculation_policy(engine, cfg, "off"), "aware": engine.policy}
    requests = [Request(list(range(5, 40)), max_new_tokens=args.tokens) for _ in range(args.running)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.tokens, ignore_eos=True)
    keep = embedded._PendingStates.defer
    modes = ["off", "aware", "aware, states not kept"]
    steps: dict[str, list[float]] = {m: [] for m in modes}
    speculative: dict[str, int] = {m: 0 for m in modes}
    try:
        for rep in range(args.repetitions + 1):  # repetition 0 warms up
            for mode in modes if rep % 2 == 0 else modes[::-1]:
                engine.set_speculation(policies[mode.split(",")[0]])
                embedded._PendingStates.defer = (lambda self, hidden, tokens: None) if "not kept" in mode else keep
                engine.generate(requests, sampling, seed=rep)
                trace = engine.stats()["trace"]
                if rep:
                    steps[mode].append(statistics.median(s for r, c, _, s in trace if c == "off" and r == args.running))
                    speculative[mode] += sum(c != "off" for _, c, _, _ in trace)
    finally:
        embedded._PendingStates.defer = keep
    print(f"plain steps at {args.running} running, {args.threads} thread(s), median per call (ms), "
          f"{args.repetitions} alternations:")
    for mode in modes:
        ratios = [a / b for a, b in zip(steps[mode], steps["off"])]
        print(f"  {mode}: {[round(1e3 * s, 3) for s in steps[mode]]} -> {1e3 * statistics.median(steps[mode]):.3f}; "
              f"/ off {statistics.median(ratios):.3f}x; speculative steps {speculative[mode]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
