"""`fastgrpo bench guarantee`: is `aware` never slower than plain decoding, on this machine's cost
curves?

`aware` exists to speculate only where it pays, so the claim to check is a floor: aware's throughput
is at least 0.97x `off`'s at every concurrency and on the GRPO batch. A shared machine's slow spells
move one generate() call by +-10%, more than the margin being checked, so the statistic is paired,
in ABBA blocks: a repetition runs aware, off, off, aware (or off, aware, aware, off, alternating),
and its figure is aware's throughput over its two calls over off's over theirs; a run reports the
median of its repetitions' figures, which a slow spell that hits one call cannot move. Blocks, not
pairs: at one sequence the second call of a pair (in that sequence also the call after the other
mode) can run faster than the first, so pairs whose order alternated leaned to the majority order; in a block each mode takes each place
once, and a linear drift cancels too. (Throughputs, not seconds: on the GRPO batch a near-tie can
change a sample's length between modes.) Each run starts fresh policies (aware knows nothing yet, as
at the start of training) and the whole is repeated at each thread count: 1 and 2 threads give two
different cost curves, as two machines would.

A run's median of a handful of blocks still moves by a few percent on a shared machine, as much as
the margin being checked, so the table also pools every block of every run of a workload: the
median of all of them with a bootstrap 95% interval, which tells a systematic cost of `aware` (the
interval below 1) from a run that drew slow blocks (the interval around 1). (The JSON keeps the
name "pairs" for a run's list of blocks.)

Each block also says where aware's time went (`step_accounting`): its plain steps against off's,
its speculative steps (decisions and probes) against the plain steps that would have emitted the
same tokens, and its tail (steps at fewer rows than off ran: speculation lets some rows finish first),
so a loss can be traced to deciding, probing, speculating or the rows it unlocked.

A block's ratio of two identical modes is not 1 on a shared machine, and a run's median of a few
blocks can fall below the floor with nothing to tell the modes apart. `--aa` measures that: after
each workload's blocks, the same blocks (orders and seeds) of plain decoding against itself, two `off`
policies (A/A), whose ratios are the noise floor the aware figures are read against.

The engine's other claim, a lead over Hugging Face `generate` at batch 1 without speculation, is
checked the same way: the two back to back, a run's figure the median of the pairs' ratios.
"""

from __future__ import annotations

import dataclasses
import datetime
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fastgrpo.engines.embedded.build import build_engine, speculation_policy
from fastgrpo.bench.report import command_line, publish
from fastgrpo.bench.rollout import hf_generate_seconds, rotated, timed_generate
from fastgrpo.config import Config
from fastgrpo.device import cpu_description, thread_count
from fastgrpo.models.policy import load_policy, num_parameters
from fastgrpo.models.tokenizer import load_text_format
from fastgrpo.tasks.source import held_out_prompt_ids
from fastgrpo.types import Request, SamplingParams

FLOOR = 0.97  # aware / off throughput that counts as "not slower": the guarantee aware is held to
LEVELS = (1, 4, 16, 64)


def workloads(cfg: Config, prompts: list[list[int]], quick: bool) -> dict[str, tuple[list[Request], SamplingParams]]:
    """Fixed concurrency (EOS ignored, so the running count stays put) and a GRPO-shaped batch."""
    tokens = 48 if quick else 96
    out = {f"running {b}": fixed_concurrency(cfg, prompts, b, tokens) for b in LEVELS}
    group = cfg.rollout.group_size
    n_prompts = 4 if quick else 8
    grpo = dataclasses.replace(SamplingParams.of(cfg.rollout), max_new_tokens=128 if quick else cfg.rollout.max_new_tokens)
    out[f"GRPO batch ({n_prompts}x{group})"] = ([Request(p) for p in prompts[:n_prompts] for _ in range(group)], grpo)
    return out


def fixed_concurrency(cfg: Config, prompts: list[list[int]], rows: int,
                      tokens: int) -> tuple[list[Request], SamplingParams]:
    """`rows` sequences of `tokens` new tokens each, EOS ignored, so the running count stays put."""
    sampling = dataclasses.replace(SamplingParams.of(cfg.rollout), max_new_tokens=tokens, ignore_eos=True)
    return [Request(prompts[i % len(prompts)], max_new_tokens=tokens) for i in range(rows)], sampling


