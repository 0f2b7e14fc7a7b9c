"""`fastgrpo bench rollout`: speculation modes compared in one process, interleaved, repeated.

Workloads: (a) fixed concurrency (B sequences kept running for a fixed number of tokens, EOS
ignored); (b) a GRPO-shaped batch (prompts x G samples of the reasoning task at the rollout
temperature, with the policy's real long-tailed lengths). Peers: Hugging Face `generate` with a static
cache; the memory-bandwidth bound of a batch-1 decode step.
"""

from __future__ import annotations

import datetime
import platform
import statistics
import time
from pathlib import Path

import torch
from transformers import PreTrainedModel

from fastgrpo.engines.embedded.build import build_engine, speculation_policy
from fastgrpo.types import SamplingParams, Request
from fastgrpo.bench.report import command_line, publish
from fastgrpo.config import Config
from fastgrpo.device import cpu_description
from fastgrpo.engines.embedded.engine import EmbeddedEngine
from fastgrpo.models.policy import load_policy, num_parameters
from fastgrpo.models.tokenizer import load_text_format
from fastgrpo.speculation.policy import Static
from fastgrpo.speculation.spec import SpecConfig
from fastgrpo.tasks.source import held_out_prompt_ids

MODES = ("off", "static", "fastgrpo", "aware", "aware_per_sequence")
UNSHARED = "off_unshared_prefill"
STATIC_SWEEP = (SpecConfig(2, 2, 4), SpecConfig(3, 4, 8), SpecConfig(4, 4, 12), SpecConfig(5, 8, 24))


def timed_generate(engine: EmbeddedEngine, requests: list[Request], sampling: SamplingParams,
                   seed: int) -> dict[str, float]:
    t = time.perf_counter()
    out = engine.generate(requests, sampling, seed=seed)
    seconds = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in out)
    stats = engine.stats()
    return {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds, "accept_len": stats["accept_len"],
            "spec_fraction": stats["spec_steps"] / max(stats["decode_steps"], 1), "prefill_s": stats["prefill_s"],
            "decode_steps": stats["decode_steps"], "static_steps": stats["static_steps"],
            "pad_row_share": stats["pad_row_share"], "pad_kv_share": stats["pad_kv_share"], "policy_s": stats["policy_s"],
            "trace": stats["trace"], "lengths": [len(o.token_ids) for o in out]}


def padding(rs: list[dict]) -> dict[str, float]:
    """Medians over calls: the share of decode steps that ran static (graph replays on a GPU), of the token
    slots their target forwards computed in padded rows, and of the cache positions attention read beyond
    each row's own (EngineStats): what static shapes cost in work, whatever the hardware."""
    return {"static_share": statistics.median(r.get("static_steps", 0) / max(r.get("decode_steps", 0), 1) for r in rs),
            "pad_row_share": statistics.median(r.get("pad_row_share", 0.0) for r in rs),
            "pad_kv_share": statistics.median(r.get("pad_kv_share", 0.0) for r in rs)}


WARMUP_STEPS = 4  # decode steps of a generate() call not counted in the per-step time
SHARES = ("prefill", "running <= 4", "running 5-16", "running 17-32", "running 33-64", "other")


def time_shares(r: dict) -> dict[str, float]:
    """Fractions of a generate() call's time spent in prefill and in decode steps by how many
    sequences were running (the steps speculation can speed up are the ones with few running)."""
    shares = dict.fromkeys(SHARES, 0.0)
    shares["prefill"] = r["prefill_s"]
    for running, _, _, seconds in r["trace"]:
        key = next((k for k, hi in (("running <= 4", 4), ("running 5-16", 16), ("running 17-32", 32),
                                    ("running 33-64", 64)) if running <= hi), "other")
        shares[key] += seconds
    shares["other"] += max(r["seconds"] - sum(shares.values()), 0.0)  # between steps: retiring, scheduling
    return {k: v / r["seconds"] for k, v in shares.items()}


def rotated(items: list, rep: int) -> list:
    """The modes in a different order each repetition, so that none always runs right after another
    (caches, allocator and a shared machine's slow spells would otherwise favour some position)."""
    k = rep % len(items)
    return items[k:] + items[:k]


