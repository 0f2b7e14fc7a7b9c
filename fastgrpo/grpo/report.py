"""What a GRPO run reports: each step's line (of its `StepRecord`, which the loop also tracks), the
speculation record of a rollout, and at the end the run's summary (`summary.json`, its markdown
table, its learning-curve picture)."""

from __future__ import annotations

import json
import logging
import math
import statistics
from pathlib import Path

from fastgrpo.config import Config
from fastgrpo.grpo.record import StepRecord
from fastgrpo.types import EngineStats

log = logging.getLogger(__name__)


def rollout_stats(stats: EngineStats) -> dict:
    """The speculation record of one rollout: chosen config by concurrency, and the per-step trace; with the
    embedded engine also its static steps, their graph captures' seconds and what padding cost them."""
    return {k: stats[k] for k in ("accept_len", "mean_running", "spec_steps", "decode_steps",
                                  "config_by_concurrency", "trace")} | {
        k: stats[k] for k in ("static_steps", "capture_s", "pad_row_share", "pad_kv_share") if k in stats}


def print_step(total: int, r: StepRecord) -> None:
    p = r.policy
    print(f"step {r.step}/{total} | reward {r.reward_mean:.3f}±{r.reward_std:.3f} | "
          f"len {r.response_len_mean:.0f}/{r.response_len_max:.0f} | "
          f"rollout {r.rollout_s:.1f}s ({r.gen_tokens_per_s:.0f} tok/s, accept {r.accept_len or 1.0:.2f}) | "
          f"train {r.train_s:.1f}s | sync {r.weight_sync_s:.2f}s | loss {p.get('loss', 0.0):.4f} | "
          f"clip {p.get('clip_fraction', 0.0):.3f} | entropy {p.get('entropy', 0.0):.3f}"
          + (f" | refill {r.refill_rounds} round(s), {r.refill_short} group(s) short" if r.refill_rounds else "")
          + (f" | masked {p['correction_masked_fraction']:.3f}" if p.get("correction_masked_fraction") else "")
          + (f" | REWARD ERRORS {r.reward_errors}" if r.reward_errors else ""), flush=True)


def write_summary(cfg: Config, steps: list[StepRecord], evals: dict[int, dict[str, float]],
                  eval_problems: int) -> Path:
    """`<run_dir>/summary.json`: the run's results in one file (the README's results table is made
    from it): first and last eval, medians of the step times, rollout throughput and speculation;
    `summary.md` (that table) and `summary.png` (the held-out curve) beside it. `steps`: every step's
    record, `evals`: the evals by step (keys `eval/...`), `eval_problems`: how many problems they scored."""
    evals = {s: {k.removeprefix("eval/"): v for k, v in e.items()} for s, e in sorted(evals.items())}

    def median(values) -> float | None:
        values = [float(v) for v in values if v is not None and math.isfinite(v)]  # None, NaN: not measured that step
        return statistics.median(values) if values else None

    c = cfg
    summary = {
        "config": {"seed": c.seed, "steps": c.grpo.steps, "prompts_per_step": c.rollout.prompts_per_step,
                   "group_size": c.rollout.group_size, "lr": c.optim.lr, "speculation": c.speculation.policy,
                   "draft_online": c.draft.online, "eval_split": c.eval.split, "eval_problems": eval_problems,
                   "eval_samples": c.eval.samples, "policy": c.model.path},
        "start": evals.get(0),  # the starting policy's eval (none with eval.at_start=false)
        "start_step": 0 if 0 in evals else None,
        "end": evals[max(evals)] if evals else None,
        "end_step": max(evals) if evals else None,
        "curve": [{"step": s} | e for s, e in evals.items()],
        "median": {k: median(v) for k, v in (
            ("step_s", [r.step_s for r in steps]), ("rollout_s", [r.rollout_s for r in steps]),
            ("train_s", [r.train_s for r in steps]), ("draft_train_s", [r.draft.get("draft_train_s") for r in steps]),
            ("weight_sync_s", [r.weight_sync_s for r in steps]),
            ("weight_sync_bytes", [r.weight_sync_bytes for r in steps]),
            ("gen_tokens_per_s", [r.gen_tokens_per_s for r in steps]),
            ("response_len_mean", [r.response_len_mean for r in steps]), ("accept_len", [r.accept_len for r in steps]),
            ("spec_step_fraction", [r.spec_step_fraction for r in steps]),
            ("draft_lag", [r.draft.get("draft_lag") for r in steps]),
            ("draft_states_per_s", [r.draft.get("draft_states_per_s") for r in steps]))},
        "steps_run": len(steps),
    }
    path = Path(c.run_dir) / "summary.json"
    path.write_text(json.dumps(summary, indent=2))
    table = summary_markdown(summary)
    path.with_suffix(".md").write_text(table)
    plot_curve(summary, path.with_suffix(".png"))
    print(f"summary: {path}\n\n{table}", flush=True)
    return path


