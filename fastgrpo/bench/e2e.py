"""`fastgrpo bench e2e`: the same GRPO run (seed, data, policy) in three rollout modes.

- `off`: no speculation;
- `frozen`: the warm-start draft (trained offline on the SFT corpus), never updated, as static
  systems run it;
- `online`: the same draft, learning during RL from rollout's own target states (sync mode).

Both speculative modes use the `aware` policy. Modes run one after another in one process; each
writes its own run directory and MLflow run. The speedups compare median step and rollout times.
At the end both drafts are scored with fixed trees against the policy the online run ended with
(`bench draft`), since rollout's accepted length also reflects the trees `aware` chose.
"""

from __future__ import annotations

import dataclasses
import datetime
import statistics
import time
from pathlib import Path

import torch

from fastgrpo.paths import checkpoint_draft, checkpoint_policy, draft_dir
from fastgrpo.bench.draft_fit import TREES, fit_drafts
from fastgrpo.bench.draft_fit import markdown as fit_markdown
from fastgrpo.bench.report import command_line, publish
from fastgrpo.config import Config, flatten, to_yaml
from fastgrpo.train import train
from fastgrpo.tracking import Tracker, default_tracking_uri

MODES = {"off": ("off", "off"), "frozen": ("aware", "off"), "online": ("aware", "sync")}


def mode_config(cfg: Config, mode: str, steps: int, run_dir: Path) -> Config:
    policy, online = MODES[mode]
    return dataclasses.replace(
        cfg, run_dir=str(run_dir / mode),
        speculation=dataclasses.replace(cfg.speculation, policy=policy),
        draft=dataclasses.replace(cfg.draft, online=online),
        grpo=dataclasses.replace(cfg.grpo, steps=steps),
        eval=dataclasses.replace(cfg.eval, at_start=False, every=0),
        checkpoint=dataclasses.replace(cfg.checkpoint, every=steps + 1),  # only the final one
        tracking=dataclasses.replace(cfg.tracking, run_name=f"bench-e2e-{mode}"))


