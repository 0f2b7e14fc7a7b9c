"""`fastgrpo bench learning`: does GRPO raise held-out accuracy, for several seeds, with and without
speculation?

Each (seed, mode) is a whole `fastgrpo train` run from the same starting policy, with an eval every
`--every` steps; the run seed changes the prompt order and the sampling noise (the data and the
held-out split stay those of `task.seed`). Modes: the config's own speculation policy and `off`.
With counter-based sampling both modes see nearly the same rollouts, so their curves should agree
within noise: learning does not depend on speculation.

`--variants` compares objectives instead: each variant is a name and config overrides
(`gspo:grpo.ratio_level=sequence`), run in every mode, so the objective's options (docs/objective.md)
are measured on the same task, seeds and starting policy as the default.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import statistics
import time
from pathlib import Path

import torch

from fastgrpo.bench.report import command_line, publish
from fastgrpo.config import Config, with_overrides
from fastgrpo.train import train

METRICS = ("mean_accuracy", "pass1_greedy")


def parse_variants(text: str) -> dict[str, list[str]]:
    """`name:key=value+key=value,name2:...` (a bare `name` or `default`: no overrides) -> name -> overrides."""
    out: dict[str, list[str]] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, rest = item.partition(":")
        overrides = [o for o in rest.split("+") if o]
        if not name or any("=" not in o for o in overrides):
            raise argparse.ArgumentTypeError(f"{item!r} is not name or name:key=value+key=value")
        if name in out:
            raise argparse.ArgumentTypeError(f"{name!r} twice")
        out[name] = overrides
    return out


def run_config(cfg: Config, seed: int, mode: str, steps: int, every: int, run_dir: Path, label: str | None = None) -> Config:
    online = cfg.draft.online if mode != "off" else "off"
    label = label or mode
    return dataclasses.replace(
        cfg, seed=seed, run_dir=str(run_dir / f"{label.replace('/', '-')}-seed{seed}"),
        speculation=dataclasses.replace(cfg.speculation, policy=mode),
        draft=dataclasses.replace(cfg.draft, online=online),
        grpo=dataclasses.replace(cfg.grpo, steps=steps),
        eval=dataclasses.replace(cfg.eval, at_start=True, every=every),
        checkpoint=dataclasses.replace(cfg.checkpoint, every=steps + 1),
        tracking=dataclasses.replace(cfg.tracking, run_name=f"bench-learning-{label.replace('/', '-')}-seed{seed}"))


def bench_learning(cfg: Config, quick: bool, output: Path, seeds: int | None = None, steps: int | None = None,
                   every: int | None = None, modes: list[str] | None = None, extra: list[str] | None = None,
                   variants: dict[str, list[str]] | None = None) -> dict:
    seeds = seeds or (2 if quick else 3)
    steps = steps or (4 if quick else cfg.grpo.steps)
    every = every or max(1, steps // 3)
    modes = modes or [cfg.speculation.policy] + (["off"] if cfg.speculation.policy != "off" else [])
    for mode in modes:
        if mode not in ("off", "static", "fastgrpo", "aware"):
            raise ValueError(f"--modes: unknown speculation policy {mode!r}")
    # each run: (label, mode, its config); a variant's label is mode/variant
    runs = [(mode, mode, cfg) for mode in modes] if not variants else [
        (f"{mode}/{name}", mode, with_overrides(cfg, overrides)) for mode in modes for name, overrides in variants.items()]
    labels = [label for label, _, _ in runs]
    t0 = time.perf_counter()
    result: dict = {"steps": steps, "every": every, "modes": labels,
                    "meta": {"date": datetime.date.today().isoformat(), "quick": quick,
                             "cores": torch.get_num_threads(), "torch": torch.__version__,
                             "config": {"policy": cfg.model.path, "lr": cfg.optim.lr,
                                        "prompts_per_step": cfg.rollout.prompts_per_step,
                                        "group_size": cfg.rollout.group_size, "eval_split": cfg.eval.split,
                                        "eval_problems": cfg.task.eval_size if cfg.eval.split == "test"
                                        else cfg.task.validation_size, "eval_samples": cfg.eval.samples}}}
    runs_dir = output.parent / f"{output.stem}-runs"
    if variants:
        result["variants"] = variants
    for label, mode, run_base in runs:
        result[label] = {"seeds": []}
        for seed in range(seeds):
            print(f"== bench learning: {label}, seed {seed} ({steps} steps) ==", flush=True)
            run_cfg = run_config(run_base, seed, mode, steps, every, runs_dir, label)
            run = train(run_cfg)
            summary = json.loads((Path(run_cfg.run_dir) / "summary.json").read_text())
            curve = summary["curve"]
            result[label]["seeds"].append({
                "seed": seed, "start": curve[0], "end": curve[-1], "curve": curve, "summary": summary,
                "train_accuracy": [r.accuracy for r in run.steps],
                "response_len": [r.response_len_mean for r in run.steps],
                "rollout_s": [r.rollout_s for r in run.steps], "refill_rounds": [r.refill_rounds for r in run.steps],
                "groups_kept": [r.groups_kept for r in run.steps]})
        result[label]["change"] = {k: _spread([s["end"][k] - s["start"][k] for s in result[label]["seeds"]])
                                   for k in METRICS}
        result[label]["rollout_s_per_step"] = _spread([statistics.fmean(s["rollout_s"])
                                                       for s in result[label]["seeds"]])
    result["seeds"] = result[labels[0]]["seeds"]  # the config's own mode, in the documented place
    result["meta"]["seconds"] = time.perf_counter() - t0
    flags = [f"--seeds {seeds}", f"--steps {steps}", f"--every {every}", f"--modes {','.join(modes)}"]
    if variants:
        flags.append("--variants " + ",".join(name + (":" + "+".join(o) if o else "") for name, o in variants.items()))
    command = command_line("learning", quick, output, (extra or []) + flags)
    publish(result, output, command, markdown, lambda png: plot(result, png))
    return result


def _spread(values: list[float]) -> dict[str, float]:
    mean = statistics.fmean(values)
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
    return {"mean": mean, "se": se, "min": min(values), "max": max(values)}


def markdown(r: dict, command: str) -> str:
    m = r["meta"]
    lines = [f"### GRPO learning: held-out accuracy over {len(r['seeds'])} seeds ({m['date']})", "",
             f"`{command}`", "",
             f"{m['cores']} threads, torch {m['torch']}; {r['steps']} GRPO steps of {m['config']['prompts_per_step']} "
             f"prompts x {m['config']['group_size']} samples at lr {m['config']['lr']:g}; eval on the "
             f"{m['config']['eval_problems']} problems of the {m['config']['eval_split']} split "
             f"({m['config']['eval_samples']} samples each), +- one standard error over problems.", "",
             "| mode | seed | mean accuracy start | end | greedy pass@1 start | end |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for mode in r["modes"]:
        for s in r[mode]["seeds"]:
            a, b = s["start"], s["end"]
            lines.append(f"| {mode} | {s['seed']} | {a['mean_accuracy']:.3f}±{a['mean_accuracy_se']:.3f} | "
                         f"{b['mean_accuracy']:.3f}±{b['mean_accuracy_se']:.3f} | "
                         f"{a['pass1_greedy']:.3f}±{a['pass1_greedy_se']:.3f} | "
                         f"{b['pass1_greedy']:.3f}±{b['pass1_greedy_se']:.3f} |")
    lines.append("")
    for mode in r["modes"]:
        c = r[mode]["change"]
        rollout = r[mode].get("rollout_s_per_step")
        lines.append(f"- {mode}: change in mean accuracy {c['mean_accuracy']['mean']:+.3f} "
                     f"(seeds {c['mean_accuracy']['min']:+.3f} .. {c['mean_accuracy']['max']:+.3f}), "
                     f"greedy pass@1 {c['pass1_greedy']['mean']:+.3f} "
                     f"({c['pass1_greedy']['min']:+.3f} .. {c['pass1_greedy']['max']:+.3f})"
                     + (f"; rollout {rollout['mean']:.2f} s a step" if rollout else ""))
    return "\n".join(lines) + "\n"


def plot(r: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in zip(axes, METRICS, ("mean accuracy (T = rollout's)", "greedy pass@1")):
        for mode, style in zip(r["modes"], ("-", "--", ":", "-.", (0, (5, 1)), (0, (1, 3)))):
            for s in r[mode]["seeds"]:
                steps = [p["step"] for p in s["curve"]]
                ax.errorbar(steps, [p[key] for p in s["curve"]], yerr=[p[f"{key}_se"] for p in s["curve"]],
                            linestyle=style, marker="o", capsize=2, label=f"{mode} seed {s['seed']}")
        ax.set_xlabel("GRPO step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


# -- `fastgrpo bench learning`: its sub-parser (fastgrpo/bench/command.py) --
def add_arguments(parser) -> None:
    """`fastgrpo bench learning`'s own flags (--quick, --output, --config and overrides are every benchmark's)."""
    from fastgrpo.bench.command import at_least_one

    parser.add_argument("--seeds", type=at_least_one, help="run seeds 0..N-1 (default 3; 2 with --quick)")
    parser.add_argument("--steps", type=at_least_one, help="GRPO steps per run (default grpo.steps)")
    parser.add_argument("--every", type=at_least_one, help="eval every N steps (default steps // 3)")
    parser.add_argument("--modes", help="speculation policies to run, comma-separated (default: the config's own "
                        "and off)")
    parser.add_argument("--variants", type=parse_variants,
                        help="objectives to compare, comma-separated, each name or name:key=value+key=value "
                             "(e.g. default,gspo:grpo.ratio_level=sequence); each runs in every mode")
    parser.set_defaults(run=from_cli, needs_of=needs)


def needs(args, cfg: Config) -> str:
    """Runs without speculation (`--modes off`, or the config's policy off) need no draft."""
    modes = args.modes.split(",") if args.modes else [cfg.speculation.policy, "off"]
    return "policy" if set(modes) == {"off"} else "draft"


def from_cli(args, cfg) -> dict:
    return bench_learning(cfg, args.quick, args.output, args.seeds, args.steps, args.every,
                          args.modes.split(",") if args.modes else None, extra=args.extra, variants=args.variants)