def summary_markdown(s: dict) -> str:
    """The README's results table, made from a summary.json."""
    if not s["end"]:
        return ""
    c, m = s["config"], s["median"]
    k = c["eval_samples"]
    rows = [("mean accuracy (%d samples, T = rollout's)" % k, "mean_accuracy"), (f"pass@{k}", f"pass_at_{k}"),
            ("pass@1 greedy", "pass1_greedy")]
    start = s["start"]
    lines = [f"| held-out ({c['eval_split']} split, {c['eval_problems']} problems) | step 0 | "
             f"step {s['end_step']} | change |", "| --- | ---: | ---: | ---: |"]
    for label, key in rows:
        b = s["end"][key]
        before = f"{100 * start[key]:.1f}% ± {100 * start[key + '_se']:.1f}" if start else "not evaluated"
        change = f"{100 * (b - start[key]):+.1f}" if start else "-"
        lines.append(f"| {label} | {before} | {100 * b:.1f}% ± {100 * s['end'][key + '_se']:.1f} | {change} |")

    def fmt(key: str, unit: str = "", digits: int = 2) -> str:
        return "-" if m.get(key) is None else f"{m[key]:.{digits}f}{unit}"

    lines += ["", f"Medians over {s['steps_run']} GRPO steps (seed {c['seed']}, {c['prompts_per_step']} prompts x "
              f"{c['group_size']} samples, lr {c['lr']:g}, speculation `{c['speculation']}`, draft `{c['draft_online']}`): "
              f"step {fmt('step_s', ' s', 1)}, rollout {fmt('rollout_s', ' s', 1)}, policy training "
              f"{fmt('train_s', ' s', 1)}, draft training {fmt('draft_train_s', ' s')}, weight sync "
              f"{fmt('weight_sync_s', ' s')}; rollout {fmt('gen_tokens_per_s', ' tokens/s', 0)}, "
              f"{fmt('response_len_mean', ' tokens', 1)} per answer, accepted length {fmt('accept_len')}, "
              f"speculative steps {fmt('spec_step_fraction')}."]
    return "\n".join(lines) + "\n"


def plot_curve(s: dict, png: Path) -> None:
    """The summary's held-out curve against the step (greedy pass@1, mean accuracy, pass@k, with their
    standard errors as error bars), drawn with matplotlib; without matplotlib, or without evals, none."""
    if not s["curve"]:
        return
    try:
        import matplotlib
    except ImportError:
        log.info("matplotlib is not installed: no %s", png)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = s["config"]["eval_samples"]
    steps = [p["step"] for p in s["curve"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("pass1_greedy", "greedy pass@1"), ("mean_accuracy", f"mean accuracy ({k} samples)"),
                       (f"pass_at_{k}", f"pass@{k}")):
        if all(key in p for p in s["curve"]):
            ax.errorbar(steps, [p[key] for p in s["curve"]], yerr=[p.get(f"{key}_se", 0.0) for p in s["curve"]],
                        marker="o", capsize=2, label=label)
    ax.set_xlabel("GRPO step")
    ax.set_title(f"held-out ({s['config']['eval_split']} split, {s['config']['eval_problems']} problems)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
