"""Does an engine speculating with `aware` pay for it in the steps it decodes plainly?

`fastgrpo bench guarantee` accounts aware's plain steps against off's median step at the same running
count across whole workloads; this checks the question directly: one engine, one workload of N running
sequences that never speculates (aware declines at that batch on this CPU), rolled out alternately with
`off` and with `aware` (and `aware` with the draft's deferred states not kept), and each call's median
plain-step seconds at N running compared, paired over repetitions.

    python tools/plain_step_ab.py --config configs/tiny_cpu_plain.yaml --running 16 --threads 2

With --grpo it takes `bench guarantee --quick`'s GRPO batch instead, in the bench's ABBA blocks, where
`aware` does speculate in part: aware's plain steps over off's median step at the same running count (the
bench's `step_accounting`), and over off's steps at the same running count and context (a line in the
cached tokens fitted to off's steps at each running count), so that a difference of context between the
modes cannot pass for a cost of aware's plain steps.

    python tools/plain_step_ab.py --config configs/tiny_cpu_plain.yaml --grpo --threads 1 --repetitions 6
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch

from fastgrpo.config import load_config
from fastgrpo.engines.embedded.pending import PendingStates
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
    ap.add_argument("--grpo", action="store_true", help="bench guarantee's quick GRPO batch instead of --running")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, [])
    policy, text = load_policy(cfg.model.path), load_text_format(cfg.model.path, cfg.task)
    torch.set_num_threads(args.threads)
    engine = build_engine(cfg, policy.config, text, policy.state_dict().items(), speculation="aware")
    policies = {"off": speculation_policy(engine, cfg, "off"), "aware": engine.policy}
    if args.grpo:
        return grpo_batch(engine, cfg, text, policies, args.repetitions, args.threads)
    requests = [Request(list(range(5, 40)), max_new_tokens=args.tokens) for _ in range(args.running)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.tokens, ignore_eos=True)
    keep = PendingStates.defer
    modes = ["off", "aware", "aware, states not kept"]
    steps: dict[str, list[float]] = {m: [] for m in modes}
    speculative: dict[str, int] = {m: 0 for m in modes}
    try:
        for rep in range(args.repetitions + 1):  # repetition 0 warms up
            for mode in modes if rep % 2 == 0 else modes[::-1]:
                engine.set_speculation(policies[mode.split(",")[0]])
                PendingStates.defer = (lambda self, hidden, tokens: None) if "not kept" in mode else keep
                engine.generate(requests, sampling, seed=rep)
                trace = engine.stats()["trace"]
                if rep:
                    steps[mode].append(statistics.median(s for r, c, _, s in trace if c == "off" and r == args.running))
                    speculative[mode] += sum(c != "off" for _, c, _, _ in trace)
    finally:
        PendingStates.defer = keep
    print(f"plain steps at {args.running} running, {args.threads} thread(s), median per call (ms), "
          f"{args.repetitions} alternations:")
    for mode in modes:
        ratios = [a / b for a, b in zip(steps[mode], steps["off"])]
        print(f"  {mode}: {[round(1e3 * s, 3) for s in steps[mode]]} -> {1e3 * statistics.median(steps[mode]):.3f}; "
              f"/ off {statistics.median(ratios):.3f}x; speculative steps {speculative[mode]}")
    return 0


def grpo_batch(engine, cfg, text, policies: dict, repetitions: int, threads: int) -> int:
    """--grpo: aware's plain steps against off's, by running count and by running count and context."""
    from fastgrpo.bench.guarantee import abba_block, step_accounting, workloads
    from fastgrpo.tasks.source import held_out_prompt_ids

    prompts = held_out_prompt_ids(cfg.task, text, cfg.model.max_context)
    requests, sampling = next(load for name, load in workloads(cfg, prompts, True).items() if name.startswith("GRPO"))
    contexts: list[int] = []  # each step's cached tokens over its running rows, beside the engine's trace
    count_step = type(engine)._count_step

    def counted(self, config, running, emitted, seconds):
        contexts.append(int(self.cache.lengths[:running].sum()))
        count_step(self, config, running, emitted, seconds)

    steps: dict[str, list[tuple]] = {"off": [], "aware": []}  # (running, config, emitted, seconds, context)
    type(engine)._count_step = counted
    try:
        for rep in range(repetitions + 1):  # block 0 warms up
            for mode, seed in abba_block(list(policies), rep, len(requests)):
                engine.set_speculation(policies[mode])
                contexts.clear()
                engine.generate(requests, sampling, seed=seed)
                if rep:
                    steps[mode] += [(*step, x) for step, x in zip(engine.stats()["trace"], contexts, strict=True)]
    finally:
        type(engine)._count_step = count_step
    by_running = step_accounting([s[:4] for s in steps["aware"]], [s[:4] for s in steps["off"]])["plain_step_vs_off"]
    lines = {}  # per running count: off's seconds as a + b * context (least squares; one context: their median)
    for running in {s[0] for s in steps["off"]}:
        xs = np.array([s[4] for s in steps["off"] if s[0] == running], dtype=np.float64)
        ys = np.array([s[3] for s in steps["off"] if s[0] == running])
        b, a = np.polyfit(xs, ys, 1) if len(xs) > 2 and xs.std() > 0 else (0.0, float(np.median(ys)))
        lines[running] = (a, b)

    def off_at(running: int, context: int) -> float:
        a, b = lines[running] if running in lines else lines[min(lines, key=lambda r: abs(r - running))]
        return a + b * context

    plain = [s for s in steps["aware"] if s[1] == "off"]
    by_context = sum(s[3] for s in plain) / sum(off_at(s[0], s[4]) for s in plain)
    print(f"GRPO batch ({len(requests)} rows), {threads} thread(s), {repetitions} ABBA blocks: aware {len(steps['aware'])} "
          f"steps, {len(plain)} plain; off {len(steps['off'])} steps")
    print(f"  aware's plain steps / off's: {by_running:.3f}x at the same running count (bench guarantee's accounting), "
          f"{by_context:.3f}x at the same running count and context")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