def abba_block(modes: list[str], rep: int, rows: int) -> list[tuple[str, int]]:
    """Block `rep`'s four calls as (mode, seed): A B B A, the order of the two modes rotated per block. A
    block's two calls of a mode have different seeds; both modes get the same two (the same samples)."""
    first, second = rotated(modes, rep)
    return [(mode, 1000 * rep + 100 * (call in (2, 3)) + rows)
            for call, mode in enumerate((first, second, second, first))]


def one_run(engine, cfg: Config, loads: dict, reps: int, aa: bool = False) -> dict[str, dict]:
    """ABBA blocks (`abba_block`) of off/aware calls of every workload with fresh policies; block 0 warms up.
    With `aa`, each workload's A/A blocks after its own (`aa_blocks`)."""
    modes = {mode: speculation_policy(engine, cfg, mode) for mode in ("off", "aware")}
    out = {}
    for name, (requests, sampling) in loads.items():
        pairs = []
        for rep in range(reps + 1):
            probes = modes["aware"].probes
            calls = timed_block(engine, modes, requests, sampling, rep)
            off, aware = calls["off"], calls["aware"]
            if rep:
                pairs.append({"off_tok_s": off["tokens"] / off["seconds"], "aware_tok_s": aware["tokens"] / aware["seconds"],
                              "spec_fraction": statistics.mean(aware["spec"]), "probes": modes["aware"].probes - probes,
                              # prefill, the policy's decisions and the engine loop: aware's beyond off's
                              "outside_steps_fraction": (aware["outside"] - off["outside"]) / aware["seconds"],
                              # aware's own choices and updates (in its steps and outside them)
                              "policy_fraction": aware["policy"] / aware["seconds"],
                              **step_accounting(aware["trace"], off["trace"])})
        out[name] = {"ratio": statistics.median(p["aware_tok_s"] / p["off_tok_s"] for p in pairs),
                     "spec_fraction": statistics.median(p["spec_fraction"] for p in pairs), "pairs": pairs}
        if aa:
            blocks = aa_blocks(engine, cfg, requests, sampling, reps)
            out[name] |= {"aa_ratio": statistics.median(b["ratio"] for b in blocks), "aa_blocks": blocks}
    return out


def aa_blocks(engine, cfg: Config, requests: list[Request], sampling: SamplingParams, reps: int) -> list[dict]:
    """Blocks 1..reps of `one_run` (the same orders and seeds) with plain decoding in both places: two
    `off` policies, A and A'. Each block's ratio, A' throughput over A's, is what two identical modes read
    on this machine: the noise floor. No warm-up block: the engine is warm, and `off` learns nothing."""
    modes = {mode: speculation_policy(engine, cfg, "off") for mode in ("off", "off_aa")}
    blocks = []
    for rep in range(1, reps + 1):
        calls = timed_block(engine, modes, requests, sampling, rep)
        tokens, seconds = ({m: c[k] for m, c in calls.items()} for k in ("tokens", "seconds"))
        blocks.append({"tokens": tokens, "seconds": seconds,
                       "ratio": (tokens["off_aa"] / seconds["off_aa"]) / (tokens["off"] / seconds["off"])})
    return blocks


def timed_block(engine, modes: dict, requests: list[Request], sampling: SamplingParams, rep: int) -> dict[str, dict]:
    """Block `rep`'s four calls (`abba_block`), per mode in `modes`' order: its tokens and seconds over its two
    calls, their steps' trace, their seconds outside the decode steps, and each call's speculative share."""
    out = {mode: {"tokens": 0, "seconds": 0.0, "trace": [], "outside": 0.0, "policy": 0.0, "spec": []} for mode in modes}
    for mode, seed in abba_block(list(modes), rep, len(requests)):
        engine.set_speculation(modes[mode])
        r = timed_generate(engine, requests, sampling, seed=seed)
        o = out[mode]
        o["tokens"] += r["tokens"]
        o["seconds"] += r["seconds"]
        o["trace"] += r["trace"]
        o["outside"] += r["seconds"] - sum(step[3] for step in r["trace"])
        o["policy"] += r["policy_s"]
        o["spec"].append(r["spec_fraction"])
    return out


