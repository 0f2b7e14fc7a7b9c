"""`fastgrpo bench forward`: the policy's inference forward by shape and matmul kernel.

Speculation pays only if scoring several tokens per sequence costs little more than scoring one.
This measures exactly that, for B sequences x n new tokens over a cached context, with the engine's
two kernels (`dense`: the weights as loaded, `onednn`: packed copies), interleaved and repeated.
"""

from __future__ import annotations

import datetime
import statistics
import time
from pathlib import Path

import torch

from fastgrpo.bench.report import command_line, publish
from fastgrpo.bench.rollout import rotated
from fastgrpo.config import Config
from fastgrpo.engines.embedded.model import InferenceModel, KVCache
from fastgrpo.models.layers import onednn_available
from fastgrpo.models.sampling import sample, sampling_logprobs, sampling_uniforms
from fastgrpo.types import SamplingParams
from fastgrpo.models.policy import load_policy, num_parameters

SHAPES = ((1, 1), (1, 2), (1, 4), (1, 8), (1, 16), (4, 1), (4, 4), (16, 1), (16, 4), (64, 1), (64, 2))
CONTEXT = 128


def bench_forward(cfg: Config, quick: bool, output: Path, extra: list[str] | None = None) -> dict:
    policy = load_policy(cfg.model.path)
    kernels = ["dense"] + (["onednn"] if onednn_available() else [])
    models = {}
    for k in kernels:
        models[k] = InferenceModel(policy.config, CONTEXT + 64, kernel=k)
        models[k].load(policy.state_dict().items())
    cache = KVCache(policy.config, max(b for b, _ in SHAPES), CONTEXT + 64)
    reps = 5 if quick else 15
    rows = []
    for B, n in SHAPES:
        cache.lengths.fill_(CONTEXT)
        tokens = torch.randint(0, policy.config.vocab_size, (B, n))
        times: dict[str, list[float]] = {k: [] for k in kernels}
        for rep in range(reps + 1):  # the first round warms up
            for k in rotated(kernels, rep):
                t = time.perf_counter()
                models[k].forward(tokens, cache, slice(0, B))
                if rep:
                    times[k].append(time.perf_counter() - t)
        row = {"batch": B, "new_tokens": n} | {f"{k}_ms": 1000 * statistics.median(times[k]) for k in kernels}
        rows.append(row)
        print(f"B={B:3d} n={n:3d}: " + ", ".join(f"{k} {row[f'{k}_ms']:.1f} ms" for k in kernels), flush=True)
    result = {"meta": {"date": datetime.date.today().isoformat(), "threads": torch.get_num_threads(),
                       "torch": torch.__version__, "parameters": num_parameters(policy), "context": CONTEXT,
                       "reps": reps},
              "rows": rows, "sampling": sampling_cost(policy.config.vocab_size, reps, rows)}
    publish(result, output, command_line("forward", quick, output, extra), markdown)
    return result


def sampling_cost(vocab: int, reps: int, rows: list[dict]) -> list[dict]:
    """What choosing the tokens of one decode step costs: counter-based inverse-CDF sampling (the
    engine's, noise keyed by request and position) against torch.multinomial with a generator (what
    the engine used before), both from the same logits at temperature 1, interleaved."""
    p = SamplingParams(temperature=1.0)
    out = []
    for B in (1, 16, 64):
        logits = torch.randn(B, vocab)
        gen = torch.Generator().manual_seed(0)
        ways = {"counter": lambda: sample(sampling_logprobs(logits, p), p,
                                          sampling_uniforms(7, torch.arange(B), torch.full((B,), 5))),
                "multinomial": lambda: torch.multinomial(sampling_logprobs(logits, p).exp(), 1, generator=gen)}
        times: dict[str, list[float]] = {k: [] for k in ways}
        for rep in range(20 * reps + 1):
            for k in rotated(list(ways), rep):
                t = time.perf_counter()
                ways[k]()
                if rep:
                    times[k].append(time.perf_counter() - t)
        step = next(r["dense_ms"] for r in rows if r["batch"] == B and r["new_tokens"] == 1)
        row = {"batch": B} | {f"{k}_ms": 1000 * statistics.median(v) for k, v in times.items()} | {"decode_ms": step}
        out.append(row)
        print(f"sampling B={B}: counter {row['counter_ms']:.3f} ms, multinomial {row['multinomial_ms']:.3f} ms "
              f"(decode forward {step:.1f} ms)", flush=True)
    return out


def markdown(result: dict, command: str) -> str:
    m, rows = result["meta"], result["rows"]
    kernels = [k.removesuffix("_ms") for k in rows[0] if k.endswith("_ms")]
    one = {k: rows[0][f"{k}_ms"] for k in kernels}  # B=1, n=1
    lines = [f"Command: `{command}`", "",
             f"Date {m['date']}; {m['threads']} CPU threads, torch {m['torch']}; policy {m['parameters'] / 1e6:.1f}M "
             f"parameters, fp32, {m['context']} cached tokens; medians of {m['reps']} interleaved repetitions.", "",
             "| sequences | new tokens each | " + " | ".join(f"{k} ms | {k} / one token" for k in kernels) + " |",
             "| ---: | ---: | " + " | ".join("---: | ---:" for _ in kernels) + " |"]
    for r in rows:
        cells = " | ".join(f"{r[f'{k}_ms']:.1f} | {r[f'{k}_ms'] / one[k]:.2f}x" for k in kernels)
        lines.append(f"| {r['batch']} | {r['new_tokens']} | {cells} |")
    lines += ["", "Sampling the tokens of one decode step (temperature 1, medians of "
              f"{20 * m['reps']} interleaved repetitions), against the dense decode forward of the same batch:", "",
              "| sequences | counter-based ms | multinomial ms | counter-based / decode forward |",
              "| ---: | ---: | ---: | ---: |"]
    for r in result.get("sampling", []):
        lines.append(f"| {r['batch']} | {r['counter_ms']:.3f} | {r['multinomial_ms']:.3f} | "
                     f"{r['counter_ms'] / r['decode_ms']:.1%} |")
    return "\n".join(lines)


# -- `fastgrpo bench forward`: its sub-parser (fastgrpo/bench/command.py) --
def add_arguments(parser) -> None:
    """`fastgrpo bench forward`'s own flags (--quick, --output, --config and overrides are every benchmark's)."""
    parser.set_defaults(run=from_cli)


def from_cli(args, cfg) -> dict:
    return bench_forward(cfg, args.quick, args.output, extra=args.extra)
