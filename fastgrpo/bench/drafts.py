"""`fastgrpo bench drafts`: who proposes the draft tree (`speculation.drafts`), over epochs of the same prompts.

GRPO samples `group_size` responses per prompt and comes back to its prompts epoch after epoch. Here a
set of training prompts, each `group_size` times, is rolled out `epochs` times in a row by one engine,
with a new seed each epoch, by each draft source at the same tree shape (`speculation.depth`, `topk`,
`num_verify`: an equal node budget):

- `learned`: the draft head's tree (EAGLE-2), what every earlier benchmark measured;
- `index`: the suffix index's continuations alone (the prompt's earlier epochs, its live siblings, its
  own text; no draft forward);
- `hybrid`: both merged into one tree (`tree.hybrid_tree`);
- `off`: plain decoding, for the rollout seconds.

Each source keeps its own index across the epochs (a fresh one per replicate). The policy and the draft
do not change between epochs (no training step runs), so a prompt's later epochs are drawn from the same
distribution as its first: history recurs at least as often here as in a training run, whose policy
moves a little each step. With keyed sampling every source emits the same tokens (up to a float-rounding
flip; `identical` counts them), so their rollouts are the same work and their seconds compare directly.

Per epoch and source: tokens emitted per sequence per verify (`accept_len`, accepted draft tokens + 1)
pooled over the call's sequences, the rollout's seconds, the index's host seconds (lookups, inserts,
history upkeep) as a share of the decode steps' seconds, the same with building and calibrating the
merged trees (`host_share`: all a hybrid step adds on the host), and the share of accepted tokens the
index proposed. Sources run in a rotated order each epoch; the whole run is repeated over `replicates`
independent sets of prompts and seeds, and every figure is the mean over replicates with its standard
error (over replicates; accept_len also has one over sequences, pooled). After the epochs, the SIMULATED
part (`drafts_simulated`): learned-only and hybrid trees priced by `aware` on an H100.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import statistics
import time
from pathlib import Path

import torch

from fastgrpo.bench.drafts_simulated import QUICK_SHAPES, SHAPES, merge_sweeps, simulated_h100, sweep_shapes
from fastgrpo.bench.drafts_simulated import markdown as simulated_markdown
from fastgrpo.bench.report import command_line, publish
from fastgrpo.bench.rollout import rotated
from fastgrpo.config import Config
from fastgrpo.engines.embedded.build import build_engine
from fastgrpo.engines.embedded.engine import EmbeddedEngine
from fastgrpo.models.policy import load_policy, num_parameters
from fastgrpo.models.tokenizer import load_text_format
from fastgrpo.speculation.node_calibration import NodeCalibration
from fastgrpo.speculation.policy import Off, Static
from fastgrpo.speculation.spec import SpecConfig
from fastgrpo.speculation.suffix_index import CompiledTrie, IndexLimits, SuffixIndex
from fastgrpo.tasks.source import encode_problems, load_task
from fastgrpo.types import Request, SamplingParams

SOURCES = ("learned", "index", "hybrid")
MODES = ("off", *SOURCES)


def standard_error(values: list[float]) -> float | None:
    """The standard error of the mean of `values` (None for fewer than two)."""
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) >= 2 else None


def ratio_se(emitted: list[int], steps: list[int]) -> tuple[float, float | None]:
    """sum(emitted) / sum(steps) over sequences, with its standard error treating sequences as the
    sampled units (the ratio estimator's linearisation): sequences that speculated longer weigh more."""
    pairs = [(e, s) for e, s in zip(emitted, steps) if s > 0]
    n = len(pairs)
    if n == 0:
        return 1.0, None
    r = sum(e for e, _ in pairs) / sum(s for _, s in pairs)
    if n < 2:
        return r, None
    mean_steps = sum(s for _, s in pairs) / n
    var = sum((e - r * s) ** 2 for e, s in pairs) / (n - 1)
    return r, math.sqrt(var / n) / mean_steps


def use(engine: EmbeddedEngine, mode: str, tree: Static, indexes: dict[str, SuffixIndex],
        calibrations: dict[str, NodeCalibration]) -> None:
    """Set the engine to decode as `mode`: plain, or `tree` proposed by that source with its own index
    and node calibration."""
    if mode == "off":
        engine.set_speculation(Off())
        engine.set_drafts("learned")
        return
    engine.set_speculation(tree)
    engine.set_drafts(mode, index=indexes.get(mode), calibration=calibrations.get(mode))


def run_replicate(engine: EmbeddedEngine, prompts: list[list[int]], group: int, epochs: int, seed: int,
                  sampling: SamplingParams, tree: Static, limits: IndexLimits, shapes: tuple[SpecConfig, ...],
                  log) -> tuple[list[dict], dict]:
    """`epochs` rollouts of the prompts (each `group` times) by every mode: one record per (epoch, mode);
    then the shape sweep of the SIMULATED part (`drafts_simulated.sweep_shapes`) from the history the
    epochs left."""
    requests = [Request(p) for p in prompts for _ in range(group)]
    indexes = {mode: SuffixIndex(limits) for mode in ("index", "hybrid")}
    calibrations = {mode: NodeCalibration() for mode in ("index", "hybrid")}
    records = []
    for epoch in range(epochs):
        tokens: dict[str, list[list[int]]] = {}
        for mode in rotated(list(MODES), seed + epoch):
            use(engine, mode, tree, indexes, calibrations)
            t = time.perf_counter()
            out = engine.generate(requests, sampling, seed=seed * 1000 + epoch)
            seconds = time.perf_counter() - t
            stats = engine.stats()
            tokens[mode] = [o.token_ids for o in out]
            emitted = [int(o.spec.get("spec_emitted", 0)) for o in out]
            steps = [int(o.spec.get("spec_steps", 0)) for o in out]
            accept, accept_se = ratio_se(emitted, steps)
            accepted_tokens = stats["spec_emitted"] - stats["spec_seq_steps"]
            records.append({
                "epoch": epoch, "mode": mode, "seconds": seconds, "tokens": sum(map(len, tokens[mode])),
                "decode_s": stats["decode_s"], "accept_len": accept, "accept_len_se_seq": accept_se,
                "emitted": emitted, "steps": steps, "index_s": stats.get("index_s", 0.0),
                "merge_s": stats.get("merge_s", 0.0),
                "index_share": stats.get("index_s", 0.0) / max(stats["decode_s"], 1e-9),
                "host_share": (stats.get("index_s", 0.0) + stats.get("merge_s", 0.0)) / max(stats["decode_s"], 1e-9),
                "index_accepted_share": stats.get("index_accepted", 0) / accepted_tokens if accepted_tokens else 0.0,
                "index_matched": stats.get("index_matched", 0) / max(stats.get("index_lookups", 0), 1)})
            log(f"  epoch {epoch} {mode:>7}: {seconds:6.2f} s, {records[-1]['tokens']} tokens, accept_len "
                f"{accept:.2f}, index {100 * records[-1]['index_share']:.1f}% of decode")
        for r in records[-len(MODES):]:  # keyed sampling: every source emits plain decoding's tokens
            r["identical"] = sum(a == b for a, b in zip(tokens[r["mode"]], tokens["off"])) / len(requests)
    sweep = sweep_shapes(engine, requests, sampling, seed * 1000 + epochs, shapes, indexes["hybrid"],
                         calibrations["hybrid"], log)
    return records, sweep


def summarise(records: list[dict], epochs: int) -> list[dict]:
    """Per epoch: each mode's means over replicates with standard errors, and hybrid / learned."""
    rows = []
    for epoch in range(epochs):
        row: dict = {"epoch": epoch}
        by_mode = {m: [r for r in records if r["epoch"] == epoch and r["mode"] == m] for m in MODES}
        for mode, rs in by_mode.items():
            for key in ("seconds", "accept_len", "index_share", "host_share", "index_accepted_share", "identical",
                        "index_matched"):
                values = [r[key] for r in rs]
                row[f"{mode}_{key}"] = statistics.mean(values)
                row[f"{mode}_{key}_se"] = standard_error(values)
            pooled = ratio_se([e for r in rs for e in r["emitted"]], [s for r in rs for s in r["steps"]])
            row[f"{mode}_accept_len_pooled"], row[f"{mode}_accept_len_se_seq"] = pooled
        for mode in ("index", "hybrid"):  # accepted draft tokens per verify against learned's, per replicate
            ratios = [(a["accept_len"] - 1) / max(b["accept_len"] - 1, 1e-9)
                      for a, b in zip(by_mode[mode], by_mode["learned"])]
            row[f"{mode}_over_learned_accepted"] = statistics.mean(ratios)
            row[f"{mode}_over_learned_accepted_se"] = standard_error(ratios)
            times = [a["seconds"] / b["seconds"] for a, b in zip(by_mode[mode], by_mode["learned"])]
            row[f"{mode}_over_learned_seconds"] = statistics.mean(times)
            row[f"{mode}_over_learned_seconds_se"] = standard_error(times)
        rows.append(row)
    return rows


def bench_drafts(cfg: Config, quick: bool, output: Path, extra: list[str] | None = None) -> dict:
    def log(msg: str) -> None:
        print(msg, flush=True)

    policy, text = load_policy(cfg.model.path), load_text_format(cfg.model.path, cfg.task)
    policy.eval()
    engine = build_engine(cfg, policy.config, text, policy.state_dict().items(), speculation="static")
    sc = cfg.speculation
    tree = Static(SpecConfig(sc.depth, sc.topk, sc.num_verify))
    limits = IndexLimits.of(sc)
    n_prompts, epochs, replicates = (4, 3, 2) if quick else (cfg.rollout.prompts_per_step, 4, 3)
    group = cfg.rollout.group_size
    sampling = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                              max_new_tokens=128 if quick else cfg.rollout.max_new_tokens)
    train, _ = load_task(cfg.task)
    encoded = encode_problems(train[: n_prompts * replicates], text, cfg.model.max_context)
    if len(encoded) < n_prompts * replicates:
        raise ValueError(f"bench drafts needs {n_prompts * replicates} training prompts, the task gives {len(encoded)}")
    shapes = QUICK_SHAPES if quick else SHAPES
    t0 = time.perf_counter()
    records, sweeps = [], []
    for rep in range(replicates):
        prompts = [e.prompt_ids for e in encoded[rep * n_prompts: (rep + 1) * n_prompts]]
        log(f"replicate {rep}: {n_prompts} prompts x {group} samples, {epochs} epochs, then {len(shapes)} shapes")
        runs, sweep = run_replicate(engine, prompts, group, epochs, rep + 1, sampling, tree, limits, shapes, log)
        records += [r | {"replicate": rep} for r in runs]
        sweeps.append(sweep)
    measured_s = time.perf_counter() - t0
    simulated = simulated_h100(merge_sweeps(sweeps), quick, cfg.seed, log)
    result = {
        "meta": {"date": datetime.date.today().isoformat(), "quick": quick, "threads": torch.get_num_threads(),
                 "torch": torch.__version__, "policy_parameters": num_parameters(policy), "tree": tree.config.name,
                 "prompts": n_prompts, "group": group, "epochs": epochs, "replicates": replicates,
                 "max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
                 "index_limits": dataclasses.asdict(limits),
                 "index_trie": "Python" if CompiledTrie is None else "compiled",  # the indexes' default
                 "steps": "static" if engine.static else "eager",
                 "measured_seconds": measured_s,
                 "seconds": time.perf_counter() - t0},
        "epochs": summarise(records, epochs),
        "simulated": simulated,
        "runs": [{k: v for k, v in r.items() if k not in ("emitted", "steps")} for r in records],
    }
    publish(result, output, command_line("drafts", quick, output, extra), markdown)
    return result


