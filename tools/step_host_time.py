"""The embedded engine's host work per decode step, beside the step function: what a static step costs
the host outside the step itself (reading its results back, appending tokens, stop checks, retiring
rows, choosing the next step), which on a GPU is paid on top of a graph replay.

    python tools/step_host_time.py [--running 16,256] [--tokens 48] [--reps 5] [--merged]

A tiny model on this CPU, plain static steps, EOS ignored: every call runs `tokens` - 1 decode steps of
all `running` sequences. Host work = the call's seconds less its step functions' and its prefill's;
reported per step and per running row, the median of `reps` calls (one thread).

`--merged`: hybrid d4k4n12 steps instead (the learned draft's step function, the host's merge, the
verify step; a random draft, and the same prompts each call, so the index drafts from the earlier
calls' answers), and the host work between a step's two step functions in its two parts: while the
draft's step computes on a GPU (it is launched first: the index's lookups, observing the last verify),
and between its read-back and the verify's launch, when a GPU waits (reading the draft's tree, the
merge, writing the tree into the verify's input).

`--cut`: `aware_per_sequence`'s static steps instead (learned d4k4n12 trees, a random draft, a per-sequence
budget that prices a verified token at 1/256 of a forward, so that it cuts; the share it verified is
printed): the draft's step function is read back at once, so the host work that counts is between that
read-back and the verify's launch, when a GPU waits (the budget's choice, the cut trees, writing them into
the verify's input). It also times the budget's choice alone, in the step and replayed warm (`select_seconds`)."""

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


