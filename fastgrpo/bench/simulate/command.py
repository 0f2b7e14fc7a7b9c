"""bench simulate: the command."""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
from pathlib import Path

import torch

from fastgrpo.bench.rollout import STATIC_SWEEP
from fastgrpo.speculation.per_sequence import AwarePerSequence
from fastgrpo.speculation.policy import Aware, SpeculationPolicy, Static
from fastgrpo.speculation.roofline import ACCELERATORS, MODELS, Roofline
from fastgrpo.speculation.tlt import TLT
from fastgrpo.speculation.spec import SpecConfig
from fastgrpo.bench.simulate.acceptance import DraftConfidence, eagle_profile
from fastgrpo.bench.simulate.workload import longtail_case, longtail_of, resampled_workload
from fastgrpo.bench.simulate.profile import CpuProfiler
from fastgrpo.bench.simulate.validate import REPETITIONS, VALIDATION_REPLAYS, validate
from fastgrpo.bench.simulate.gpu import GPU_MAX_BATCH, RHO_SWEEP, gpu_fixed_concurrency, gpu_results, run_policies


def bench_simulate(cfg, quick: bool, output: Path, extra: list[str] | None = None, reps: int | None = None) -> dict:
    from fastgrpo.engines.embedded.build import build_engine, speculation_policy
    from fastgrpo.bench.report import command_line, publish
    from fastgrpo.models.policy import load_policy, num_parameters
    from fastgrpo.models.tokenizer import load_text_format
    from fastgrpo.tasks.source import held_out_prompt_ids

    def log(msg: str) -> None:
        print(msg, flush=True)

    t0 = time.perf_counter()
    policy, text = load_policy(cfg.model.path), load_text_format(cfg.model.path, cfg.task)
    policy.eval()
    # the draft is loaded for a static policy: no cached calibration is read or written here
    engine = build_engine(cfg, policy.config, text, policy.state_dict().items(), speculation="static")
    prompts = held_out_prompt_ids(cfg.task, text, cfg.model.max_context)
    sc = cfg.speculation
    static_cfg = SpecConfig(sc.depth, sc.topk, sc.num_verify)
    temperature, top_p = cfg.rollout.temperature, cfg.rollout.top_p
    # the cpu profile: the engine's calibration sweep and the engine's costs beyond it, measured in
    # this run: a whole pass first, then level passes amid the validation's runs; the engine's
    # `aware` gets the first pass's sweep (no cached calibration is read or written), the simulated
    # `aware` a simulated sweep of the cpu profile, as on any simulated machine
    profiler = CpuProfiler(engine, prompts, temperature, top_p, log)
    profiler.measure_pass()
    engine_policies: dict[str, SpeculationPolicy] = {m: speculation_policy(engine, cfg, m)
                                                      for m in ("off", "static", "fastgrpo")}
    engine_policies["aware"] = Aware(profiler.first_sweep)
    engine_policies["aware_per_sequence"] = AwarePerSequence(profiler.first_sweep)
    engine_policies |= {f"static_{c.name}": Static(c) for c in STATIC_SWEEP}
    engine_policies["tlt"] = TLT(seed=cfg.seed)

    reps = reps or REPETITIONS
    v = dict(levels=(1, 4, 16, 64), tokens=48 if quick else 128, n_prompts=4 if quick else 8, group=8,
             max_new=128 if quick else cfg.rollout.max_new_tokens)
    val = validate(engine, engine_policies, profiler, prompts, temperature, top_p, v["levels"], v["tokens"],
                   v["n_prompts"], v["group"], v["max_new"], cfg.model.max_context, reps, log, seed=cfg.seed,
                   static_cfg=static_cfg, replays=VALIDATION_REPLAYS)
    profiles = val.pop("_profiles")
    costs, cost_info = val.pop("_costs")

    # GPU scale: an EAGLE-3 acceptance profile (cited) with our draft's measured width gain
    accept = eagle_profile(profiles["grpo"].beta)
    lt = longtail_case(quick)
    n_prompts, group = lt["prompts"], lt["group"]
    groups = [val["grpo_lengths"][1][p * val["group"]:(p + 1) * val["group"]] for p in range(v["n_prompts"])]
    workloads = [
        resampled_workload(f"bench task (measured lengths, {n_prompts}x{group})", val["grpo_prompt_lens"], groups,
                           n_prompts, v["max_new"], cfg.model.max_context, cfg.seed),
        longtail_of(lt, cfg.seed),
    ]
    sim_reps = 1 if quick else 3
    results, detail = gpu_results(accept, workloads, sim_reps, cfg.seed, log)
    fixed = gpu_fixed_concurrency(accept, (1, 4, 16, 64, 128), 128 if quick else 512, lt["prompt_len"], cfg.seed)
    key = ("h100", "llama3-8b", workloads[1].name)
    # how much the per-sequence budget owes to the assumed informativeness of the draft's confidence
    sensitivity = []
    for rho in RHO_SWEEP:
        res = run_policies(workloads[1], Roofline(ACCELERATORS["h100"], MODELS["llama3-8b"]), accept, (), GPU_MAX_BATCH,
                           sim_reps, cfg.seed, DraftConfidence(rho), modes=("aware_per_sequence",))
        sensitivity.append({"rho": rho, "aware_per_sequence_s": res["aware_per_sequence"]["seconds"]})
        log(f"SIMULATED {' / '.join(key)}, rho {rho}: aware_per_sequence {sensitivity[-1]['aware_per_sequence_s']:.1f}s")
    running = {m: _downsample([(t, b) for t, b, _, _, _ in detail[key][m]["run"].trace]) for m in ("off", "tlt", "aware")}
    result = {
        "meta": {"date": datetime.date.today().isoformat(), "quick": quick, "cores": torch.get_num_threads(),
                 "torch": torch.__version__, "machine": platform.machine(),
                 "policy_parameters": num_parameters(policy), "temperature": temperature, "repetitions": reps,
                 "policy": cfg.model.path, "sft_steps": cfg.sft.examples // cfg.sft.batch_size,
                 "draft_steps": cfg.draft.pretrain_steps,
                 "validation_workloads": v, "gpu_max_batch": GPU_MAX_BATCH, "gpu_repetitions": sim_reps,
                 "longtail": lt},
        "cpu_costs": costs.to_json() | {"measurement": cost_info},
        "validation": val,
        "gpu_acceptance": accept.to_json(),
        "results": results,
        "fixed_concurrency": fixed,
        "running_over_time": {"case": " / ".join(key), "series": running},
        "per_sequence_rho": {"case": " / ".join(key), "assumed": DraftConfidence().rho, "aware_s": detail[key]["aware"]["seconds"],
                             "sweep": sensitivity},
    }
    result["meta"]["seconds"] = time.perf_counter() - t0
    command = command_line("simulate", quick, output, (extra or []) + ([f"--repetitions {reps}"] if reps != REPETITIONS else []))
    publish(result, output, command, markdown, plot=lambda path: plot_all(result, path))
    output.with_suffix(".md").write_text(markdown(result, command) + "\n")  # the section, for BENCHMARKS.md
    return result


