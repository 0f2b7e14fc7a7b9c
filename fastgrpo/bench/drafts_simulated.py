"""`fastgrpo bench drafts`, its SIMULATED part: learned-only and hybrid trees priced by `aware` on an H100.

On this CPU a verify forward of many tokens costs several plain forwards, so rollout seconds here say
little about a GPU, where verifying tens of tokens costs about one plain step. What transfers is how
many tokens each source's trees accept. So, after the benchmark's epochs (when each prompt has a
history), the same prompts are rolled out once more by each source at every tree shape of `SHAPES`,
each shape from the same history (a copy of the index and node calibration as the epochs left them)
and with the same sampling keys (so every shape writes the same text). Every step's accepted lengths
are kept, and an acceptance profile is fitted to each source's (`fit_acceptance`: per-depth acceptance
and what width adds; the measured histograms are used as they are for the shapes measured).

The simulator (`bench simulate`, its accuracy on this CPU in BENCHMARKS section 8) then runs `aware`
and `aware_per_sequence` on the long-tail reasoning workload of H100 SXM and Llama-3-8B, once with each
source's profile. A hybrid step also pays its host work: the index's lookups and upkeep and the
merging and calibrating of its trees, measured here per speculative step and fitted as a cost per step
plus a cost per running row (`HostModel`: the merge is batched, so much of it is paid once a step), are
added to every simulated speculative step (`HostWork`): a GPU host runs the same Python. A static
engine's schedule is priced too (`HostWork` with its `hidden` part): it launches the learned draft's step
function before the index's lookups, so the part of the host work a static sweep (`engine.steps=static`)
measured while that step computed is paid only where it outlasts the draft's forwards; the rest on every
step.

What the simulator does not know: a static engine runs a hybrid step as two step functions (the
learned draft's, then the verify of the merged tree) with a second read-back between them, while the
simulated step costs what one captured learned step of its node budget would; and the profiles come
from the bench policy on its task, not from an 8B model on reasoning text. Both are stated with the
figures.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from fastgrpo.bench.simulate.acceptance import fit_acceptance
from fastgrpo.bench.simulate.costs import Costs
from fastgrpo.bench.simulate.gpu import GPU_MAX_BATCH, GPU_STATICS, run_policies
from fastgrpo.bench.simulate.workload import longtail_case, longtail_of
from fastgrpo.engines.embedded.engine import EmbeddedEngine
from fastgrpo.speculation.node_calibration import NodeCalibration
from fastgrpo.speculation.policy import Static
from fastgrpo.speculation.roofline import ACCELERATORS, MODELS, Roofline
from fastgrpo.speculation.spec import SpecConfig
from fastgrpo.speculation.suffix_index import SuffixIndex
from fastgrpo.types import Request, SamplingParams

# from a chain to the deepest, widest corner of aware's grid; a profile fitted to these prices the rest
SHAPES = (SpecConfig(3, 1, 4), SpecConfig(2, 2, 4), SpecConfig(3, 4, 8), SpecConfig(4, 4, 12),
          SpecConfig(5, 8, 24), SpecConfig(6, 8, 32))
QUICK_SHAPES = (SpecConfig(2, 2, 4), SpecConfig(4, 4, 12), SpecConfig(6, 8, 32))
SIMULATED_SOURCES = ("learned", "hybrid")
SIMULATED_POLICIES = ("off", "aware", "aware_per_sequence")


class RecordingStatic(Static):
    """A fixed tree that keeps every speculative step's accepted lengths (what a profile is fitted to)."""

    def __init__(self, config: SpecConfig):
        super().__init__(config)
        self.accepted: list[int] = []

    def observe(self, config: SpecConfig | None, running: int, emitted: int, seconds: float,
                accepted: list[int] | None = None) -> None:
        if config is not None and accepted is not None:
            self.accepted.extend(accepted)


