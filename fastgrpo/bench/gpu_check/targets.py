"""The GPU check's targets (docs/gpu.md), read from a run's results: each target, what the run measured for
it, and whether it was met. A speed ratio from 3 repetitions is noisy at a few running rows (replayed on
the simulator, a fixed choice that knew the truth fell below 0.97x the calls' best in about half the runs
at 4 running: tools/aware_gpu_check_sim.py), so `aware` below its line by less than the run's own noise
(twice the ratio's standard error, or the A/A pair's distance from 1, whichever is larger) is reported as
within noise, neither met nor failed. The rollout stage repeats such a workload (up to `Size.extra_reps`
more); what is still within noise after them is for the next run to decide."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

AWARE_LINE = 0.97  # aware's speed over the best fixed choice's, at every level and on the GRPO batch
AWARE_OVER_OFF = 2.0  # aware's speed over plain decoding's on the GRPO batch
BOUND_8B = 1.5  # the Llama-3.1-8B shape's decode step at batch 1 over its memory-bandwidth bound
PLAIN_MS = 2.5  # the check's policy's plain step at batch 1: 10x faster than the eager engine's 25 ms (H100)
SIMULATOR_ERROR = 0.20  # the fitted simulator's largest |simulated / measured - 1| over the measured steps

Verdict = Literal["met", "not met", "within noise", "not measured"]


@dataclass(frozen=True)
class Target:
    target: str
    measured: str
    verdict: Verdict


def ratio_se(ratio: float, a: float, a_se: float | None, b: float, b_se: float | None) -> float:
    """The standard error of ratio = a / b (or b / a) from each side's, to first order: ratio x the root of
    the sum of their squared relative errors (0 where a side has none)."""
    rel = [(se or 0.0) / x for x, se in ((a, a_se), (b, b_se)) if x]
    return ratio * math.sqrt(sum(r * r for r in rel))


def aware_verdict(ratio: float, se: float, aa: float | None) -> Verdict:
    """Met at or above AWARE_LINE; within noise below it by at most max(2 se, |1 - A/A|); else not met."""
    if ratio >= AWARE_LINE:
        return "met"
    noise = max(2 * se, abs(1 - aa) if aa else 0.0)
    return "within noise" if ratio + noise >= AWARE_LINE else "not met"


def level_ratio(row: dict) -> tuple[float, float, float | None]:
    """A sweep level's aware / best fixed (`level_row`), its standard error and the A/A ratio."""
    best = row["best_fixed"]
    se = ratio_se(row["aware_vs_best"], row["aware_tok_s"], row.get("aware_tok_s_se"), row[f"{best}_tok_s"],
                  row.get(f"{best}_tok_s_se"))
    return row["aware_vs_best"], se, row.get("aa_ratio")


def grpo_ratio(g: dict) -> tuple[float, float, float | None]:
    """The GRPO batch's aware / best fixed (`grpo_summary`), its standard error and the A/A ratio."""
    best, se_s, all_s = g["best_fixed"], g.get("se_s") or {}, g["all_s"]
    se = ratio_se(g["aware_vs_best"], all_s["aware"], se_s.get("aware"), all_s[best], se_s.get(best))
    return g["aware_vs_best"], se, g.get("aa_ratio")


def _data(result: dict, stage: str) -> dict | None:
    s = result.get("stages", {}).get(stage) or {}
    return s.get("data") if s.get("status") == "ok" else None


def _against_best(where: str, best: str, runs: int | None, ratio: float, se: float, aa: float | None) -> Target:
    return Target(f"aware >= {AWARE_LINE}x the best fixed choice {where}",
                  f"{ratio:.3f}x {best} (se {se:.3f}, A/A {aa or math.nan:.3f}; {runs or '?'} repetitions)",
                  aware_verdict(ratio, se, aa))


def _aware(result: dict) -> list[Target]:
    r = _data(result, "rollout")
    if not r:
        return [Target(f"aware >= {AWARE_LINE}x the best fixed choice", "no rollout stage", "not measured")]
    out = []
    for row in r.get("sweep", []):
        if "aware_vs_best" in row:
            out.append(_against_best(f"at {row['concurrency']} running", row["best_fixed"], row.get("aware_runs"),
                                     *level_ratio(row)))
    for level in r.get("levels_skipped_for_time", []):
        out.append(Target(f"aware >= {AWARE_LINE}x the best fixed choice at {level} running", "skipped for time",
                          "not measured"))
    g = r.get("grpo_batch") or {}
    if "aware_vs_best" in g:
        out.append(_against_best("on the GRPO batch", g["best_fixed"], (g.get("runs") or {}).get("aware"),
                                 *grpo_ratio(g)))
        over_off = g["aware_vs_off"]
        out.append(Target(f"aware >= {AWARE_OVER_OFF:g}x plain decoding on the GRPO batch", f"{over_off:.2f}x",
                          "met" if over_off >= AWARE_OVER_OFF else "not met"))
    return out


def _plain_step(result: dict) -> Target:
    """The policy's plain step at batch 1: the fastest of decode_bound's and step_bench's static and fused."""
    name = f"the check's policy's plain step at 1 running <= {PLAIN_MS:g} ms"
    found = {}
    if (d := _data(result, "decode_bound")) and (row := d.get("batches", {}).get("1")):
        found["decode_bound"] = row["step_ms"]
    for cell in (_data(result, "step_bench") or {}).get("cells", []):
        if cell["level"] == 1 and cell["shape"] == "plain" and cell["engine"] in ("static", "fused"):
            found[f"step_bench {cell['engine']}"] = cell["step_ms"]["median"]
    if not found:
        return Target(name, "no plain step at 1 running", "not measured")
    source = min(found, key=found.get)
    return Target(name, f"{found[source]:.3f} ms ({source})", "met" if found[source] <= PLAIN_MS else "not met")


def _big(result: dict) -> Target:
    name = f"the Llama-3.1-8B shape's decode step at batch 1 <= {BOUND_8B:g}x its bandwidth bound"
    d = _data(result, "decode_8b")
    if not d or d.get("skipped"):
        return Target(name, f"skipped: {d['skipped']}" if d else "no decode_8b stage", "not measured")
    found = {"op by op": (d.get("batches", {}).get("1") or {}).get("step_vs_bound"),
             "fused": ((d.get("fused") or {}).get("batches", {}).get("1") or {}).get("step_vs_bound")}
    found = {k: v for k, v in found.items() if v is not None}
    if not found:
        return Target(name, "no step at batch 1", "not measured")
    source = min(found, key=found.get)
    measured = f"{found[source]:.2f}x ({source})"
    if not d.get("full_shape"):
        return Target(name, measured + ", a scaled-down structure", "not measured")
    return Target(name, measured, "met" if found[source] <= BOUND_8B else "not met")


def _simulator(result: dict) -> Target:
    name = f"the fitted simulator within {SIMULATOR_ERROR:.0%} of the measured steps"
    d = _data(result, "simulator_fit")
    if not d:
        return Target(name, "no simulator_fit stage", "not measured")
    error = d["error_after"]["max_abs_error"]
    held = (d.get("error_held_out") or {}).get("max_abs_error")
    measured = f"largest abs error {error:.1%}" + (f" ({held:.1%} each level held out)" if held is not None else "")
    return Target(name, measured, "met" if error <= SIMULATOR_ERROR else "not met")


def targets(result: dict[str, Any]) -> list[Target]:
    """Every target, in the order docs/gpu.md lists them, whatever stages the run finished."""
    return [_big(result), _plain_step(result), *_aware(result), _simulator(result)]