def bench_e2e(cfg: Config, quick: bool, output: Path, steps: int | None = None,
              extra: list[str] | None = None) -> dict:
    steps = steps or (8 if quick else max(cfg.grpo.steps, 30))
    t0 = time.perf_counter()
    result: dict = {"steps": steps, "meta": {"date": datetime.date.today().isoformat(), "quick": quick,
                                              "cores": torch.get_num_threads(), "torch": torch.__version__,
                                              "config": {"prompts_per_step": cfg.rollout.prompts_per_step,
                                                         "group_size": cfg.rollout.group_size,
                                                         "max_new_tokens": cfg.rollout.max_new_tokens,
                                                         "task_tail": cfg.task.tail,
                                                         "sync_budget": cfg.draft.sync_budget}}}
    for mode in MODES:
        print(f"== bench e2e: mode {mode} ({steps} steps) ==", flush=True)
        run = train(mode_config(cfg, mode, steps, output.parent / f"{output.stem}-runs"))
        s = run.steps
        final = run.evals[steps]
        result[mode] = {"step_s": [r.step_s for r in s], "rollout_s": [r.rollout_s for r in s],
                        "train_s": [r.train_s for r in s], "accuracy": [r.accuracy for r in s],
                        "rollout_tok_s": [r.gen_tokens_per_s for r in s],
                        "response_len": [r.response_len_mean for r in s],
                        "final_eval": {k.removeprefix("eval/"): v for k, v in final.items()}}
        if mode != "off":
            result[mode]["accept_len"] = [r.accept_len or 1.0 for r in s]
            result[mode]["spec_step_fraction"] = [r.spec_step_fraction for r in s]
        if mode == "online":  # the sync draft learner's own report
            result[mode]["draft_train_s"] = [r.draft["draft_train_s"] for r in s]
            result[mode]["draft_top1_fresh"] = [r.draft["draft_top1_fresh"] for r in s]
            final_checkpoint = run.checkpoint
    # the same fixed trees, prompts and seeds for both drafts against the policy online RL ended with
    print("== bench e2e: frozen and online drafts fitted to the online run's final policy ==", flush=True)
    drafts = {"frozen": draft_dir(cfg), "online": checkpoint_draft(final_checkpoint)}
    result["draft_fit"] = fit_drafts(cfg, checkpoint_policy(final_checkpoint), drafts, quick)
    med = {m: {k: statistics.median(result[m][k]) for k in ("step_s", "rollout_s")} for m in MODES}
    f = statistics.median(r / t for r, t in zip(result["off"]["rollout_s"], result["off"]["step_s"]))
    rollout_speedup = med["off"]["rollout_s"] / med["online"]["rollout_s"]
    tok_s = {m: statistics.median(result[m]["rollout_tok_s"]) for m in MODES}
    # step seconds per generated token: like for like even where two modes' answers differ in length
    per_token = {m: statistics.median(t / n for t, n in zip(result[m]["step_s"], result[m]["response_len"]))
                 for m in MODES}
    result |= {"speedup_end_to_end": med["off"]["step_s"] / med["online"]["step_s"],
               "speedup_end_to_end_per_token": per_token["off"] / per_token["online"],
               # the modes sample different (equally distributed) trajectories, so their responses and
               # hence their step times can differ for reasons other than speed: throughput is the clean ratio
               "rollout_throughput_speedup": tok_s["online"] / tok_s["off"],
               "rollout_throughput_speedup_frozen": tok_s["frozen"] / tok_s["off"],
               "speedup_frozen": med["off"]["step_s"] / med["frozen"]["step_s"],
               "rollout_speedup": rollout_speedup, "rollout_fraction_off": f,
               # like for like: the rollout's speedup per token (throughput), over off's rollout share
               "amdahl_bound": 1 / ((1 - f) + f / (tok_s["online"] / tok_s["off"])),
               "draft_train_fraction": statistics.median(
                   d / t for d, t in zip(result["online"]["draft_train_s"], result["online"]["step_s"])),
               "accept_len_first5": {m: statistics.mean(result[m]["accept_len"][:5]) for m in ("frozen", "online")},
               "accept_len_last5": {m: statistics.mean(result[m]["accept_len"][-5:]) for m in ("frozen", "online")},
               "accuracy_final": {m: result[m]["final_eval"]["mean_accuracy"] for m in MODES},
               "medians": med}
    result["meta"]["seconds"] = time.perf_counter() - t0
    publish(result, output, command_line("e2e", quick, output, extra), markdown,
            plot=lambda path: plot_e2e(result, path))
    log_summary(cfg, result, output)
    return result


def log_summary(cfg: Config, result: dict, output: Path) -> None:
    """The comparison as an MLflow run of its own (the per-mode runs hold the per-step metrics)."""
    runs = output.parent / f"{output.stem}-runs"
    tracker = Tracker(cfg.tracking.uri or default_tracking_uri(runs), cfg.tracking.experiment, runs / "mlartifacts",
                      enabled=cfg.tracking.enabled)
    tracker.start(f"bench-e2e-summary-{result['steps']}steps", flatten(cfg), to_yaml(cfg))
    tracker.log_metrics({k: result[k] for k in ("speedup_end_to_end", "speedup_frozen", "rollout_speedup",
                                                "rollout_fraction_off", "amdahl_bound", "draft_train_fraction")}, step=0)
    tracker.log_artifact(output)
    tracker.log_artifact(output.with_suffix(".png"))
    tracker.end()


