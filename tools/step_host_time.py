"""The embedded engine's host work per decode step, beside the step function: what a static step costs
the host outside the step itself (reading its results back, appending tokens, stop checks, retiring
rows, choosing the next step), which on a GPU is paid on top of a graph replay.

    python tools/step_host_time.py [--running 16,256] [--tokens 48] [--reps 5]

A tiny model on this CPU, plain static steps, EOS ignored: every call runs `tokens` - 1 decode steps of
all `running` sequences. Host work = the call's seconds less its step functions' and its prefill's;
reported per step and per running row, the median of `reps` calls (one thread)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def host_seconds(running: int, tokens: int, reps: int) -> dict:
    import torch

    from fastgrpo.engines.embedded.engine import EmbeddedEngine
    from fastgrpo.models.policy import new_policy, policy_config
    from fastgrpo.types import Request, SamplingParams

    cfg = policy_config("test", 61, 128, bos_id=1, eos_id=2, pad_id=0)
    engine = EmbeddedEngine(cfg, running, 128, eos_id=2, pad_id=0, static_steps=True)
    engine.update_weights(new_policy(cfg, seed=1).eval().state_dict().items(), version=0)
    g = torch.Generator().manual_seed(0)
    requests = [Request(torch.randint(3, 61, (8,), generator=g).tolist(), max_new_tokens=tokens) for _ in range(running)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=tokens, ignore_eos=True)
    engine.generate(requests, sampling, seed=1)  # warm-up
    run, in_steps = engine.graphs.run, [0.0]

    def timed(key, step):
        t = time.perf_counter()
        out = run(key, step)
        in_steps[0] += time.perf_counter() - t
        return out

    engine.graphs.run = timed
    per_step = []
    for rep in range(reps):
        in_steps[0] = 0.0
        t = time.perf_counter()
        engine.generate(requests, sampling, seed=2 + rep)
        seconds = time.perf_counter() - t
        steps = engine.stats()["decode_steps"]
        per_step.append((seconds - in_steps[0] - engine.stats()["prefill_s"]) / steps)
    host = statistics.median(per_step)
    return {"running": running, "host_ms_per_step": 1e3 * host, "host_us_per_row": 1e6 * host / running}


def main(argv: list[str] | None = None) -> list[dict]:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--running", default="16,256")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = [host_seconds(int(n), args.tokens, args.reps) for n in args.running.split(",")]
    for r in rows:
        print(f"running {r['running']:4d}: host work {r['host_ms_per_step']:.3f} ms a step, "
              f"{r['host_us_per_row']:.2f} us a row", flush=True)
    print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()
