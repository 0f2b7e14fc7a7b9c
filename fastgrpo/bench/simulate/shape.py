"""bench simulate --model: one named model shape (a Hugging Face config.json) on one simulated GPU, SIMULATED.

Why: `bench simulate`'s GPU tables are for the shapes it names (Llama-3-8B, -70B); a new shape, a
mixture-of-experts model above all, needs the same long-tail case without the hour of CPU validation,
which does not depend on the GPU's model. This runs only that: the long-tail reasoning workload of
`bench simulate` (64 prompts x 8, lognormal mean 3,000 tokens, sigma 1.0, cap 16,384, 256-token
prompts, at most GPU_MAX_BATCH running), every policy of the GPU tables but the per-sequence budget,
priced by the roofline (speculation/roofline.py) of the shape read from `--model`, with accepted
drafts from the cited EAGLE-3 profile and the width gain (beta) of our draft's fit in bench simulate's
full run. On a mixture-of-experts shape the roofline prices the experts each forward touches, and
`aware_expert_blind` (aware priced as a dense model of the active size) runs beside `aware`.
"""

from __future__ import annotations

import datetime
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from fastgrpo.speculation.roofline import ACCELERATORS, Roofline, load_model_shape
from fastgrpo.speculation.spec import SpecConfig
from fastgrpo.bench.simulate.acceptance import eagle_profile
from fastgrpo.bench.simulate.gpu import BUCKETS, GPU_MAX_BATCH, GPU_STATICS, bucket_name, run_policies, time_by_bucket
from fastgrpo.bench.simulate.workload import longtail_case, longtail_of

# the width gain of a tree over a chain (AcceptanceProfile.beta): our draft's fit in bench simulate's full run
# of 2026-11-26 (bench sglang-tiers takes the same). The full run's own fit moves with the draft checkpoint
# (bench/simulate.json gpu_acceptance.beta: 1.30 on that of 2026-12-01); held fixed here, so that this case's
# figures move with the code alone. The smaller favours trees less
GPU_BETA = 0.9
# the policies compared (the per-sequence budget's draft confidences are a further assumption of the simulator's:
# tools/per_sequence_sim.py measures what its draws add)
MODES = ("off", "fastgrpo", "tlt", "aware", "aware_expert_blind", "aware_per_sequence")
# aware_per_sequence again on static steps (a GPU's CUDA graphs): one verify width for every row, not a ragged verify
PER_SEQUENCE_STATIC = "aware_per_sequence_static"
# step prices shown beside the table: running rows and a tree at each, over 3,000 cached tokens per row
PRICE_POINTS = (1, 16, 128)
PRICE_CONTEXT = 3000


def choices_by_bucket(trace: list[tuple[float, int, str, int, float]]) -> dict[str, dict]:
    """Per concurrency bucket: decode steps, the share that speculated, and the three shapes run most."""
    out: dict[str, dict] = {}
    for lo, hi in BUCKETS:
        names = [name for _, running, name, _, _ in trace if lo <= running <= hi]
        if names:
            counts = Counter(names)
            out[bucket_name(lo, hi)] = {"steps": len(names), "spec_fraction": 1 - counts.get("off", 0) / len(names),
                                        "most_run": dict(counts.most_common(3))}
    return out


def step_prices(costs: Roofline, blind: Roofline) -> list[dict]:
    """Plain and tree steps at PRICE_POINTS rows over PRICE_CONTEXT cached tokens each (a tree's draft
    catching up on 4 states per row), priced with the experts a forward touches and expert-blind."""

    def price(r: Roofline, c: SpecConfig | None, B: int) -> float:
        ctx = PRICE_CONTEXT
        return r.decode_step(B, ctx, B * ctx) if c is None else r.spec_step(c, B, 4, ctx, B * ctx)

    out = []
    for B in PRICE_POINTS:
        for c in (None, SpecConfig(4, 4, 12), SpecConfig(6, 8, 48)):
            tokens = B * (1 if c is None else c.num_verify)
            out.append({"running": B, "step": "plain" if c is None else c.name, "tokens_verified": tokens,
                        "experts_read_per_layer": costs.model.experts_read(tokens),
                        "priced_ms": 1e3 * price(costs, c, B), "expert_blind_ms": 1e3 * price(blind, c, B)})
    return out


