"""One GRPO step's rollout as a config runs it (its prompts x group size, its sampling, its engine slots), timed
under `off`, two static trees and `aware`, interleaved: does speculation pay for this run on this machine?

Each repetition draws the next `rollout.prompts_per_step` held-out prompts and runs every mode on them, the
modes rotated from one repetition to the next; `aware` is one policy across the calls, as a run keeps it.
Repetition 0 warms up and is not counted. Prints each call, then per mode the median tokens a second, share
of speculative decode steps and accepted length over the timed calls, and for `aware` where its time went
against the `off` call on the same prompts (`bench guarantee`'s accounting: its plain steps over off's at the
same running count, and its speculative steps' seconds beyond the plain steps that would have emitted the same
tokens, as a share of its decode time). On a shared CPU two calls of one mode a minute apart can differ by 20%
(the plain steps at one running count), so the accounting, not the ratio of throughputs, says what `aware`'s
decisions cost or saved. That net time is split four ways: the speculative steps right after a plain one
(which first catch the draft up on the states the plain steps added) and the others, each at more than 16
running rows and at 16 or fewer.

    python tools/rollout_modes.py --config configs/tiny_cpu.yaml --reps 3
"""

from __future__ import annotations

import argparse
import json
import statistics

from fastgrpo.bench.guarantee import plain_step_seconds, step_accounting
from fastgrpo.bench.rollout import timed_generate
from fastgrpo.config import load_config
from fastgrpo.device import thread_count
from fastgrpo.engines.embedded.build import build_engine, speculation_policy
from fastgrpo.models.policy import load_policy
from fastgrpo.models.tokenizer import load_text_format
from fastgrpo.speculation.policy import Static
from fastgrpo.speculation.spec import SpecConfig
from fastgrpo.tasks.source import held_out_prompt_ids
from fastgrpo.types import Request, SamplingParams

TREES = (SpecConfig(2, 2, 4), SpecConfig(4, 4, 12))
SPLIT = ("after plain, > 16 rows", "after plain, <= 16 rows", "after a tree, > 16 rows", "after a tree, <= 16 rows")


def net_split(aware: list[tuple], off: list[tuple]) -> dict[str, float]:
    """Seconds aware's speculative steps took beyond the plain steps that would have emitted their tokens
    (off's median step at the same running count, or the nearest one off ran), by `SPLIT`; a call's first
    decode step counts as after plain. Traces: (running, config name, emitted, seconds) a step."""
    off_step = plain_step_seconds(off)
    out = dict.fromkeys(SPLIT, 0.0)
    previous = "off"
    for running, name, emitted, s in aware:
        if name != "off":
            out[SPLIT[2 * (previous != "off") + (running <= 16)]] += s - emitted / running * off_step(running)
        previous = name
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny_cpu.yaml", help="YAML config ('': the built-in defaults)")
    ap.add_argument("--reps", type=int, default=3, help="timed calls a mode, after a warm-up call")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    cfg = load_config(args.config or None, args.overrides)
    policy, text = load_policy(cfg.model.path), load_text_format(cfg.model.path, cfg.task)
    prompts = held_out_prompt_ids(cfg.task, text, cfg.model.max_context)
    P, G = cfg.rollout.prompts_per_step, cfg.rollout.group_size
    if len(prompts) < P * (args.reps + 1):
        ap.error(f"{len(prompts)} held-out prompts: too few for {args.reps + 1} calls of {P}")
    sampling = SamplingParams.of(cfg.rollout)
    calls: dict[str, list[dict]] = {}
    accounting: list[dict[str, float]] = []
    split: list[dict[str, float]] = []
    with thread_count(args.threads):
        engine = build_engine(cfg, policy.config, text, policy.state_dict().items(), speculation="aware")
        modes = {"off": speculation_policy(engine, cfg, "off"), **{c.name: Static(c) for c in TREES},
                 "aware": speculation_policy(engine, cfg, "aware")}
        names = list(modes)
        for rep in range(args.reps + 1):
            requests = [Request(p, key=i * G + j) for i, p in enumerate(prompts[P * rep:P * (rep + 1)])
                        for j in range(G)]
            k = rep % len(names)
            for mode in names[k:] + names[:k]:
                engine.set_speculation(modes[mode])
                r = timed_generate(engine, requests, sampling, seed=rep)
                print(f"call {rep}{' (warm-up)' if rep == 0 else ''} {mode}: {r['tok_s']:.0f} tok/s, "
                      f"{r['seconds']:.2f} s, speculative steps {r['spec_fraction']:.0%}, "
                      f"accepted length {r['accept_len']:.2f}", flush=True)
                if rep:
                    calls.setdefault(mode, []).append(r)
            if rep:
                accounting.append(step_accounting(calls["aware"][-1]["trace"], calls["off"][-1]["trace"]))
                split.append(net_split(calls["aware"][-1]["trace"], calls["off"][-1]["trace"]))
                print(f"call {rep} aware against off: {calls['aware'][-1]['tok_s'] / calls['off'][-1]['tok_s']:.3f}x, its plain "
                      f"steps {accounting[-1]['plain_step_vs_off']:.3f}x off's, its speculative steps' net time "
                      f"{accounting[-1]['spec_net_fraction']:+.1%} of its decode time", flush=True)
    summary = {m: {"tok_s": statistics.median(r["tok_s"] for r in rs),
                   "speculative": statistics.median(r["spec_fraction"] for r in rs),
                   "accept_len": statistics.median(r["accept_len"] for r in rs)} for m, rs in calls.items()}
    for m, s in summary.items():
        print(f"{m}: median {s['tok_s']:.0f} tok/s ({s['tok_s'] / summary['off']['tok_s']:.2f}x off), "
              f"speculative steps {s['speculative']:.0%}, accepted length {s['accept_len']:.2f}")
    net = [a["spec_net_fraction"] for a in accounting]
    print(f"aware's speculative steps' net time: median {statistics.median(net):+.1%} of its decode time "
          f"(calls {min(net):+.1%} .. {max(net):+.1%}; negative: speculation saved time); its seconds over the "
          f"timed calls: " + ", ".join(f"{k} {sum(c[k] for c in split):+.3f} s" for k in SPLIT))
    out = {"config": args.config, "reps": args.reps, "threads": args.threads, "modes": summary, "aware_accounting": accounting,
           "aware_net_split_s": split}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