def sweep_shapes(engine: EmbeddedEngine, requests: list[Request], sampling: SamplingParams, seed: int,
                 shapes: tuple[SpecConfig, ...], index: SuffixIndex, calibration: NodeCalibration,
                 log: Callable[[str], None]) -> dict:
    """One rollout of `requests` per source and shape, the hybrid ones each from a copy of `index` and
    `calibration` (so that every shape starts from the same history): per source, the accepted lengths
    per shape and the hybrid's (running rows, host seconds, of those the seconds hidden behind the learned
    draft's step function in a static engine) of every speculative step."""
    out: dict = {source: {"accepted": {}, "host_steps": []} for source in SIMULATED_SOURCES}
    for source in SIMULATED_SOURCES:
        for c in shapes:
            policy = RecordingStatic(c)
            engine.set_speculation(policy)
            if source == "hybrid":
                copied = SuffixIndex(index.limits)
                copied.load_state_dict(index.state_dict())
                engine.set_drafts("hybrid", index=copied, calibration=copy.deepcopy(calibration))
            else:
                engine.set_drafts("learned")
            engine.generate(requests, sampling, seed=seed)
            stats = engine.stats()
            out[source]["accepted"][c] = policy.accepted
            steps = stats.get("host_steps", [])
            out[source]["host_steps"] += steps
            host = HostModel.fit([(r, h) for r, h, *_ in steps])
            log(f"  sweep {source:>7} {c.name:>8}: {1 + float(np.mean(policy.accepted)):.2f} tokens per verify, "
                f"host {host.describe()}")
    return out


@dataclass(frozen=True)
class HostModel:
    """Host seconds of a speculative step of B running rows: `per_step + B * per_row`."""

    per_step: float = 0.0
    per_row: float = 0.0

    @classmethod
    def fit(cls, steps: list[tuple[int, float]]) -> HostModel:
        """Least squares over (running rows, host seconds) of measured steps, neither term negative (a
        negative fixed cost refits through the origin; a negative cost per row leaves the mean as the
        fixed cost). No steps: no host work."""
        if not steps:
            return cls()
        rows = np.array([r for r, _ in steps], dtype=float)
        host = np.array([h for _, h in steps], dtype=float)
        if len(steps) > 1 and rows.var() > 0:
            per_row = float(np.cov(rows, host, bias=True)[0, 1] / rows.var())
            per_step = float(host.mean() - per_row * rows.mean())
            if per_row < 0:
                return cls(float(host.mean()), 0.0)
            if per_step >= 0:
                return cls(per_step, per_row)
        return cls(0.0, float((rows * host).sum() / (rows * rows).sum()))

    def seconds(self, B: int) -> float:
        return self.per_step + B * self.per_row

    def scaled(self, factor: float) -> HostModel:
        return HostModel(self.per_step * factor, self.per_row * factor)

    def describe(self) -> str:
        return f"{1e3 * self.per_step:.2f} ms a step + {1e6 * self.per_row:.0f} us a row"


@dataclass
class HostWork:
    """`costs` with `host` seconds of host work added to every speculative step (a hybrid tree's merging,
    which the GPU waits for), and `hidden` seconds (a static engine's schedule: the lookups, run while the
    learned draft's step function computes) paid only where they outlast the draft's forwards."""

    costs: Costs
    host: HostModel
    hidden: HostModel | None = None

    def __getattr__(self, name: str):
        return getattr(self.costs, name)

    def spec_step(self, c: SpecConfig, B: int, width: int, ctx_max: int, ctx_sum: int,
                  verified: float | None = None) -> float:
        seconds = self.costs.spec_step(c, B, width, ctx_max, ctx_sum, verified) + self.host.seconds(B)
        if self.hidden is not None:
            seconds += max(0.0, self.hidden.seconds(B) - self.costs.drafting(c, B, width, ctx_max, ctx_sum))
        return seconds


def merge_sweeps(sweeps: list[dict]) -> dict:
    """The replicates' sweeps pooled: accepted lengths concatenated, host models fitted to all their
    steps: all of a step's host work (`host`), the part a static step ran while its learned draft's step
    computed (`hidden`; none in an eager engine) and the rest (`waited`)."""
    out: dict = {}
    for source in SIMULATED_SOURCES:
        accepted: dict[SpecConfig, list[int]] = {}
        for s in sweeps:
            for c, values in s[source]["accepted"].items():
                accepted.setdefault(c, []).extend(values)
        steps = [(r, h, *rest) for s in sweeps for r, h, *rest in s[source]["host_steps"]]
        hidden = [rest[0] if rest else 0.0 for _, _, *rest in steps]
        out[source] = {"accepted": accepted, "host": HostModel.fit([(r, h) for r, h, *_ in steps]),
                       "hidden": HostModel.fit([(r, x) for (r, _, *_), x in zip(steps, hidden)]),
                       "waited": HostModel.fit([(r, h - x) for (r, h, *_), x in zip(steps, hidden)]),
                       "hidden_share": sum(hidden) / max(sum(h for _, h, *_ in steps), 1e-12),
                       "host_steps": len(steps)}
    return out