def bench_simulate_model(cfg, model: str, hardware: str, tensor: int, quick: bool, output: Path,
                         extra: list[str] | None = None) -> dict:
    from fastgrpo.bench.report import command_line, publish

    t0 = time.perf_counter()
    shape = load_model_shape(model, tp=tensor)
    costs = Roofline(ACCELERATORS[hardware], shape)
    accept = eagle_profile(GPU_BETA)
    lt = longtail_case(quick)
    workload = longtail_of(lt, cfg.seed)
    reps = 1 if quick else 3
    modes = (*MODES, *(f"static_{c.name}" for c in GPU_STATICS))
    res = run_policies(workload, costs, accept, GPU_STATICS, GPU_MAX_BATCH, reps, cfg.seed, modes=modes)
    res[PER_SEQUENCE_STATIC] = run_policies(workload, costs, accept, GPU_STATICS, GPU_MAX_BATCH, reps, cfg.seed,
                                            modes=("aware_per_sequence",), static_widths=True)["aware_per_sequence"]
    seconds = {m: r["seconds"] for m, r in res.items()}
    statics = {m: s for m, s in seconds.items() if m.startswith("static_")}
    best = min(statics, key=statics.get)
    for m in sorted(seconds, key=seconds.get):
        print(f"SIMULATED {costs.name} (TP{tensor}) {m}: {seconds[m]:.1f}s", flush=True)
    result = {
        "meta": {"date": datetime.date.today().isoformat(), "simulated": True, "quick": quick, "seed": cfg.seed,
                 "model": str(model), "shape": asdict(shape), "hardware": costs.hw.name, "tp": tensor,
                 "case": costs.name, "workload": workload.name, "longtail": lt, "max_running": GPU_MAX_BATCH,
                 "repetitions": reps, "acceptance": accept.to_json(), "moe": shape.moe},
        "seconds": seconds, "best_static": best[7:],
        "time_by_bucket": {m: time_by_bucket(res[m]["run"]) for m in (*MODES, PER_SEQUENCE_STATIC, best) if m in res},
        "choices": {m: choices_by_bucket(res[m]["run"].trace) for m in ("aware", "aware_expert_blind") if m in res},
        "spec_fraction": {m: res[m]["run"].spec_steps / max(res[m]["run"].decode_steps, 1) for m in res},
        "step_prices": step_prices(costs, Roofline(costs.hw, shape.blind())),
    }
    result["meta"]["seconds"] = time.perf_counter() - t0
    flags = [f"--model {model}", *([f"--hardware {hardware}"] if hardware != "h100" else []),
             *([f"--tensor {tensor}"] if tensor != 1 else [])]
    publish(result, output, command_line("simulate", quick, output, (extra or []) + flags), markdown)
    return result


def markdown(result: dict, command: str) -> str:
    m, s = result["meta"], result["seconds"]
    best = f"static_{result['best_static']}"
    aware = s["aware"]
    label = {"off": "`off`", "fastgrpo": "`fastgrpo`", "tlt": "`tlt`", "aware": "`aware`",
             "aware_expert_blind": "`aware`, expert-blind (priced as a dense model of the active size)",
             "aware_per_sequence": "`aware_per_sequence` (a ragged verify: each row its own nodes)",
             PER_SEQUENCE_STATIC: "`aware_per_sequence` on static steps (one verify width for every row)",
             best: f"best static tree ({result['best_static']})"}
    lines = [f"SIMULATED, not measured. `{command}` ({m['date']}; {m['case']} at TP{m['tp']}; {m['workload']}, "
             f"{m['longtail']['prompts']} prompts x {m['longtail']['group']}; at most {m['max_running']} running; "
             f"median of {m['repetitions']} rollouts per policy, learning ones after a warm-up rollout).", "",
             "| policy | rollout s (SIMULATED) | `aware` against it | share of steps speculative |",
             "| --- | ---: | ---: | ---: |"]
    for mode in ("off", "fastgrpo", "tlt", best, "aware_expert_blind", "aware", "aware_per_sequence",
                 PER_SEQUENCE_STATIC):
        if mode not in s:
            continue
        against = "" if mode == "aware" else f"{s[mode] / aware:.2f}x"
        lines.append(f"| {label[mode]} | {s[mode]:.1f} | {against} | {100 * result['spec_fraction'][mode]:.0f}% |")
    if result.get("step_prices"):
        lines += ["", f"Step prices (ms) at {PRICE_CONTEXT} cached tokens per row, with the experts a forward "
                  "touches / expert-blind:", "",
                  "| running | step | tokens verified | experts read per layer | priced ms | expert-blind ms |",
                  "| ---: | --- | ---: | ---: | ---: | ---: |"]
        for p in result["step_prices"]:
            lines.append(f"| {p['running']} | {p['step']} | {p['tokens_verified']} | "
                         f"{p['experts_read_per_layer']:.1f} | {p['priced_ms']:.2f} | {p['expert_blind_ms']:.2f} |")
    if result.get("choices"):
        lines += ["", "What `aware` ran, by running sequences (share of steps speculative; the shape run most):", "",
                  "| running | " + " | ".join(f"`{m}`" for m in result["choices"]) + " |",
                  "| --- | " + " | ".join("---" for _ in result["choices"]) + " |"]
        buckets = [bucket_name(lo, hi) for lo, hi in BUCKETS]
        for b in buckets:
            cells = []
            for per in result["choices"].values():
                c = per.get(b)
                cells.append("-" if c is None else f"{100 * c['spec_fraction']:.0f}%, {next(iter(c['most_run']))}")
            if any(cell != "-" for cell in cells):
                lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)

