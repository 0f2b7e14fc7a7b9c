"""`off` against `aware`, and against the `aware` of another version of `fastgrpo/speculation/policy.py`, at one
fixed concurrency, as `bench rollout` times it: per run a fresh `aware` of each version (bench rollout keeps
one across its repetitions), a warm-up call and `--reps` timed calls, the modes rotated call by call;
medians of tokens a second over all timed calls, and each version's share of speculative steps. Compares two
codes of the policy on the same engine, machine and minute, which two runs of `bench rollout` cannot (its
figures move by tens of percent between runs on a shared CPU).

    git show HEAD~1:fastgrpo/speculation/policy.py > /tmp/old_policy.py
    python tools/aware_ab.py --running 4 --tokens 128 --runs 3 --reps 3 --against /tmp/old_policy.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
from pathlib import Path

from fastgrpo.bench.guarantee import fixed_concurrency
from fastgrpo.bench.rollout import timed_generate
from fastgrpo.config import load_config
from fastgrpo.device import thread_count
from fastgrpo.engines.embedded.build import build_engine, draft_acceptance, draft_dir, speculation_policy
from fastgrpo.models.policy import load_policy
from fastgrpo.models.tokenizer import load_text_format
from fastgrpo.tasks.source import held_out_prompt_ids


def policy_module(path: Path):
    """A policy.py of another version, loaded as a module of its own (it imports the rest of fastgrpo as
    this checkout has it)."""
    spec = importlib.util.spec_from_file_location("other_policy", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--against {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny_cpu_plain.yaml")
    ap.add_argument("--running", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128, help="tokens a row (bench rollout: 128)")
    ap.add_argument("--runs", type=int, default=3, help="fresh policies per run")
    ap.add_argument("--reps", type=int, default=3, help="timed calls per mode and run, after a warm-up call")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--against", type=Path, help="another version's fastgrpo/speculation/policy.py")
    args = ap.parse_args(argv)
    other = policy_module(args.against) if args.against else None
    cfg = load_config(args.config or None, [])
    policy, text = load_policy(cfg.model.path), load_text_format(cfg.model.path, cfg.task)
    prompts = held_out_prompt_ids(cfg.task, text, cfg.model.max_context)
    requests, sampling = fixed_concurrency(cfg, prompts, args.running, args.tokens)
    names = ["off", "aware"] + ["other"] * (other is not None)
    tok_s: dict[str, list[float]] = {m: [] for m in names}
    speculative: dict[str, list[float]] = {m: [] for m in names[1:]}
    with thread_count(args.threads):
        engine = build_engine(cfg, policy.config, text, policy.state_dict().items(), speculation="aware")
        off = speculation_policy(engine, cfg, "off")
        for run in range(args.runs):
            aware = speculation_policy(engine, cfg, "aware")
            modes = {"off": off, "aware": aware}
            if other is not None:
                modes["other"] = other.Aware(aware.costs, acceptance_prior=draft_acceptance(draft_dir(cfg)))
            for rep in range(args.reps + 1):  # rep 0 warms up
                k = (rep + run) % len(names)
                for mode in names[k:] + names[:k]:
                    engine.set_speculation(modes[mode])
                    r = timed_generate(engine, requests, sampling, seed=1000 * rep + args.running + 7 * run)
                    if rep:
                        tok_s[mode].append(r["tok_s"])
                        if mode != "off":
                            speculative[mode].append(r["spec_fraction"])
            print(f"run {run}: " + ", ".join(f"{m} {statistics.median(v[-args.reps:]):.0f} tok/s" for m, v in tok_s.items())
                  + " | speculative steps " + ", ".join(f"{m} {statistics.mean(v[-args.reps:]):.0%}"
                                                        for m, v in speculative.items()), flush=True)
    median = {m: statistics.median(v) for m, v in tok_s.items()}
    out = {"running": args.running, "tokens": args.tokens, "against": str(args.against) if args.against else None,
           "median_tok_s": median, "over_off": {m: median[m] / median["off"] for m in names[1:]},
           "tok_s": tok_s, "speculative": speculative}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