def _median(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _modes(engine: EmbeddedEngine, cfg: Config) -> dict[str, object]:
    """One policy object per mode, kept across repetitions (aware keeps what it learned, as in training)."""
    return {mode: speculation_policy(engine, cfg, mode) for mode in MODES}


def concurrency_sweep(engine, policies, prompts, cfg, levels, tokens, reps, log) -> list[dict]:
    rows = []
    sampling = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                              max_new_tokens=tokens, ignore_eos=True)
    for B in levels:
        requests = [Request(prompts[i % len(prompts)], max_new_tokens=tokens) for i in range(B)]
        runs: dict[str, list] = {m: [] for m in policies}
        for rep in range(reps + 1):  # rep 0 warms up (and teaches aware its acceptance rates)
            for mode, policy in rotated(list(policies.items()), rep):
                engine.set_speculation(policy)
                r = timed_generate(engine, requests, sampling, seed=1000 * rep + B)
                if rep:
                    runs[mode].append(r)
        row = {"concurrency": B}
        for mode in policies:
            row[f"{mode}_tok_s"] = _median(runs[mode], "tok_s")
            row[f"{mode}_accept_len"] = _median(runs[mode], "accept_len")
            row[f"{mode}_spec_fraction"] = _median(runs[mode], "spec_fraction")
        rows.append(row)
        log(f"concurrency {B:3d}: " + ", ".join(f"{m} {row[f'{m}_tok_s']:.0f} tok/s" for m in policies)
            + f" | aware accept {row['aware_accept_len']:.2f}")
    return rows


def grpo_batch(engine, policies, prompts, cfg, n_prompts, group, max_new, reps, log) -> dict:
    requests = [Request(p) for p in prompts[:n_prompts] for _ in range(group)]
    sampling = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, max_new_tokens=max_new)
    contenders = dict(policies) | {f"static_{c.depth}_{c.topk}_{c.num_verify}": Static(c) for c in STATIC_SWEEP}
    contenders[UNSHARED] = policies["off"]  # plain decoding with every sample prefilling its own prompt
    runs: dict[str, list] = {m: [] for m in contenders}
    for rep in range(reps + 1):
        for mode, policy in rotated(list(contenders.items()), rep):
            engine.set_speculation(policy)
            engine.share_prefill = mode != UNSHARED
            r = timed_generate(engine, requests, sampling, seed=77 + rep)
            if rep:
                runs[mode].append(r | {"shares": time_shares(r)})
    engine.share_prefill = True
    med = {m: _median(runs[m], "seconds") for m in contenders}
    statics = {m: s for m, s in med.items() if m.startswith("static")}
    best_static = min(statics, key=statics.get)
    result = {"off_s": med["off"], "static_best_s": med[best_static], "static_best": best_static,
              "fastgrpo_s": med["fastgrpo"], "aware_s": med["aware"], "off_unshared_prefill_s": med[UNSHARED],
              "aware_per_sequence_s": med["aware_per_sequence"],
              "aware_accept_len": _median(runs["aware"], "accept_len"),
              "tokens_median": {m: _median(runs[m], "tokens") for m in contenders}, "all_s": med,
              "padding": {m: padding(runs[m]) for m in contenders},
              # the shares of each mode's median-time repetition (medians of each part would not add up to 1)
              "time_shares": {m: sorted(runs[m], key=lambda r: r["seconds"])[len(runs[m]) // 2]["shares"]
                              for m in ("off", "aware")}}
    log("GRPO batch: " + ", ".join(f"{m} {s:.1f}s" for m, s in med.items()))
    return result


def hf_generate_seconds(policy: PreTrainedModel, ids: torch.Tensor, tokens: int) -> float:
    """One Hugging Face `generate` call (static cache, sampling, exactly `tokens` new tokens per row)."""
    t = time.perf_counter()
    with torch.inference_mode():
        policy.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                        do_sample=True, top_k=0, cache_implementation="static", pad_token_id=0)
    return time.perf_counter() - t


def hf_generate(policy: PreTrainedModel, engine: EmbeddedEngine, prompt: list[int], tokens: int, reps: int,
                log) -> dict:
    """Tokens/s of HF `generate` (static cache, sampling) and of the engine without speculation."""
    out: dict[str, float] = {}
    steps: list[float] = []
    prefill: list[float] = []
    for B in (1, 64):
        ids = torch.tensor([prompt] * B)
        hf, ours = [], []
        for rep in range(reps + 1):
            hf_s = hf_generate_seconds(policy, ids, tokens)
            r = timed_generate(engine, [Request(prompt, max_new_tokens=tokens)] * B,
                     SamplingParams(temperature=1.0, max_new_tokens=tokens, ignore_eos=True), seed=rep)
            if rep:
                hf.append(B * tokens / hf_s)
                ours.append(r["tok_s"])
                if B == 1:  # the decode step itself, after the first few (warm-up), and prefill apart
                    steps += [step[3] for step in r["trace"][WARMUP_STEPS:]]
                    prefill.append(r["prefill_s"])
        out[f"batch{B}_tok_s"] = statistics.median(hf)
        out[f"engine_batch{B}_tok_s"] = statistics.median(ours)
        if B == 1:
            out["engine_batch1_step_ms"] = 1000 * statistics.median(steps)
            out["engine_batch1_prefill_ms"] = 1000 * statistics.median(prefill)
        log(f"HF generate batch {B}: {out[f'batch{B}_tok_s']:.0f} tok/s; engine: {out[f'engine_batch{B}_tok_s']:.0f} tok/s")
    return out