def _downsample(series: list, points: int = 2000) -> list:
    """At most about `points` entries, the last one kept (a plot needs no more)."""
    step = max(1, len(series) // points)
    return series[::step] + ([series[-1]] if series and (len(series) - 1) % step else [])


def plot_all(result: dict, path: Path) -> None:
    """Rollout time per policy (the main PNG), the running batch over time and time by concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = ("off", "static_best", "fastgrpo", "tlt", "aware")
    rows = result["results"]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.16
    for j, m in enumerate(modes):
        ax.bar([i + (j - 2) * width for i in range(len(rows))], [r["off_s"] / r[f"{m}_s"] for r in rows], width, label=m)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{r['hardware']}\n{r['model']}\n{r['workload'][:18]}" for r in rows], fontsize=6)
    ax.axhline(1.0, color="k", lw=0.5)
    ax.set_ylabel("speed-up over off (rollout time of off / policy)")
    ax.set_title("SIMULATED: GRPO-batch rollout time per speculation policy")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for m, series in result["running_over_time"]["series"].items():
        ax.step([t for t, _ in series], [b for _, b in series], where="post", label=m)
    ax.set_xlabel("simulated seconds")
    ax.set_ylabel("running sequences")
    ax.set_title(f"SIMULATED: running batch over time\n{result['running_over_time']['case']}", fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path.with_name(path.stem + "-running.png"), dpi=120)
    plt.close(fig)

    row = next(r for r in rows if r["hardware"] == "H100 SXM" and "8B" in r["model"] and "long-tail" in r["workload"])
    fig, ax = plt.subplots(figsize=(6, 4))
    parts = list(next(iter(row["time_by_bucket"].values())))
    bottom = [0.0] * len(row["time_by_bucket"])
    names = list(row["time_by_bucket"])
    for part in parts:
        vals = [row["time_by_bucket"][m][part] for m in names]
        ax.bar(names, vals, bottom=bottom, label=part if part == "prefill" else f"running {part}")
        bottom = [b + x for b, x in zip(bottom, vals)]
    ax.set_ylabel("simulated seconds")
    ax.set_title(f"SIMULATED: where the rollout's time goes, by running sequences\n{row['hardware']} / {row['model']}, "
                 "long-tail workload", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path.with_name(path.stem + "-buckets.png"), dpi=120)
    plt.close(fig)

    val = result["validation"]
    fig, ax = plt.subplots(figsize=(5, 5))
    keys = list(val["cpu_measured_s"])
    xs, ys = [val["cpu_measured_s"][k] for k in keys], [val["cpu_predicted_s"][k] for k in keys]
    ax.scatter(xs, ys, s=12)
    lim = (min(xs + ys) * 0.8, max(xs + ys) * 1.2)
    ax.plot(lim, lim, "k", lw=0.5)
    ax.fill_between(lim, [x * 0.9 for x in lim], [x * 1.1 for x in lim], alpha=0.15, label="within 10%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured seconds (engine, this CPU)")
    ax.set_ylabel("predicted seconds (simulator, cpu profile)")
    ax.set_title("Validation: simulator against the engine (measured)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path.with_name(path.stem + "-validation.png"), dpi=120)
    plt.close(fig)


def _noise_summary(error: dict[str, float], se: dict[str, float]) -> str:
    """How the misses compare with the measured medians' own noise."""
    ses = sorted(se.values())
    beyond = [k for k, e in error.items() if abs(e) > 0.10 + 2 * se[k]]
    return (f" The measured medians' own standard error (bootstrap over each case's repetitions) is "
            f"{100 * statistics.median(ses):.1f}% (median case) to {100 * ses[-1]:.1f}%; "
            f"{len(beyond)} case(s) miss 10% by more than two of their standard errors"
            + (f" ({', '.join(beyond)})." if beyond else ".")
            + " The profile's own noise (its runs at the same shapes) is not in these standard errors.")


def markdown(result: dict, command: str) -> str:
    m, val = result["meta"], result["validation"]
    v, reps = m["validation_workloads"], m["repetitions"]
    stem = Path(command.split("--output")[-1].strip()).stem if "--output" in command else "simulate"
    runs = next(iter(val.get("runs", {}).values()), None)  # older results: one replay, no counts
    replayed = f", replayed {runs['simulated'] // runs['engine']} times with fresh policies, median over all" if runs else ""
    lines = [f"Command: `{command}`", "",
             f"Date {m['date']}; {m['cores']} CPU threads ({m['machine']}), torch {m['torch']}; policy "
             f"`{m.get('policy', '?')}` ({m['policy_parameters'] / 1e6:.1f}M parameters, {m.get('sft_steps', '?')} SFT "
             f"steps; its draft {m.get('draft_steps', '?')} warm-start steps); temperature {m['temperature']}.", "",
             "### Validation: the simulator against the engine on this CPU (measured and predicted)", "",
             f"The engine (medians of interleaved repetitions after a warm-up) and the simulator "
             f"(same protocol{replayed}, cpu profile: the engine's calibration sweep plus the step, prefill and loop costs "
             f"measured on other workloads, in passes amid each validation workload's repetitions at its rows, "
             f"with the tree shapes the policies ran; acceptance measured on "
             f"the engine in these runs, per workload). Fixed concurrency: {v['tokens']} tokens per sequence, EOS "
             f"ignored (runs of B sequences repeated max({2 * reps}, {16 * reps} / B) times); GRPO batch: {v['n_prompts']} "
             f"prompts x {v['group']}, the policy's own lengths (max {v['max_new']}), {2 * reps} repetitions. Where each error arises: "
             "*profile* is the profile pricing the engine's own runs step by step at the shapes they ran (its "
             "cost model alone), *trajectory* the simulated runs against those priced runs (the policies' "
             "decisions and the acceptance draws).", "",
             "| case | measured s (median) | its standard error | measured s (fastest - slowest) | predicted s | error "
             "| error against the fastest | profile | trajectory |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    se = val.get("cpu_measured_median_se", {})  # older results: none
    mins = val.get("cpu_measured_min_s", val["cpu_measured_s"])
    err_min = {k: val["cpu_predicted_s"][k] / mins[k] - 1 for k in val["cpu_measured_s"]}
    split = val.get("breakdown", {})
    for k in val["cpu_measured_s"]:
        b = split.get(k)
        parts = "- | - |" if b is None else f"{100 * b['priced_error']:+.1f}% | {100 * b['trajectory_error']:+.1f}% |"
        slowest = val.get("cpu_measured_spread_s", {}).get(k, [None, None])[1]
        lines.append(f"| {k} | {val['cpu_measured_s'][k]:.3g} | " + (f"{100 * se[k]:.1f}%" if k in se else "-")
                     + f" | {mins[k]:.3g}"
                     + ("" if slowest is None else f" - {slowest:.3g}") + f" | {val['cpu_predicted_s'][k]:.3g} | "
                     f"{100 * val['error'][k]:+.1f}% | {100 * err_min[k]:+.1f}% | " + parts)
    within = sum(abs(e) <= 0.10 for e in val["error"].values())
    within_min = sum(abs(e) <= 0.10 for e in err_min.values())
    lines += ["", f"{within} of {len(val['error'])} cases within 10% of the median (largest error "
              f"{100 * val['max_abs_error']:.1f}%); {within_min} within 10% of the fastest repetition (largest "
              f"{100 * max(map(abs, err_min.values())):.1f}%)."
              + (f" The profile prices the engine's own runs within {100 * max(abs(b['priced_error']) for b in split.values()):.1f}% in every case."
                 if split else "") + (_noise_summary(val["error"], se) if se else ""),
              "", f"![SIMULATED vs measured]({stem}-validation.png)", "",
              "### SIMULATED: GRPO-batch rollout at GPU scale", "",
              "Every number in this section is SIMULATED (stated cost model, cited acceptance profile: "
              f"{result['gpu_acceptance']['source']}; what width adds from our draft's fit, beta "
              f"{result['gpu_acceptance']['beta']:.2f}). Validation errors of the instrument: above "
              f"(largest {100 * val['max_abs_error']:.1f}%).", "",
              "| hardware | model | workload | off s | best static s | fastgrpo s | tlt s | aware s | aware / off | "
              "aware / fastgrpo | aware / tlt | aware / best static | per-sequence s | per-sequence / aware |",
              "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["results"]:
        a = r["aware_s"]
        ps = r.get("aware_per_sequence_s")
        lines.append(f"| {r['hardware']} | {r['model']} | {r['workload']} | {r['off_s']:.3g} | {r['static_best_s']:.3g} "
                     f"({r['static_best']}) | {r['fastgrpo_s']:.3g} | {r['tlt_s']:.3g} | {a:.3g} | "
                     f"{r['off_s'] / a:.2f}x | {r['fastgrpo_s'] / a:.2f}x | {r['tlt_s'] / a:.2f}x | "
                     f"{r['static_best_s'] / a:.2f}x | " + ("- | - |" if ps is None else f"{ps:.3g} | {a / ps:.2f}x |"))
    if "per_sequence_rho" in result:
        rho = result["per_sequence_rho"]
        lines += ["", f"The per-sequence budget's draft confidences are SIMULATED with informativeness rho = "
                  f"{rho['assumed']} (an assumption: `DraftConfidence`). On {rho['case']}, per-sequence / aware by rho: "
                  + ", ".join(f"{x['rho']}: {rho['aware_s'] / x['aware_per_sequence_s']:.2f}x" for x in rho["sweep"])
                  + "."]
    lines += ["", f"![SIMULATED rollout time per policy]({stem}.png)",
              f"![SIMULATED running batch over time]({stem}-running.png)",
              f"![SIMULATED time by concurrency]({stem}-buckets.png)", "",
              "SIMULATED fixed concurrency (mean seconds of each cell's runs: aware / off, the others / off, and "
              "aware / the best static tree by its mean, with the standard error of the per-run ratios):", "",
              "| hardware | model | running | runs | aware / off | best static / off | fastgrpo / off | tlt / off | "
              "per-sequence / off | aware / best static (SE) |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["fixed_concurrency"]:
        over = {m: r["off_s"] / r[f"{m}_s"] for m in ("aware", "static_best", "fastgrpo", "tlt", "aware_per_sequence")}
        lines.append(f"| {r['hardware']} | {r['model']} | {r['running']} | {r['seeds']} | {over['aware']:.2f}x | "
                     f"{over['static_best']:.2f}x ({r['static_best']}) | {over['fastgrpo']:.2f}x | "
                     f"{over['tlt']:.2f}x | {over['aware_per_sequence']:.2f}x | "
                     f"{r['aware_over_best_static']:.3f}x ({r['aware_over_best_static_se']:.3f}) |")
    return "\n".join(lines)


# -- `fastgrpo bench simulate`: its sub-parser (fastgrpo/bench/command.py) --
class _ModelOnly(argparse.Action):
    """--model PATH: store it, and tell `fastgrpo bench` to build the config alone (the run simulates a GPU
    only: no policy, no draft, no CPU validation)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.needs = "config"


def add_arguments(parser) -> None:
    """`fastgrpo bench simulate`'s own flags (--quick, --output, --config and overrides are every benchmark's)."""
    from fastgrpo.bench.command import at_least_one

    parser.add_argument("--repetitions", type=at_least_one, help="the validation's repetitions R (default 3): a "
                        "fixed-concurrency workload of B sequences runs max(2R, 16R/B) times, the GRPO batch 2R, and "
                        "the profile's passes amid them scale with R")
    parser.add_argument("--model", action=_ModelOnly, help="a Hugging Face config.json (configs/models/*.json, dense "
                        "or Qwen3-MoE): simulate only the long-tail GPU case for that shape (seconds, no CPU "
                        "validation; written to bench/simulate-<its stem>.json unless --output names another file); a MoE also "
                        "runs aware priced expert-blind")
    parser.add_argument("--hardware", choices=sorted(ACCELERATORS), default="h100", help="with --model: the GPU")
    parser.add_argument("--tensor", "--tp", dest="tensor", type=at_least_one, default=1,
                        help="with --model: tensor-parallel GPUs (the config's parallel.tensor; --tp the same)")
    parser.set_defaults(run=from_cli)


def from_cli(args, cfg) -> dict:
    from fastgrpo.bench.command import BenchUsageError

    if args.model is not None:
        from fastgrpo.bench.simulate.shape import bench_simulate_model

        if args.repetitions:
            raise BenchUsageError("`bench simulate`: --repetitions is the CPU validation's, which --model does not run")
        if args.output == Path("bench/simulate.json"):  # the full run's file: a model's run goes beside it
            args.output = Path(f"bench/simulate-{Path(args.model).stem}.json")
        return bench_simulate_model(cfg, args.model, args.hardware, args.tensor, args.quick, args.output, args.extra)
    if args.hardware != "h100" or args.tensor != 1:
        raise BenchUsageError("`bench simulate`: --hardware and --tensor go with --model")
    return bench_simulate(cfg, args.quick, args.output, args.extra, args.repetitions)