def plot_e2e(result: dict, path: Path) -> None:
    """Accepted length by step (frozen vs online), step-time breakdown by mode, accuracy by step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    xs = range(1, result["steps"] + 1)
    for mode in ("frozen", "online"):
        a.plot(xs, result[mode]["accept_len"], marker=".", label=mode)
    a.set(xlabel="GRPO step", ylabel="mean accepted length", title="Draft acceptance during RL")
    a.legend()
    modes = list(MODES)
    rollout = [statistics.mean(result[m]["rollout_s"]) for m in modes]  # means: the parts add up to the step
    trainer = [statistics.mean(result[m]["train_s"]) for m in modes]
    other = [statistics.mean(result[m]["step_s"]) - r - t for m, r, t in zip(modes, rollout, trainer)]
    b.bar(modes, rollout, label="rollout")
    b.bar(modes, trainer, bottom=rollout, label="policy train")
    b.bar(modes, other, bottom=[r + t for r, t in zip(rollout, trainer)], label="other (draft, sync, scoring)")
    b.set(ylabel="mean seconds per step", title="Step time by mode")
    b.legend()
    for mode in modes:
        c.plot(xs, result[mode]["accuracy"], marker=".", label=mode, alpha=0.8)
    c.set(xlabel="GRPO step", ylabel="rollout accuracy", title="Learning by mode")
    c.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(result: dict, command: str) -> str:
    m, med = result["meta"], result["medians"]
    lines = [f"Command: `{command}`", "",
             f"Date {m['date']}; {m['cores']} CPU threads, torch {m['torch']}; {result['steps']} GRPO steps per mode, "
             f"rollout {m['config']['prompts_per_step']} prompts x {m['config']['group_size']} samples, "
             f"max {m['config']['max_new_tokens']} new tokens, task tail {m['config']['task_tail']}.", "",
             "| mode | median step s | median rollout s | median rollout tok/s | mean response tokens | accept len first 5 "
             "| accept len last 5 | final pass@1 greedy | final mean accuracy |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for mode in MODES:
        first = result["accept_len_first5"].get(mode)
        last = result["accept_len_last5"].get(mode)
        ev = result[mode]["final_eval"]
        lines.append(f"| {mode} | {med[mode]['step_s']:.2f} | {med[mode]['rollout_s']:.2f} | "
                     f"{statistics.median(result[mode]['rollout_tok_s']):.0f} | "
                     f"{statistics.mean(result[mode]['response_len']):.1f} | "
                     f"{'-' if first is None else f'{first:.2f}'} | {'-' if last is None else f'{last:.2f}'} | "
                     f"{ev['pass1_greedy']:.3f} | {ev['mean_accuracy']:.3f} |")
    lines += ["", f"Rollout throughput (tokens/s, the like-for-like ratio): online {result['rollout_throughput_speedup']:.2f}x "
              f"off, frozen {result['rollout_throughput_speedup_frozen']:.2f}x off.",
              "", f"End-to-end speedup (off / online, median step time): {result['speedup_end_to_end']:.2f}x "
              f"(per generated token: {result['speedup_end_to_end_per_token']:.2f}x; frozen: {result['speedup_frozen']:.2f}x); "
              f"rollout speedup {result['rollout_speedup']:.2f}x; rollout share of an `off` step "
              f"{result['rollout_fraction_off']:.2f}, so the Amdahl bound, from the rollout's throughput ratio "
              f"(per token, like for like), is {result['amdahl_bound']:.2f}x; sync draft training takes {100 * result['draft_train_fraction']:.1f}% "
              f"of an online step."]
    if "draft_fit" in result:
        fit, deep = result["draft_fit"]["scores"], f"accept_{TREES[0].name}"
        top1 = fit["online"]["heldout_top1"] / fit["frozen"]["heldout_top1"]
        lines += ["", "Both drafts against the online run's final policy (rollout's accepted length above also "
                  "depends on the trees `aware` chose; here the trees are fixed):", "",
                  fit_markdown(result["draft_fit"], ""),
                  "", f"Online / frozen: held-out top-1 {top1:.3f}x, "
                  f"accepted length {TREES[0].name} {fit['online'][deep] / fit['frozen'][deep]:.3f}x."]
    return "\n".join(lines)


# -- `fastgrpo bench e2e` (its sub-parser: fastgrpo/bench/command.py) ----------------------------------
def add_arguments(parser) -> None:
    """`fastgrpo bench e2e`'s own flags (--quick, --output, --config and overrides are every benchmark's)."""
    parser.set_defaults(run=from_cli)


def from_cli(args, cfg) -> dict:
    return bench_e2e(cfg, args.quick, args.output, extra=args.extra)
