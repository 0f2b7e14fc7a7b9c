"""Where a fresh `aware` spends its calls on one of `bench guarantee`'s fixed-concurrency workloads.

`bench guarantee` says whether `aware` kept up with plain decoding; this says how, call by call: one
engine, a fresh `aware` (as each run of the bench starts), calls of N running sequences (EOS ignored,
the bench's seeds) alternating with `off`, and for each call both modes' throughput and aware's decode
steps by shape: how many, tokens emitted a row, median milliseconds, and tokens a row per millisecond,
which is what decides (plain decoding's is 1 / its step's ms). A shape whose rate is below plain
decoding's in the same call cost time. Speculation also unlocks the rows: each accepts its own number of
tokens a step, so some finish first and the last ones decode at fewer rows than the call started with
(the tail), where a step costs more a row; each call's tail (its steps below the starting concurrency and
their share of the decode time) is printed beside its shapes.

    python tools/aware_trace.py --config configs/tiny_cpu_plain.yaml --running 16 --tokens 96 --calls 6

Prints one line a mode and call; `--json` writes the rows too.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from fastgrpo.bench.guarantee import abba_block, fixed_concurrency
from fastgrpo.bench.rollout import timed_generate
from fastgrpo.config import load_config
from fastgrpo.device import thread_count
from fastgrpo.engines.embedded.build import build_engine, speculation_policy
from fastgrpo.models.policy import load_policy
from fastgrpo.models.tokenizer import load_text_format
from fastgrpo.tasks.source import held_out_prompt_ids


def shapes_of(trace: list[tuple]) -> dict[str, dict[str, float]]:
    """An engine trace's decode steps (running, shape name, emitted, seconds) by shape ("off": plain): steps,
    tokens a row, median ms, tokens a row per ms."""
    by: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for running, name, emitted, seconds in trace:
        by[name].append((emitted / running, seconds))
    out = {}
    for shape, steps in by.items():
        per_row = statistics.mean(e for e, _ in steps)
        ms = 1000 * statistics.median(s for _, s in steps)
        out[shape] = {"steps": len(steps), "tokens_a_row": per_row, "ms": ms, "rate": per_row / ms}
    return out


def tail_of(trace: list[tuple], running: int) -> dict[str, float]:
    """An engine trace's steps with fewer than `running` rows: how many, and their share of the decode seconds."""
    tail = [seconds for rows, _, _, seconds in trace if rows < running]
    total = sum(step[3] for step in trace)
    return {"steps": len(tail), "share": sum(tail) / total if total else 0.0}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny_cpu_plain.yaml", help="YAML config ('': the built-in defaults)")
    ap.add_argument("--running", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=96, help="tokens a row (bench guarantee: 96, 48 with --quick)")
    ap.add_argument("--calls", type=int, default=6, help="calls of each mode")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = ap.parse_args(argv)
    cfg = load_config(args.config or None, args.overrides)
    policy, text = load_policy(cfg.model.path), load_text_format(cfg.model.path, cfg.task)
    prompts = held_out_prompt_ids(cfg.task, text, cfg.model.max_context)
    requests, sampling = fixed_concurrency(cfg, prompts, args.running, args.tokens)
    rows = []
    with thread_count(args.threads):
        engine = build_engine(cfg, policy.config, text, policy.state_dict().items(), speculation="aware")
        modes = {"off": speculation_policy(engine, cfg, "off"), "aware": speculation_policy(engine, cfg, "aware")}
        for call in range(args.calls):
            for mode, seed in abba_block(list(modes), call, args.running)[:2]:  # the bench's order and seeds
                engine.set_speculation(modes[mode])
                r = timed_generate(engine, requests, sampling, seed=seed)
                row = {"call": call, "mode": mode, "tok_s": r["tok_s"], "shapes": shapes_of(r["trace"]),
                       "tail": tail_of(r["trace"], args.running)}
                rows.append(row)
                print(f"call {call} {mode:5s} {r['tok_s']:7.0f} tok/s | tail {row['tail']['steps']} steps, "
                      f"{100 * row['tail']['share']:.0f}% of decode | " + "; ".join(
                    f"{s}: {v['steps']} steps, {v['tokens_a_row']:.2f} tokens a row, {v['ms']:.1f} ms, "
                    f"{1000 * v['rate']:.1f} tokens a row a second" for s, v in row["shapes"].items()), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