def plain_step_seconds(off: list[tuple]) -> Callable[[int], float]:
    """Off's median plain step at a running count (engine traces: running, config, emitted, seconds), or at
    the nearest count it ran: what the plain steps that would have emitted a speculative step's tokens cost."""
    by_running: dict[int, list[float]] = {}
    for running, _, _, s in off:
        by_running.setdefault(running, []).append(s)
    plain = {b: statistics.median(v) for b, v in by_running.items()}
    return lambda running: plain[running] if running in plain else plain[min(plain, key=lambda b: abs(b - running))]


def step_accounting(aware: list[tuple], off: list[tuple]) -> dict[str, float]:
    """Where aware's decode time went, against off's steps of the same block (engine traces: running,
    config, emitted, seconds): its plain steps over off's at the same running count (what deciding
    costs), the seconds its speculative steps took beyond the plain steps that would have emitted the
    same tokens (what speculation lost, or won if negative), and its tail, as fractions of aware's decode
    time. The tail is aware's steps at fewer rows than off ever ran: speculation unlocks the rows (each
    accepts its own number of tokens a step), so at fixed concurrency some finish first and the rest
    decode at fewer rows, each step dearer a row, where off's rows finish together. No off step prices
    those, so they are counted apart (priced at off's steps of more rows, aware's plain steps read 0.73x
    off's in a block that had speculated on 90% of its steps, and the block's accounting contradicted
    its ratio)."""
    off_step = plain_step_seconds(off)
    fewest = min(running for running, *_ in off)
    plain_s = plain_ref = spec_s = spec_ref = tail_s = 0.0
    for running, name, emitted, s in aware:
        if running < fewest:
            tail_s += s
        elif name == "off":
            plain_s, plain_ref = plain_s + s, plain_ref + off_step(running)
        else:
            spec_s, spec_ref = spec_s + s, spec_ref + emitted / running * off_step(running)
    decode = plain_s + spec_s + tail_s
    return {"plain_step_vs_off": plain_s / plain_ref if plain_ref else 1.0,
            "spec_net_fraction": (spec_s - spec_ref) / decode, "tail_fraction": tail_s / decode}