BREAK_EVEN = (1.0, 1.15)  # hybrid aware's speed over learned aware: the host budgets reported for them
BUDGET_STEPS = 5  # bisection steps: a budget is found to within 1 / 2^5 of the measured host work
BUDGET_RESOLUTION = 1 / 2**BUDGET_STEPS


def host_budget(seconds_at: Callable[[float], float], target: float, high: float, steps: int = 5) -> float | None:
    """The largest share of the measured host work (within high / 2^steps) at which `seconds_at(share)`,
    a simulated rollout's time growing with the host work, stays within `target`: `high` if met there
    already, None if not even without host work (bisection on [0, high])."""
    if seconds_at(0.0) > target:
        return None
    if seconds_at(high) <= target:
        return high
    low = 0.0
    for _ in range(steps):
        mid = (low + high) / 2
        low, high = (mid, high) if seconds_at(mid) <= target else (low, mid)
    return low


def simulated_h100(pooled: dict, quick: bool, seed: int, log: Callable[[str], None]) -> dict:
    """Each source's fitted profile on the SIMULATED H100 SXM / Llama-3-8B long tail (`bench simulate`'s
    target case and workload): `off`, `aware` and `aware_per_sequence` per source, the best static tree
    beside them, the median of `reps` runs each (after a warm-up for the learning policies)."""
    costs = Roofline(ACCELERATORS["h100"], MODELS["llama3-8b"])
    lt = longtail_case(quick)
    workload = longtail_of(lt, seed)
    reps = 1 if quick else 3
    profiles = {source: fit_acceptance(pooled[source]["accepted"], f"bench policy, {source} trees, after the epochs")
                for source in SIMULATED_SOURCES}
    # hybrid three times: paying all its measured host work on every step, in a static engine's schedule
    # (the part its sweep measured while the learned draft's step computed is paid only where it outlasts
    # the draft's forwards; the same as the first where the sweep ran eager steps, which hide nothing), and
    # with that work off the critical path (a bound: what overlapping all of it could at most recover)
    measured: HostModel = pooled["hybrid"]["host"]
    cases = {"learned": (profiles["learned"], costs),
             "hybrid": (profiles["hybrid"], HostWork(costs, measured)),
             "hybrid_static": (profiles["hybrid"],
                               HostWork(costs, pooled["hybrid"]["waited"], pooled["hybrid"]["hidden"])),
             "hybrid_no_host": (profiles["hybrid"], costs)}
    seconds: dict[str, dict] = {}
    for case, (profile, priced) in cases.items():
        modes = (*SIMULATED_POLICIES, *(f"static_{c.name}" for c in GPU_STATICS))
        res = run_policies(workload, priced, profile, GPU_STATICS, GPU_MAX_BATCH, reps, seed, modes=modes)
        seconds[case] = {m: r["seconds"] for m, r in res.items()}
        best = min((m for m in seconds[case] if m.startswith("static_")), key=seconds[case].get)
        seconds[case]["static_best"] = seconds[case][best]
        seconds[case]["static_best_shape"] = best[7:]
        log(f"SIMULATED H100 / Llama-3-8B long tail, {case}: " + ", ".join(
            f"{m} {seconds[case][m]:.1f}s" for m in (*SIMULATED_POLICIES, "static_best")))
    ratios = {case: {m: seconds["learned"][m] / seconds[case][m] for m in ("aware", "aware_per_sequence", "static_best")}
              for case in ("hybrid", "hybrid_static", "hybrid_no_host")}
    known = {0.0: seconds["hybrid_no_host"]["aware"], 1.0: seconds["hybrid"]["aware"]}

    def aware_seconds(share: float) -> float:  # aware's simulated time paying `share` of the measured host work
        if share not in known:
            known[share] = run_policies(workload, HostWork(costs, measured.scaled(share)), profiles["hybrid"], (),
                                        GPU_MAX_BATCH, reps, seed, modes=("aware",))["aware"]["seconds"]
        return known[share]

    break_even = {f"{speedup:.2f}": host_budget(aware_seconds, seconds["learned"]["aware"] / speedup, 1.0, BUDGET_STEPS)
                  for speedup in BREAK_EVEN}
    log("SIMULATED: hybrid's aware host budget (share of the measured host work) for " + ", ".join(
        f"{k}x learned's aware: {'none' if v is None else f'{v:.2f}'}" for k, v in break_even.items()))
    return {"case": costs.name, "workload": workload.name, "longtail": lt, "max_running": GPU_MAX_BATCH,
            "repetitions": reps, "seconds": seconds, "learned_over_hybrid": ratios, "host_budget_share": break_even,
            "profiles": {s: p.to_json() for s, p in profiles.items()},
            "host": {"per_step_s": measured.per_step, "per_row_s": measured.per_row,
                     "steps": pooled["hybrid"]["host_steps"], "hidden_share": pooled["hybrid"]["hidden_share"],
                     "waited": asdict(pooled["hybrid"]["waited"]), "hidden": asdict(pooled["hybrid"]["hidden"])}}