def bandwidth_bound(policy: PreTrainedModel, batch1_step_ms: float, reps: int = 5) -> dict:
    """Memory bandwidth from a large copy; a batch-1 decode step must read every weight once."""
    n = 64 * 1024 * 1024  # 256 MB of fp32
    src, dst = torch.randn(n), torch.empty(n)
    times = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    bw = 2 * n * 4 / statistics.median(times[1:]) / 1e9  # read + write
    weight_bytes = num_parameters(policy) * 4
    return {"bandwidth_gb_s": bw, "weight_mb": weight_bytes / 1e6, "batch1_step_ms": batch1_step_ms,
            "batch1_bound_ms": weight_bytes / (bw * 1e9) * 1000}


def plot_sweep(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["concurrency"] for r in rows]
    for mode in MODES:
        ax.plot(xs, [r[f"{mode}_tok_s"] for r in rows], marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("running sequences")
    ax.set_ylabel("generated tokens / s")
    ax.set_title("Rollout throughput by speculation mode (bench policy, CPU)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def bench_rollout(cfg: Config, quick: bool, output: Path, extra: list[str] | None = None,
                  repetitions: int = 3) -> dict:
    """Every mode at each concurrency and on a GRPO batch, HF `generate` and the bandwidth bound: each
    figure the median of `repetitions` timed calls after a warm-up call."""
    def log(msg: str) -> None:
        print(msg, flush=True)

    policy, text = load_policy(cfg.model.path), load_text_format(cfg.model.path, cfg.task)
    policy.eval()
    engine = build_engine(cfg, policy.config, text, policy.state_dict().items(), speculation="aware")
    policies = _modes(engine, cfg)
    prompts = held_out_prompt_ids(cfg.task, text, cfg.model.max_context)
    if repetitions < 1:
        raise ValueError(f"--repetitions must be >= 1, got {repetitions}")
    reps = repetitions
    tokens = 48 if quick else 128
    t0 = time.perf_counter()
    result = {
        "meta": {"date": datetime.date.today().isoformat(), "quick": quick, "cores": torch.get_num_threads(),
                 "torch": torch.__version__, "machine": platform.machine(), "cpu": cpu_description(),
                 "policy_parameters": num_parameters(policy),
                 "tokens_per_sequence": tokens, "repetitions": reps, "temperature": cfg.rollout.temperature},
        "sweep": concurrency_sweep(engine, policies, prompts, cfg, (1, 4, 16, 64), tokens, reps, log),
        "grpo_batch": grpo_batch(engine, policies, prompts, cfg, 4 if quick else 8, 8,
                                 128 if quick else cfg.rollout.max_new_tokens, reps, log),
    }
    engine.set_speculation(policies["off"])
    result["hf_generate"] = hf_generate(policy, engine, prompts[0], tokens, reps, log)
    result["bound"] = bandwidth_bound(policy, result["hf_generate"]["engine_batch1_step_ms"])
    result["meta"]["seconds"] = time.perf_counter() - t0
    flags = [f"--repetitions {reps}"] if reps != 3 else []
    publish(result, output, command_line("rollout", quick, output, (extra or []) + flags), markdown,
            plot=lambda path: plot_sweep(result["sweep"], path))
    return result


def markdown(result: dict, command: str) -> str:
    """The BENCHMARKS.md section for one run: command, machine, tables with ratios."""
    m, sw, g, hf, b = result["meta"], result["sweep"], result["grpo_batch"], result["hf_generate"], result["bound"]
    lines = [f"Command: `{command}`", "",
             f"Date {m['date']}; {m['cores']} CPU threads ({m['machine']}; {m.get('cpu', 'CPU not recorded')}), "
             f"torch {m['torch']}; policy "
             f"{m['policy_parameters'] / 1e6:.1f}M parameters, fp32; temperature {m['temperature']}; "
             f"medians of {m['repetitions']} interleaved repetitions after a warm-up.", "",
             f"Fixed concurrency ({m['tokens_per_sequence']} tokens per sequence, EOS ignored), tokens/s:", "",
             "| running | off | static | fastgrpo | aware | aware / off | aware accept len | aware speculative steps "
             "| aware per sequence | per sequence / aware |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in sw:
        ps = r.get("aware_per_sequence_tok_s")
        lines.append(f"| {r['concurrency']} | {r['off_tok_s']:.0f} | {r['static_tok_s']:.0f} | {r['fastgrpo_tok_s']:.0f} "
                     f"| {r['aware_tok_s']:.0f} | {r['aware_tok_s'] / r['off_tok_s']:.2f}x | {r['aware_accept_len']:.2f} "
                     f"| {100 * r['aware_spec_fraction']:.0f}% | "
                     + ("- | - |" if ps is None else f"{ps:.0f} | {ps / r['aware_tok_s']:.2f}x |"))
    ps = g.get("aware_per_sequence_s")
    lines += ["", "GRPO-shaped batch (prompts x 8 samples, real lengths), seconds:", "",
              "| off | best static | fastgrpo | aware | off / aware | best static / aware | fastgrpo / aware "
              "| aware per sequence | aware / per sequence |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
              f"| {g['off_s']:.2f} | {g['static_best_s']:.2f} ({g['static_best']}) | {g['fastgrpo_s']:.2f} | "
              f"{g['aware_s']:.2f} | {g['off_s'] / g['aware_s']:.2f}x | {g['static_best_s'] / g['aware_s']:.2f}x | "
              f"{g['fastgrpo_s'] / g['aware_s']:.2f}x | "
              + ("- | - |" if ps is None else f"{ps:.2f} | {g['aware_s'] / ps:.2f}x |"),
              "", f"Prefill of a prompt shared by its 8 samples: `off` takes {g['off_s']:.2f} s with it and "
              f"{g['off_unshared_prefill_s']:.2f} s with every sample prefilling its own copy "
              f"({g['off_unshared_prefill_s'] / g['off_s']:.2f}x).",
              "", "Where the GRPO batch's time goes (fractions of the whole call, in the median-time repetition):", "",
              "| mode | " + " | ".join(SHARES) + " |", "| --- |" + " ---: |" * len(SHARES)]
    for mode, shares in g["time_shares"].items():
        lines.append(f"| {mode} | " + " | ".join(f"{100 * shares[k]:.0f}%" for k in SHARES) + " |")
    if pad := g.get("padding"):
        lines += ["", "What the GRPO batch's decode steps computed beyond their rows' needs (medians over the calls; "
                  "static steps run their batch's bucket of rows and context):", "",
                  "| mode | steps static | token slots in padded rows | cache positions read beyond each row's own |",
                  "| --- | ---: | ---: | ---: |"]
        lines += [f"| {m} | {100 * p['static_share']:.0f}% | {100 * p['pad_row_share']:.1f}% | "
                  f"{100 * p['pad_kv_share']:.1f}% |" for m, p in pad.items()]
    lines += ["", "Engine without speculation against Hugging Face `generate` (static cache), tokens/s:", "",
              "| batch | HF generate | engine | engine / HF |", "| ---: | ---: | ---: | ---: |"]
    for B in (1, 64):
        lines.append(f"| {B} | {hf[f'batch{B}_tok_s']:.0f} | {hf[f'engine_batch{B}_tok_s']:.0f} | "
                     f"{hf[f'engine_batch{B}_tok_s'] / hf[f'batch{B}_tok_s']:.2f}x |")
    lines += ["", f"Memory bandwidth {b['bandwidth_gb_s']:.1f} GB/s (256 MB copy); weights {b['weight_mb']:.0f} MB; "
              f"batch-1 decode step {b['batch1_step_ms']:.1f} ms (median of the timed steps after the first "
              f"{WARMUP_STEPS}; prefill of the prompt apart: {hf['engine_batch1_prefill_ms']:.1f} ms) against a bound "
              f"of {b['batch1_bound_ms']:.1f} ms ({b['batch1_step_ms'] / b['batch1_bound_ms']:.2f}x the bound)."]
    return "\n".join(lines)


# -- `fastgrpo bench rollout`: its sub-parser (fastgrpo/bench/command.py) --
def add_arguments(parser) -> None:
    """`fastgrpo bench rollout`'s own flags (--quick, --output, --config and overrides are every benchmark's)."""
    from fastgrpo.bench.command import at_least_one

    parser.add_argument("--repetitions", type=at_least_one, default=3,
                        help="timed calls per figure, after a warm-up call (default 3; each figure is their median)")
    parser.set_defaults(run=from_cli)


def from_cli(args, cfg) -> dict:
    return bench_rollout(cfg, args.quick, args.output, extra=args.extra, repetitions=args.repetitions)