def split_host_seconds(running: int, tokens: int, reps: int, cut: bool = False) -> dict:
    """The host work of a step of two step functions (`--merged`: hybrid trees; `cut`: a per-sequence budget),
    split at the draft's read-back: while the draft's step computes, and before the verify's launch."""
    import torch

    from fastgrpo.engines.embedded.engine import EmbeddedEngine
    from fastgrpo.models.draft import DraftHead
    from fastgrpo.models.policy import new_policy, policy_config
    from fastgrpo.speculation.cost_model import CostModel
    from fastgrpo.speculation.per_sequence import AwarePerSequence
    from fastgrpo.speculation.policy import Static
    from fastgrpo.speculation.spec import SpecConfig
    from fastgrpo.types import Request, SamplingParams

    shape = SpecConfig(4, 4, 12)

    class Budget(AwarePerSequence):
        """The per-sequence budget on the fixed shape (a random draft would make `aware` decode plainly)."""

        def choose(self, running: int, context: float | None = None) -> SpecConfig:
            return shape

    grid = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
    # a verified token priced at 1/256 of a forward's fixed cost, in prices far above this CPU's seconds (its
    # measured steps barely move them): the budget cuts as where verifying is dear
    policy = Budget(CostModel({t: 1e4 * (1 + t / 256) for t in grid}, {t: 1e3 for t in grid}), margin=0.0) if cut \
        else Static(shape)
    cfg = policy_config("test", 61, 128, bos_id=1, eos_id=2, pad_id=0)
    engine = EmbeddedEngine(cfg, running, 128, eos_id=2, pad_id=0, static_steps=True, policy=policy)
    engine.update_weights(new_policy(cfg, seed=1).eval().state_dict().items(), version=0)
    engine.update_draft(DraftHead(cfg, 128 + 256).state_dict().items(), version=0)
    if not cut:
        engine.set_drafts("hybrid")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 61, (8,), generator=g).tolist() for _ in range(max(1, running // 8))]
    requests = [Request(prompts[i % len(prompts)], max_new_tokens=tokens) for i in range(running)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=tokens, ignore_eos=True)
    engine.generate(requests, sampling, seed=1)  # warm-up, and the index's first answers
    run, read_back, marks = engine.graphs.run, engine._read_back, []

    def timed_run(key, step):
        out = run(key, step)
        marks.append((key[0] if isinstance(key[0], str) else "step", time.perf_counter()))
        return out

    def timed_read_back(packed, meanwhile=None):
        marks.append(("read", time.perf_counter()))
        out = read_back(packed, meanwhile)
        marks.append(("read_done", time.perf_counter()))
        return out

    engine.graphs.run, engine._read_back = timed_run, timed_read_back
    overlapped, waited = [], []
    for rep in range(reps):
        marks.clear()
        original_verify = engine.steps.verify

        def verify(*args, **kwargs):
            marks.append(("verify_launch", time.perf_counter()))
            return original_verify(*args, **kwargs)

        engine.steps.verify = verify
        engine.generate(requests, sampling, seed=2 + rep)
        engine.steps.verify = original_verify
        steps = sum(1 for name, _ in marks if name == "draft")
        # per merged step: draft launched -> its read-back starts (overlapped); its read-back done -> verify launched
        o = w = 0.0
        for i, (name, t) in enumerate(marks):
            if name == "draft":
                o += marks[i + 1][1] - t  # the read-back of the draft's tree follows
                w += next(u for n, u in marks[i + 2:] if n == "verify_launch") - marks[i + 2][1]
        overlapped.append(o / steps)
        waited.append(w / steps)
    o, w = statistics.median(overlapped), statistics.median(waited)
    out = {"running": running, "overlapped_ms_per_step": 1e3 * o, "overlapped_us_per_row": 1e6 * o / running,
           "waited_ms_per_step": 1e3 * w, "waited_us_per_row": 1e6 * w / running,
           "index_accepted": engine.stats()["index_accepted"]}
    if cut:  # how much the budget cut: verified nodes of those drafted
        out["verified_share"] = policy.verified_nodes / max(policy.offered_nodes, 1)
        out |= select_seconds(policy, engine, requests, sampling, reps)
    return out


def select_seconds(policy, engine, requests, sampling, reps: int) -> dict:
    """The budget's choice (`select`) in the step, where the host runs it right after the CPU's own forward
    (cold caches), and the last step's call replayed 200 times in a row (warm): a GPU's host waits for the
    draft's step with its caches as it left them, nearer the second."""
    import torch

    select, in_step, last = policy.select, [], []

    def timed(*args, **kwargs):
        t = time.perf_counter()
        out = select(*args, **kwargs)
        in_step.append(time.perf_counter() - t)
        last[:] = [tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args), kwargs]
        return out

    policy.select = timed
    engine.generate(requests, sampling, seed=2 + reps)
    policy.select = select
    args, kwargs = last
    t = time.perf_counter()
    for _ in range(200):
        select(*args, **kwargs)
    warm = (time.perf_counter() - t) / 200
    return {"select_in_step_ms": 1e3 * statistics.median(in_step), "select_warm_ms": 1e3 * warm}


def main(argv: list[str] | None = None) -> list[dict]:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--running", default="16,256")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--merged", action="store_true", help="hybrid steps: the host work between their step functions")
    p.add_argument("--cut", action="store_true",
                   help="aware_per_sequence's static steps: the host work between their step functions")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.merged or args.cut:
        rows = [split_host_seconds(int(n), args.tokens, args.reps, cut=args.cut) for n in args.running.split(",")]
        for r in rows:
            print(f"running {r['running']:4d}: while the draft's step computes {r['overlapped_ms_per_step']:.3f} ms a "
                  f"step ({r['overlapped_us_per_row']:.2f} us a row); between its read-back and the verify "
                  f"{r['waited_ms_per_step']:.3f} ms ({r['waited_us_per_row']:.2f} us a row)"
                  + (f"; {r['verified_share']:.0%} of the drafted nodes verified; the choice "
                     f"{r['select_in_step_ms']:.3f} ms in the step, {r['select_warm_ms']:.3f} ms replayed warm"
                     if args.cut else ""), flush=True)
        print(json.dumps(rows))
        return rows
    rows = [host_seconds(int(n), args.tokens, args.reps) for n in args.running.split(",")]
    for r in rows:
        print(f"running {r['running']:4d}: host work {r['host_ms_per_step']:.3f} ms a step, "
              f"{r['host_us_per_row']:.2f} us a row", flush=True)
    print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()
