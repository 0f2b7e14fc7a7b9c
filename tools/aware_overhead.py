"""`aware`'s own host time per decode step (its choice and its update), against the step it decides on.

    python tools/aware_overhead.py [--model configs/models/llama-3.1-8b-instruct.json | --policy-size gpu]
                                   [--gpu h100] [--running 1,4,16,64,256] [--tokens 2048] [--alpha 0.7]
                                   [--beta 0.7] [--batch 64 --max-tokens 1024] [--against-fixed] [--no-ahead] [--known]

`--policy-size gpu` prices the GPU check's policy (fastgrpo's own `gpu` size, 308.6M parameters with its
task's 296-token vocabulary, `--vocab`), whose steps are the shortest `aware` decides on.

On a GPU a graph-replayed step of a small batch takes a millisecond or two, and whatever `aware` spends
choosing and learning is paid on top of it, where a fixed tree pays nothing: that share must stay well
under the 3% by which `aware` may trail the best fixed choice. This drives `Aware` as an engine would, on
the SIMULATED machine of `bench simulate` (the roofline's calibration and step times, `speculation/
roofline.py`, and its acceptance law: a level's first candidate right with chance `alpha`, a tree of w
candidates a level missing with chance (1 - alpha) w^-beta), at each level of running sequences, until
each row has emitted `--tokens` tokens after a 64-token prompt: contexts grow by what each step emits.
Every policy compared runs the same tokens, so their tokens/s are comparable: over a fixed count of
steps a policy emitting more tokens a step runs on to longer, dearer contexts, and a shallow tree held
fixed looked better than it is. Between a step's `choose` and its `observe` it calls `Aware.ahead`, as a
static engine does while the device runs the step: its host time is hidden up to the step's SIMULATED
seconds, and only what exceeds them is counted (`--no-ahead`: never called, as on an eager engine, whose
steps leave no wait to fill). It reports per level the median over 5 repetitions of the mean
microseconds of `choose`, `observe` and `ahead` per step (and of `ahead`'s not hidden), the choice it
settled on, how often its shape changed, and the share of that choice's SIMULATED step they add; with
`--against-fixed`, its SIMULATED tokens/s over the 5 runs (its host time included, and without it)
against the best of plain decoding and every candidate tree held fixed over the same 5 seeds
(`best_fixed`): without it, how well `aware` chooses; with it, what this host's Python adds. Timings
are this machine's host (a slow or busy one inflates them several times over); the step times are the
simulator's (its error against a real GPU is in BENCHMARKS.md section 10).

`--batch B` drives GRPO batches instead (5, one a seed), the workload where the running count changes
most: B rows start together, each ends at a length drawn uniformly from [max_tokens / 8, max_tokens], so
the rows retire one by one through the batch's long tail and `aware` meets every running count from B
down to 1 (each a new price to search). It reports the batch's mean host time a step, the searches it
ran, and their share of the batch's SIMULATED time."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def simulated_step(config, running: int, context: int, profile, roofline, rng) -> tuple[list[int] | None, int, float]:
    """One step of `config` (None: plain) on the SIMULATED machine: each row's accepted drafts (drawn
    from `profile`, `bench simulate`'s acceptance law), tokens emitted, and the step's seconds."""
    if config is None:
        return None, running, roofline.decode_step(running, context, context * running)
    accepted = profile.draw(config, running, rng).tolist()
    return accepted, sum(accepted) + running, roofline.spec_step(config, running, 1, context, context * running)


def overlapped(policy, ahead: bool, running: int, context: float, config, seconds: float) -> tuple[float, float]:
    """`policy.ahead` of a step (where it has one and `ahead`), as a static engine calls it while the device
    runs the step: its host seconds, and what of them the step's SIMULATED `seconds` do not hide."""
    if not ahead or (call := getattr(policy, "ahead", None)) is None:
        return 0.0, 0.0
    t = time.perf_counter()
    call(running, context, config)
    spent = time.perf_counter() - t
    return spent, max(spent - seconds, 0.0)