def markdown(sim: dict) -> list[str]:
    """The SIMULATED table of `bench drafts`' report."""
    s, lt = sim["seconds"], sim["longtail"]
    host = HostModel(sim["host"]["per_step_s"], sim["host"]["per_row_s"])
    lines = ["", f"SIMULATED: {sim['case']}, the long-tail workload (lognormal mean {lt['mean']:.0f}, sigma "
             f"{lt['sigma']}, cap {lt['max_new']}, {lt['prompts']} prompts x {lt['group']}, at most "
             f"{sim['max_running']} running), each source's acceptance profile fitted to its trees' accepted "
             f"lengths at {len(sim['profiles']['learned']['measured_samples'])} shapes after the epochs; hybrid steps "
             f"pay their measured host work, {host.describe()} (least squares over the sweep's {sim['host']['steps']} "
             f"hybrid steps); median of {sim['repetitions']} simulated rollouts:", "",
             "| policy | learned trees (SIMULATED s) | hybrid trees (SIMULATED s) | learned / hybrid | hybrid, "
             "a static engine's schedule (SIMULATED s) | learned / that | hybrid, host work off the critical path "
             "(a bound; SIMULATED s) | learned / that |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    static = s.get("hybrid_static")  # (results written before this schedule was priced have none)
    for m in ("off", "aware", "aware_per_sequence", "static_best"):
        cases = ("learned", "hybrid", *(("hybrid_static",) if static else ()), "hybrid_no_host")
        name = f"best static ({', '.join(s[c]['static_best_shape'] for c in cases)})" if m == "static_best" else f"`{m}`"
        in_static = f"{static[m]:.1f} | {s['learned'][m] / static[m]:.2f}x" if static else "- | -"
        lines.append(f"| {name} | {s['learned'][m]:.1f} | {s['hybrid'][m]:.1f} | {s['learned'][m] / s['hybrid'][m]:.2f}x "
                     f"| {in_static} | {s['hybrid_no_host'][m]:.1f} | {s['learned'][m] / s['hybrid_no_host'][m]:.2f}x |")
    if "waited" in sim["host"]:
        waited, hidden = HostModel(**sim["host"]["waited"]), HostModel(**sim["host"]["hidden"])
        lines += ["", f"A static engine's schedule: of the hybrid steps' host work the sweep measured "
                      f"{100 * sim['host']['hidden_share']:.0f}% while a step function computed (the lookups while the "
                      f"learned draft's step does, the index's upkeep while the verify does: "
                      f"{hidden.describe()}), paid only where it outlasts the draft's forwards, and the rest on every step "
                      f"({waited.describe()}); an eager sweep hides none, and prices this column as the one before it."]

    def budget(v: float | None) -> str:
        if v is None:
            return "- (not even without host work)"
        if v == 0.0:  # met without host work, at no share the bisection tried
            return f"< {BUDGET_RESOLUTION:.2f} of it"
        return f"<= {v:.2f} of it ({host.scaled(v).describe()})"

    budgets = ", ".join(f"{k}x at {budget(v)}" for k, v in sim["host_budget_share"].items())
    lines += ["", f"The share of the measured host work at which hybrid's `aware` reaches learned's (SIMULATED, "
                  f"bisection): {budgets}."]
    return lines