def pooled(ratios: list[float], resamples: int = 2000, seed: int = 0) -> dict:
    """The median of all blocks' ratios and its 95% bootstrap interval (percentiles of the medians of
    resampled sets of blocks; a fixed seed, so the same blocks always give the same interval)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return {"median": statistics.median(ratios), "ci95": [medians[int(0.025 * resamples)],
                                                          medians[int(0.975 * resamples) - 1]], "pairs": len(ratios)}


def engine_vs_hf(policy, engine, cfg: Config, prompt: list[int], tokens: int, reps: int) -> dict:
    """Batch 1, plain decoding: the engine's throughput over HF `generate`'s, paired; rep 0 warms up."""
    sampling = SamplingParams(temperature=1.0, max_new_tokens=tokens, ignore_eos=True)
    engine.set_speculation(speculation_policy(engine, cfg, "off"))
    pairs = []
    for rep in range(reps + 1):
        hf_s = hf_generate_seconds(policy, torch.tensor([prompt]), tokens)
        engine_s = timed_generate(engine, [Request(prompt, max_new_tokens=tokens)], sampling, seed=rep)["seconds"]
        if rep:
            pairs.append({"hf_s": hf_s, "engine_s": engine_s})
    return {"ratio": statistics.median(p["hf_s"] / p["engine_s"] for p in pairs), "pairs": pairs}


def bench_guarantee(cfg: Config, quick: bool, output: Path, runs: int | None, threads: list[int] | None,
                    extra: list[str] | None = None, repetitions: int | None = None, aa: bool = False) -> dict:
    runs = runs or (2 if quick else 5)
    threads = threads or [1, 2]
    reps = repetitions or (3 if quick else 5)  # ABBA blocks of four calls
    policy, text = load_policy(cfg.model.path), load_text_format(cfg.model.path, cfg.task)
    prompts = held_out_prompt_ids(cfg.task, text, cfg.model.max_context)
    loads = workloads(cfg, prompts, quick)
    t0 = time.perf_counter()
    result: dict = {"meta": {"date": datetime.date.today().isoformat(), "quick": quick, "torch": torch.__version__,
                             "machine": platform.machine(), "cpu": cpu_description(),
                             "policy_parameters": num_parameters(policy),
                             "runs": runs, "repetitions": reps, "floor": FLOOR, "aa": aa}, "threads": {}}
    for t in threads:
        with thread_count(t):
            engine = build_engine(cfg, policy.config, text, policy.state_dict().items(), speculation="aware")
            per_run, hf = [], []
            for run in range(runs):
                per_run.append(one_run(engine, cfg, loads, reps, aa))
                hf.append(engine_vs_hf(policy, engine, cfg, prompts[0], loads["running 1"][1].max_new_tokens, reps))
                print(f"{t} thread(s), run {run + 1}/{runs}: aware / off " + ", ".join(
                    f"{name} {r['ratio']:.3f}x" for name, r in per_run[-1].items())
                    + ("; A/A (off / off) " + ", ".join(f"{name} {r['aa_ratio']:.3f}x" for name, r in per_run[-1].items())
                       if aa else "")
                    + f"; engine / HF generate at batch 1 {hf[-1]['ratio']:.3f}x", flush=True)
            result["threads"][str(t)] = {
                "torch_threads": torch.get_num_threads(),
                "engine_vs_hf_batch1": {"ratios": [r["ratio"] for r in hf], "runs": [r["pairs"] for r in hf]},
                "aware_vs_off": {name: {"ratios": [r[name]["ratio"] for r in per_run],
                                        "spec_fractions": [r[name]["spec_fraction"] for r in per_run],
                                        "pooled": pooled([p["aware_tok_s"] / p["off_tok_s"]
                                                          for r in per_run for p in r[name]["pairs"]]),
                                        "runs": [r[name]["pairs"] for r in per_run]} for name in loads}}
            if aa:
                result["threads"][str(t)]["aa"] = {
                    name: {"ratios": [r[name]["aa_ratio"] for r in per_run],
                           "pooled": pooled([b["ratio"] for r in per_run for b in r[name]["aa_blocks"]]),
                           "runs": [r[name]["aa_blocks"] for r in per_run]} for name in loads}
    result["meta"]["seconds"] = time.perf_counter() - t0
    command = command_line("guarantee", quick, output,
                           (extra or []) + [f"--runs {runs}", f"--threads {','.join(map(str, threads))}"]
                           + ([f"--repetitions {repetitions}"] if repetitions else []) + (["--aa"] if aa else []))
    publish(result, output, command, markdown)
    return result


def markdown(result: dict, command: str) -> str:
    m = result["meta"]
    lines = [f"Command: `{command}`", "",
             f"Date {m['date']}; torch {m['torch']} ({m['machine']}; {m.get('cpu', 'CPU not recorded')}); policy {m['policy_parameters'] / 1e6:.1f}M "
             f"parameters, fp32. {m['runs']} runs per thread count, each with fresh policies; a run's figure is "
             f"the median over {m['repetitions']} ABBA blocks (aware, off, off, aware, or the reverse, "
             f"alternating) of aware's throughput / off's. Floor: {m['floor']:.2f}x.", "",
             "| threads | workload | runs (aware / off) | worst run | all runs >= floor | all blocks: median [95% CI] "
             "| aware speculative steps (median) | probes per block | aware plain step / off's | speculative steps' "
             "net time (% of aware's) | tail (% of aware's) | outside the steps, beyond off's (% of aware's) | aware's "
             "own choices and updates (% of its time) |",
             "| ---: | --- | --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for t, r in result["threads"].items():
        for name, r in r["aware_vs_off"].items():
            ratios, pool, blocks = r["ratios"], r["pooled"], [p for run in r["runs"] for p in run]
            lines.append(f"| {t} | {name} | {', '.join(f'{x:.3f}' for x in ratios)} | {min(ratios):.3f}x | "
                         f"{'yes' if min(ratios) >= m['floor'] else 'no'} | {pool['median']:.3f} "
                         f"[{pool['ci95'][0]:.3f}, {pool['ci95'][1]:.3f}] ({pool['pairs']} blocks) | "
                         f"{100 * statistics.median(r['spec_fractions']):.0f}% | {_mean(blocks, 'probes'):.2f} | "
                         f"{_mean(blocks, 'plain_step_vs_off'):.3f} | {100 * _mean(blocks, 'spec_net_fraction'):+.1f}% | "
                         f"{100 * _mean(blocks, 'tail_fraction'):.1f}% | "
                         f"{100 * _mean(blocks, 'outside_steps_fraction'):+.1f}% | "
                         f"{100 * _mean(blocks, 'policy_fraction'):.2f}% |")
    if any("aa" in r for r in result["threads"].values()):
        lines += ["", "The noise floor: the same blocks (orders and seeds) of plain decoding against itself (A/A: "
                  "two `off` policies), throughput of the second over the first:", "",
                  "| threads | workload | runs (off / off) | worst run | all runs >= floor | all blocks: median [95% CI] |",
                  "| ---: | --- | --- | ---: | --- | --- |"]
        for t, r in result["threads"].items():
            for name, r in r.get("aa", {}).items():
                ratios, pool = r["ratios"], r["pooled"]
                lines.append(f"| {t} | {name} | {', '.join(f'{x:.3f}' for x in ratios)} | {min(ratios):.3f}x | "
                             f"{'yes' if min(ratios) >= m['floor'] else 'no'} | {pool['median']:.3f} "
                             f"[{pool['ci95'][0]:.3f}, {pool['ci95'][1]:.3f}] ({pool['pairs']} blocks) |")
    lines += ["", "Where aware's time went (means over all blocks): probes are speculative steps taken only to "
              "re-measure speculation while plain decoding is chosen; aware's plain steps are timed against off's at "
              "the same running count in the same block; speculative steps' net time is their seconds minus those of "
              "the off plain steps that would have emitted the same tokens, over aware's decode time (negative: "
              "speculation saved time); the tail: aware's steps at fewer rows than off ever ran (speculation lets "
              "some rows finish first), over its decode time, counted in neither; outside the steps: prefill, the "
              "policy's decisions and the engine loop, aware's seconds beyond off's over aware's; aware's own choices "
              "and updates: the host time of its `choose` and `observe` (the engine's `policy_s`), over its time.",
              "", "Engine without speculation against Hugging Face `generate` (static cache) at batch 1, "
              "throughput ratio (median of paired repetitions per run):", "",
              "| threads | runs (engine / HF) | worst run |", "| ---: | --- | ---: |"]
    for t, r in result["threads"].items():
        ratios = r["engine_vs_hf_batch1"]["ratios"]
        lines.append(f"| {t} | {', '.join(f'{x:.3f}' for x in ratios)} | {min(ratios):.3f}x |")
    return "\n".join(lines)


def _mean(blocks: list[dict], key: str) -> float:
    """The mean of a per-block figure over every block of every run (0 for files written before it)."""
    return statistics.mean(b.get(key, 0.0) for b in blocks)


# -- `fastgrpo bench guarantee`: its sub-parser (fastgrpo/bench/command.py) --
def add_arguments(parser) -> None:
    """`fastgrpo bench guarantee`'s own flags (--quick, --output, --config and overrides are every benchmark's)."""
    from fastgrpo.bench.command import at_least_one, thread_counts

    parser.add_argument("--runs", type=at_least_one, help="runs per thread count (default 5; 2 with --quick)")
    parser.add_argument("--threads", type=thread_counts, help="torch thread counts, comma-separated (default 1,2)")
    parser.add_argument("--repetitions", type=at_least_one,
                        help="ABBA blocks per run, after a warm-up block (default 5; 3 with --quick)")
    parser.add_argument("--aa", action="store_true",
                        help="also run each workload's blocks with plain decoding against itself (A/A): the noise "
                             "floor beside aware's figures (about 1.8x the time)")
    parser.set_defaults(run=from_cli)


def from_cli(args, cfg) -> dict:
    return bench_guarantee(cfg, args.quick, args.output, args.runs, args.threads, extra=args.extra,
                           repetitions=args.repetitions, aa=args.aa)