def drive(policy, roofline, profile, running: int, tokens_each: int, seed: int, prompt: int = 64,
          ahead: bool = True, known: bool = False) -> dict:
    """Decode steps of `running` sequences under `policy` until each has emitted `tokens_each` tokens
    after a `prompt`-token prompt; host seconds of its calls (of `ahead`'s, those the steps do not hide).
    `known`: the policy is told the rows' tokens left before each step, as an engine ignoring EOS tells it
    (every row the mean's: the rows here advance together), timed with `choose`."""
    rng = np.random.default_rng(seed)
    context, choose_s, observe_s, ahead_s, exposed_s, step_s, chosen = float(prompt), 0.0, 0.0, 0.0, 0.0, 0.0, None
    tokens = changes = steps = 0
    while context < prompt + tokens_each:
        t = time.perf_counter()
        if known and (tokens_left := getattr(policy, "tokens_left", None)) is not None:
            tokens_left([max(1, math.ceil(prompt + tokens_each - context))] * running)
        config = policy.choose(running, context)
        choose_s += time.perf_counter() - t
        accepted, emitted, seconds = simulated_step(config, running, int(context), profile, roofline, rng)
        spent, exposed = overlapped(policy, ahead, running, context, config, seconds)
        ahead_s, exposed_s = ahead_s + spent, exposed_s + exposed
        t = time.perf_counter()
        policy.observe(config, running, emitted, seconds, accepted)
        observe_s += time.perf_counter() - t
        step_s += seconds
        context += emitted / running
        tokens, changes, chosen = tokens + emitted, changes + (config != chosen), config
        steps += 1
    return {"choose_us": 1e6 * choose_s / steps, "observe_us": 1e6 * observe_s / steps,
            "ahead_us": 1e6 * ahead_s / steps, "exposed_us": 1e6 * exposed_s / steps, "step_ms": 1e3 * step_s / steps,
            "choice": chosen.name if chosen is not None else "plain", "changes": changes, "tokens": tokens,
            "seconds": step_s, "host_seconds": choose_s + observe_s + exposed_s}


def best_fixed(run, candidates, seeds: int = 5, finalists: int = 5) -> tuple[str, dict[str, float]]:
    """The best of `candidates` (None: plain decoding) held fixed, by SIMULATED tokens/s over the same
    `seeds` seeds `aware` runs (each seed draws other acceptances: one seed's luck moved a tree by several
    percent): every candidate on the first seed, the `finalists` best and plain decoding on every seed.
    `run(config, seed)` returns (tokens, seconds). Returns the best's name and every finalist's tokens/s."""
    name = {c: c.name if c else "plain" for c in candidates}
    first = {c: run(c, 0) for c in candidates}
    ranked = sorted(candidates, key=lambda c: first[c][0] / first[c][1], reverse=True)[:finalists]
    rates = {}
    for c in dict.fromkeys([*ranked, None]):
        done = [first[c], *(run(c, seed) for seed in range(1, seeds))]
        rates[name[c]] = sum(t for t, _ in done) / sum(s for _, s in done)
    return max(rates, key=rates.get), rates


def summed(runs: list[dict]) -> tuple[float, float]:
    """Tokens/s over `runs` (their tokens over their SIMULATED seconds), without and with aware's host time."""
    tokens, seconds = sum(r["tokens"] for r in runs), sum(r["seconds"] for r in runs)
    return tokens / seconds, tokens / (seconds + sum(r["host_seconds"] for r in runs))