def percent(fraction: float) -> str:
    return f"{100 * fraction:.0f}%"


def _pm(value: float, se: float | None, digits: int = 2) -> str:
    return f"{value:.{digits}f}" + ("" if se is None else f" ± {se:.{digits}f}")


def markdown(result: dict, command: str) -> str:
    m = result["meta"]
    lines = [f"Command: `{command}`", "",
             f"Date {m['date']}; {m['threads']} CPU threads, torch {m['torch']}; policy "
             f"{m['policy_parameters'] / 1e6:.1f}M parameters; {m['prompts']} training prompts x {m['group']} "
             f"samples, {m['epochs']} epochs of the same prompts (no training between them), up to "
             f"{m['max_new_tokens']} new tokens at temperature {m['temperature']}; tree {m['tree']} for every source "
             f"(equal node budget); means over {m['replicates']} replicates ± their standard error; the index's "
             f"suffix trie {m.get('index_trie', 'Python')}; {m.get('steps', 'eager')} engine steps.", "",
             "Tokens per sequence per verify (accepted draft tokens + 1):", "",
             "| epoch | learned | index | hybrid | index / learned (accepted) | hybrid / learned (accepted) "
             "| hybrid: accepted from the index | sequences identical to off (learned, index, hybrid) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["epochs"]:
        lines.append(
            f"| {r['epoch'] + 1} | " + " | ".join(_pm(r[f'{s}_accept_len'], r[f'{s}_accept_len_se']) for s in SOURCES)
            + f" | {_pm(r['index_over_learned_accepted'], r['index_over_learned_accepted_se'])}x"
            f" | {_pm(r['hybrid_over_learned_accepted'], r['hybrid_over_learned_accepted_se'])}x"
            f" | {100 * r['hybrid_index_accepted_share']:.0f}%"
            f" | {', '.join(percent(r[f'{s}_identical']) for s in SOURCES)} |")
    lines += ["", "Rollout seconds, and host seconds as a share of the decode steps': the index's (lookups, "
              "inserts, upkeep) and all of the index's and merged trees' (with building and calibrating the "
              "trees):", "",
              "| epoch | off | learned | index | hybrid | hybrid / learned | index share (index, hybrid) "
              "| host share (index, hybrid) |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["epochs"]:
        lines.append(
            f"| {r['epoch'] + 1} | " + " | ".join(_pm(r[f'{s}_seconds'], r[f'{s}_seconds_se']) for s in MODES)
            + f" | {_pm(r['hybrid_over_learned_seconds'], r['hybrid_over_learned_seconds_se'])}x"
            f" | {100 * r['index_index_share']:.1f}%, {100 * r['hybrid_index_share']:.1f}%"
            f" | {100 * r['index_host_share']:.1f}%, {100 * r['hybrid_host_share']:.1f}% |")
    if "simulated" in result:
        lines += simulated_markdown(result["simulated"])
    return "\n".join(lines)


# -- `fastgrpo bench drafts`: its sub-parser (fastgrpo/bench/command.py) --
def add_arguments(parser) -> None:
    """`fastgrpo bench drafts`'s own flags (--quick, --output, --config and overrides are every benchmark's)."""
    parser.set_defaults(run=from_cli)


def from_cli(args, cfg) -> dict:
    return bench_drafts(cfg, args.quick, args.output, extra=args.extra)
