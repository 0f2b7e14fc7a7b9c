"""`fastgrpo bench engines`: one GRPO batch's rollout in a world of two policy ranks, sampled by one
engine or by two.

A TP2 world (`parallel.tensor=2`, one thread per rank as `make train-distributed` runs it) used to
roll out on one engine, on the replica's leading rank, while the other rank waited; engines now
tile every policy rank (`engine.tensor`). Three modes on the same batch, interleaved, in one world of
two spawned processes:
- `one engine`: rank 0 samples every prompt on one thread, rank 1 waits (the old layout);
- `one engine, 2 threads`: rank 0 samples every prompt on both cores (the machine's whole CPU on one
  engine: what a single process could do);
- `two engines`: each rank samples half the prompts on its own thread (the layout now).
A mode's time is from a barrier before to the last rank's end. Requests are keyed by their place in
the batch, so every mode must return the same tokens, which is checked. Speculation is off: this
measures the engines' layout, not speculation (`bench rollout` does that).
"""

from __future__ import annotations

import datetime
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fastgrpo.bench.report import command_line, publish
from fastgrpo.config import Config
from fastgrpo.local_world import run_world

MODES = ("one engine", "one engine, 2 threads", "two engines")


def _rank(rank: int, world: int, cfg: Config, repetitions: int) -> dict:
    import torch.distributed as dist
    from transformers import AutoConfig

    from fastgrpo.engines import build_engine
    from fastgrpo.models.policy import load_policy
    from fastgrpo.models.tokenizer import load_text_format
    from fastgrpo.tasks.source import PromptSource, encode_problems, load_task
    from fastgrpo.topology import EngineMap
    from fastgrpo.types import Request, SamplingParams

    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    text = load_text_format(cfg.model.path, cfg.task)
    engine = build_engine(cfg, AutoConfig.from_pretrained(cfg.model.path), text,
                          weights=load_policy(cfg.model.path).state_dict().items(), speculation="off")
    train, _ = load_task(cfg.task, cfg.eval.split)
    problems = PromptSource(encode_problems(train, text, cfg.model.max_context, "train"), cfg.seed).next_batch(
        cfg.rollout.prompts_per_step)
    G, sampling = cfg.rollout.group_size, SamplingParams.of(cfg.rollout)
    requests = [Request(p.prompt_ids, key=i * G + j) for i, p in enumerate(problems) for j in range(G)]

    def once(mode: str) -> tuple[float, list[list[int]]]:
        engines = EngineMap(world, 1) if mode == "two engines" else EngineMap(1, 1)
        mine: list = []
        if rank < engines.policy_ranks:
            start, stop = engines.bounds(len(problems), rank)
            mine = requests[start * G: stop * G]
        torch.set_num_threads(2 if mode == "one engine, 2 threads" else 1)
        dist.barrier()
        t0 = time.perf_counter()
        tokens = [c.token_ids for c in engine.generate(mine, sampling, seed=cfg.seed)] if mine else []
        seconds = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the batch is done when its last engine is
        parts: list = [None] * world
        dist.all_gather_object(parts, tokens)
        return float(seconds), [t for part in parts for t in part]

    once("two engines")  # warm-up: allocations, first-call costs
    times: dict[str, list[float]] = {m: [] for m in MODES}
    tokens: dict[str, list[list[int]]] = {}
    for r in range(repetitions):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):  # interleaved, alternating order
            seconds, tokens[mode] = once(mode)
            times[mode].append(seconds)
    same = all(tokens[m] == tokens[MODES[0]] for m in MODES)
    generated = sum(len(t) for t in tokens[MODES[0]])
    dist.destroy_process_group()
    return {"times": times, "same_tokens": same, "tokens": generated, "sequences": len(requests)}


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(xs), "mean_s": statistics.mean(xs),
            "se_s": statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else 0.0}


def bench_engines(cfg: Config, quick: bool, output: Path, extra: list[str] | None = None) -> dict:
    repetitions = 3 if quick else 8
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        result = run_world(_rank, 2, Path(tmp), cfg, repetitions, timeout_s=3600.0)[0]
    if not result["same_tokens"]:
        raise RuntimeError("the modes returned different tokens for the same keyed requests")
    modes = {m: _stats(xs) | {"runs": xs} for m, xs in result["times"].items()}
    base = modes["one engine"]
    for m in modes.values():
        ratio = base["median_s"] / m["median_s"]
        m["speedup_vs_one_engine"] = ratio
        # the ratio's standard error from the two modes' relative standard errors (delta method)
        m["speedup_se"] = ratio * ((base["se_s"] / base["mean_s"]) ** 2 + (m["se_s"] / m["mean_s"]) ** 2) ** 0.5
        m["tokens_per_s"] = result["tokens"] / m["median_s"]
    out = {"meta": {"date": datetime.date.today().isoformat(), "machine": f"{torch.get_num_threads()} threads, CPU",
                    "policy": cfg.model.path, "sequences": result["sequences"], "tokens": result["tokens"],
                    "repetitions": repetitions, "seconds": time.perf_counter() - t0},
           "modes": modes}
    publish(out, output, command_line("engines", quick, output, extra), markdown)
    return out


def markdown(r: dict, command: str) -> str:
    m = r["meta"]
    lines = [f"`{command}` ({m['date']}; {m['machine']}; {m['sequences']} sequences, {m['tokens']} tokens, the same "
             f"in every mode; {m['repetitions']} interleaved runs each)", "",
             "| mode | median s | ± SE | tokens/s | vs one engine (± SE) |", "| --- | ---: | ---: | ---: | ---: |"]
    for name, s in r["modes"].items():
        lines.append(f"| {name} | {s['median_s']:.2f} | {s['se_s']:.2f} | {s['tokens_per_s']:.0f} | "
                     f"{s['speedup_vs_one_engine']:.2f}x ± {s['speedup_se']:.2f} |")
    return "\n".join(lines) + "\n"


# -- `fastgrpo bench engines`: its sub-parser (fastgrpo/bench/command.py) --
def add_arguments(parser) -> None:
    """`fastgrpo bench engines`'s own flags (--quick, --output, --config and overrides are every benchmark's)."""
    parser.set_defaults(needs="policy")  # no speculation: no draft
    parser.set_defaults(run=from_cli)


def from_cli(args, cfg) -> dict:
    return bench_engines(cfg, args.quick, args.output, extra=args.extra)