def drive_batch(policy, roofline, profile, rows: int, max_tokens: int, seed: int, prompt: int = 64,
                ahead: bool = True) -> dict:
    """One batch of `rows` rows of drawn lengths (module doc) under `policy`: its host seconds a step."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(max(max_tokens // 8, 1), max_tokens, endpoint=True, size=rows).tolist()
    done = [0] * rows
    choose_s = observe_s = ahead_s = exposed_s = step_s = 0.0
    steps = searches = tokens = 0
    rates = getattr(policy, "_rates", None)  # (aware's; a fixed policy searches nothing)

    def counted(running):  # the searches: each prices every candidate tree
        nonlocal searches
        searches += 1
        return rates(running)

    if rates is not None:
        policy._rates = counted
    while live := [i for i in range(rows) if done[i] < lengths[i]]:
        running, context = len(live), prompt + max(done[i] for i in live)
        t = time.perf_counter()
        config = policy.choose(running, context)
        choose_s += time.perf_counter() - t
        accepted, emitted, seconds = simulated_step(config, running, context, profile, roofline, rng)
        spent, exposed = overlapped(policy, ahead, running, context, config, seconds)
        ahead_s, exposed_s = ahead_s + spent, exposed_s + exposed
        t = time.perf_counter()
        policy.observe(config, running, emitted, seconds, accepted)
        observe_s += time.perf_counter() - t
        for i, a in zip(live, accepted or [0] * running):
            done[i] += a + 1
        step_s += seconds
        steps, tokens = steps + 1, tokens + emitted
    return {"steps": steps, "searches": searches, "choose_us": 1e6 * choose_s / steps,
            "observe_us": 1e6 * observe_s / steps, "ahead_us": 1e6 * ahead_s / steps, "exposed_us": 1e6 * exposed_s / steps,
            "step_ms": 1e3 * step_s / steps, "tokens": tokens, "seconds": step_s, "host_seconds": choose_s + observe_s + exposed_s}


def main(argv: list[str] | None = None) -> dict:
    from fastgrpo.bench.simulate.acceptance import AcceptanceProfile
    from fastgrpo.speculation.policy import Aware, Off, Static, candidate_configs
    from fastgrpo.speculation.roofline import (ACCELERATORS, Roofline, load_model_shape, model_shape,
                                               simulated_cost_model)

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(ROOT / "configs" / "models" / "llama-3.1-8b-instruct.json"))
    p.add_argument("--policy-size", choices=("test", "bench", "gpu"), help="instead of --model: a policy of "
                   "fastgrpo's own size (models/policy.py)")
    p.add_argument("--vocab", type=int, default=296, help="with --policy-size: its vocabulary")
    p.add_argument("--gpu", choices=sorted(ACCELERATORS), default="h100")
    p.add_argument("--running", default="1,4,16,64,256")
    p.add_argument("--tokens", type=int, default=2048, help="each row's tokens after its prompt")
    p.add_argument("--alpha", type=float, default=0.7, help="the draft's first candidate's chance at each level")
    p.add_argument("--beta", type=float, default=0.7, help="what a tree's width adds (bench simulate's law)")
    p.add_argument("--batch", type=int, help="drive GRPO batches of this many rows (5 seeds) instead of fixed levels")
    p.add_argument("--max-tokens", type=int, default=1024, help="with --batch: the longest a row may run")
    p.add_argument("--against-fixed", action="store_true", help="also run plain decoding and every candidate "
                   "tree, fixed, over the same tokens and seeds (best_fixed): aware's SIMULATED tokens/s against "
                   "the best")
    p.add_argument("--known", action="store_true", help="tell aware the rows' tokens left before each step "
                   "(`Aware.tokens_left`, as an engine ignoring EOS does): the batch's time ranks its trees")
    p.add_argument("--no-ahead", action="store_true", help="never call aware's `ahead` (an eager engine's steps, "
                   "which have no wait on the device to overlap): every search in `choose`")
    args = p.parse_args(argv)
    if args.policy_size:
        from fastgrpo.models.policy import policy_config

        config = policy_config(args.policy_size, args.vocab, 512, bos_id=1, eos_id=2, pad_id=0).to_dict()
        shape = model_shape(config, name=f"policy-{args.policy_size}")
    else:
        shape = load_model_shape(args.model)
    roofline = Roofline(ACCELERATORS[args.gpu], shape)
    costs = simulated_cost_model(roofline)
    profile = AcceptanceProfile([args.alpha], args.beta)
    if args.batch:
        runs = [drive_batch(Aware(costs, acceptance_prior=args.alpha), roofline, profile, args.batch, args.max_tokens,
                            seed, ahead=not args.no_ahead) for seed in range(5)]
        row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        row["share_of_step"] = (row["choose_us"] + row["observe_us"] + row["exposed_us"]) / (1e3 * row["step_ms"])
        print(f"batch of {args.batch} rows, up to {args.max_tokens} tokens: {row['steps']:.0f} steps, "
              f"{row['searches']:.0f} searches; choose {row['choose_us']:.1f} us + observe {row['observe_us']:.1f} us "
              f"a step (ahead {row['ahead_us']:.1f} us, {row['exposed_us']:.1f} not hidden); SIMULATED step {row['step_ms']:.3f} ms: {100 * row['share_of_step']:.2f}%", flush=True)
        result = {"model": shape.name, "gpu": roofline.hw.name, "alpha": args.alpha, "beta": args.beta, "batch": args.batch,
                  "max_tokens": args.max_tokens, **row}
        if args.against_fixed:  # over the 5 batches: their tokens over their SIMULATED seconds (aware's host time too)
            aware_steps_tok_s, aware_tok_s = summed(runs)

            def run(c, seed):
                r = drive_batch(Off() if c is None else Static(c), roofline, profile, args.batch, args.max_tokens, seed)
                return r["tokens"], r["seconds"]

            best, fixed = best_fixed(run, [None, *candidate_configs()])
            result |= {"tok_s": aware_steps_tok_s, "tok_s_with_host": aware_tok_s, "best_fixed": best,
                       "best_fixed_tok_s": fixed[best], "plain_tok_s": fixed["plain"]}
            print(f"SIMULATED {aware_tok_s:.0f} tok/s with its host time against the best fixed {best}'s "
                  f"{fixed[best]:.0f}: {aware_tok_s / fixed[best]:.3f}x ({aware_steps_tok_s / fixed[best]:.3f}x without "
                  f"it; {aware_tok_s / fixed['plain']:.2f}x plain)", flush=True)
        print(json.dumps(result))
        return result
    rows = []
    for running in (int(x) for x in args.running.split(",")):
        runs = [drive(Aware(costs, acceptance_prior=args.alpha), roofline, profile, running, args.tokens, seed,
                      ahead=not args.no_ahead, known=args.known) for seed in range(5)]
        row = {"running": running, **{k: statistics.median(r[k] for r in runs)
                                       for k in ("choose_us", "observe_us", "ahead_us", "exposed_us", "step_ms", "changes")},
               "choice": statistics.mode(r["choice"] for r in runs)}
        row["tok_s"], row["tok_s_with_host"] = summed(runs)
        row["share_of_step"] = (row["choose_us"] + row["observe_us"] + row["exposed_us"]) / (1e3 * row["step_ms"])
        line = (f"running {running:4d}: choose {row['choose_us']:6.1f} us + observe {row['observe_us']:6.1f} us a step "
                f"(ahead {row['ahead_us']:6.1f} us, {row['exposed_us']:.1f} not hidden); "
                f"settled on {row['choice']:>9} ({row['changes']:.0f} changes of shape); SIMULATED step "
                f"{row['step_ms']:.3f} ms: {100 * row['share_of_step']:.2f}%")
        if args.against_fixed:
            def run(c, seed, running=running):
                r = drive(Off() if c is None else Static(c), roofline, profile, running, args.tokens, seed)
                return r["tokens"], r["seconds"]

            row["best_fixed"], fixed = best_fixed(run, [None, *candidate_configs()])
            row["best_fixed_tok_s"] = fixed[row["best_fixed"]]
            line += (f"; SIMULATED {row['tok_s_with_host']:.0f} tok/s with its host time against the best fixed "
                     f"{row['best_fixed']}'s {row['best_fixed_tok_s']:.0f}: "
                     f"{row['tok_s_with_host'] / row['best_fixed_tok_s']:.3f}x "
                     f"({row['tok_s'] / row['best_fixed_tok_s']:.3f}x without it)")
        rows.append(row)
        print(line, flush=True)
    result = {"model": shape.name, "gpu": roofline.hw.name, "tokens": args.tokens, "alpha": args.alpha, "beta": args.beta,
              "levels": rows}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
