"""`fastgrpo bench replay`: routing replay for a mixture of experts, what it fixes and what it costs,
on each trainer.

A random-weight Qwen3-MoE at the bench policy's sizes (`bench.trainer.moe_policy`: 6 layers of 8
experts, top-2) rolls out a GRPO batch on a bf16 embedded engine that records each token's experts,
and each trainer (torch, Megatron, DeepSpeed ZeRO-3; fp32, a world of one process each) takes the
same batch with `trainer.routing_replay` off and `rollout`:

- what replay fixes: the step's `routing_mismatch` (the share of the engine's expert picks the
  trainer's router would have changed) and `kl_engine_trainer`, and the largest and mean gap between
  the trainer's log-probability of each sampled token and the engine's, before the step;
- what it costs: the batch's routing record (2 bytes a (token, sparse layer, slot): `models/routing.
  bytes_per_token`), the rollout with the record against without (interleaved, the record forces
  eager steps), and the train step with replay against without (interleaved after a warm-up step of
  each; the ratio per pair, its mean and standard error, and both medians).

The mismatch depends on the model (its experts, top-k, how close its routers' logits run); R3 (arXiv
2510.11370) reports about 10% of picks on Qwen3-30B-A3B. What this measures is what replay removes on
every trainer, and what it costs.
"""

from __future__ import annotations

import dataclasses
import datetime
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fastgrpo.bench.report import command_line, publish
from fastgrpo.config import Config, with_overrides
from fastgrpo.local_world import run_world

TRAINERS = {"torch": ["trainer.backend=torch"], "megatron": ["trainer.backend=megatron"],
            "deepspeed ZeRO-3": ["trainer.backend=deepspeed", "deepspeed.zero_stage=3"]}
GROUP = 4  # samples of each prompt


def rollouts(policy: Path, prompts: int, new_tokens: int, reps: int, max_context: int) -> tuple[object, dict]:
    """The batch a bf16 embedded engine samples (GROUP answers to each of `prompts` prompts, routing
    recorded), and the rollout's seconds with and without the record, interleaved `reps` times."""
    from fastgrpo.engines.embedded.engine import EmbeddedEngine
    from fastgrpo.grpo.batch import build_batch
    from fastgrpo.models.policy import load_policy
    from fastgrpo.types import Request, SamplingParams

    model = load_policy(policy)
    engine = EmbeddedEngine(model.config, prompts * GROUP, max_context, eos_id=-1, pad_id=0, dtype=torch.bfloat16)
    engine.update_weights(model.state_dict().items(), version=0)
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(5, model.config.vocab_size, (12 + i % 7,), generator=gen).tolist() for i in range(prompts)]
    requests = [Request(p, key=i * GROUP + j) for i, p in enumerate(ids) for j in range(GROUP)]
    sampling = SamplingParams(max_new_tokens=new_tokens)
    seconds: dict[bool, list[float]] = {False: [], True: []}
    out = None
    for _ in range(reps + 1):  # the first pair warms up
        for routing in (False, True):
            t = time.perf_counter()
            completions = engine.generate(requests, sampling, seed=1, routing=routing)
            seconds[routing].append(time.perf_counter() - t)
            out = completions if routing else out
    advantages = torch.linspace(-1, 1, len(requests))
    batch = build_batch([r.prompt_ids for r in requests], [c.token_ids for c in out], [c.logprobs for c in out],
                        advantages, routing=[c.routing for c in out])
    return batch, {"plain_s": seconds[False][1:], "recorded_s": seconds[True][1:]}


def _rank(rank: int, world: int, cfg: Config, overrides: list[str], batch, reps: int) -> dict:
    """One trainer, with replay off and on: each mode's first step's figures, then `reps` interleaved
    pairs of timed steps (after a warm-up step of each)."""
    from fastgrpo.trainers import build_trainer

    trainers, out = {}, {}
    for mode in ("off", "rollout"):
        trainer = build_trainer(with_overrides(cfg, overrides + [f"trainer.routing_replay={mode}"]))
        gap = (trainer.logprobs(batch) - batch.engine_logprobs).abs()[batch.response_mask.bool()]
        metrics = trainer.train_step(batch)
        out[mode] = {"routing_mismatch": metrics["routing_mismatch"], "kl_engine_trainer": metrics["kl_engine_trainer"],
                     "gap_max": float(gap.max()), "gap_mean": float(gap.mean()), "step_s": []}
        trainers[mode] = trainer
    for _ in range(reps):
        for mode, trainer in trainers.items():
            t = time.perf_counter()
            trainer.train_step(batch)
            out[mode]["step_s"].append(time.perf_counter() - t)
    return out


def _ratio(num: list[float], den: list[float]) -> tuple[float, float]:
    """The mean of the paired ratios and its standard error."""
    ratios = [a / b for a, b in zip(num, den, strict=True)]
    se = statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else float("nan")
    return statistics.fmean(ratios), se


def bench_replay(cfg: Config, quick: bool, output: Path, extra: list[str] | None = None) -> dict:
    from fastgrpo.bench.trainer import moe_policy
    from fastgrpo.models.routing import bytes_per_token

    reps, prompts, new_tokens = (2, 4, 24) if quick else (5, 8, 64)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        policy = moe_policy(Path(tmp) / "policy", cfg)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(policy)),
                                  run_dir=str(Path(tmp) / "run"))
        batch, engine = rollouts(policy, prompts, new_tokens, reps, cfg.model.max_context)
        layers, k = batch.routing.shape[2:]
        tokens = int(batch.attention_mask.sum())
        recorded, plain = engine["recorded_s"], engine["plain_s"]
        rollout_ratio, rollout_se = _ratio(recorded, plain)
        print(f"rollout with the record {statistics.median(recorded):.3f} s, without {statistics.median(plain):.3f} s "
              f"({rollout_ratio:.3f}x ± {rollout_se:.3f})", flush=True)
        rows = []
        for name, overrides in TRAINERS.items():
            r = run_world(_rank, 1, Path(tmp) / name.split()[0], cfg, overrides, batch, reps, timeout_s=1800.0,
                          threads=torch.get_num_threads())[0]
            ratio, se = _ratio(r["rollout"]["step_s"], r["off"]["step_s"])
            rows.append({"trainer": name, "off": r["off"], "rollout": r["rollout"], "step_ratio": ratio,
                         "step_ratio_se": se})
            print(f"{name}: routing_mismatch {r['off']['routing_mismatch']:.4f}, kl_engine_trainer "
                  f"{r['off']['kl_engine_trainer']:.2e} -> {r['rollout']['kl_engine_trainer']:.2e}, step with replay "
                  f"{ratio:.3f}x ± {se:.3f}", flush=True)
    result = {"meta": {"date": datetime.date.today().isoformat(), "quick": quick, "cores": torch.get_num_threads(),
                       "torch": torch.__version__, "policy": "a random-weight Qwen3-MoE (bench.trainer.moe_policy)",
                       "sequences": batch.size, "tokens": tokens, "new_tokens": new_tokens, "repetitions": reps,
                       "sparse_layers": int(layers), "top_k": int(k), "seconds": time.perf_counter() - t0},
              "record": {"bytes_per_token": bytes_per_token(int(layers), int(k)),
                         "bytes": int(batch.routing.numel() * batch.routing.element_size()),
                         "input_ids_bytes": int(batch.input_ids.numel() * batch.input_ids.element_size())},
              "rollout": {**engine, "ratio": rollout_ratio, "ratio_se": rollout_se},
              "rows": rows}
    publish(result, output, command_line("replay", quick, output, list(extra or [])), markdown)
    return result


def markdown(r: dict, command: str) -> str:
    m, rec, ro = r["meta"], r["record"], r["rollout"]
    lines = [f"Command: `{command}`  ",
             f"Date {m['date']}, {m['cores']} threads, torch {m['torch']}; {m['policy']}, {m['sparse_layers']} sparse "
             f"layers, top-{m['top_k']}; a bf16 embedded engine's batch of {m['sequences']} sequences ({m['tokens']} "
             f"tokens, {m['new_tokens']} new tokens each), trainers in fp32, {m['repetitions']} interleaved pairs.", "",
             f"The record: {rec['bytes_per_token']} bytes a token, {rec['bytes'] / 1e3:.1f} kB for the batch "
             f"({rec['bytes'] / rec['input_ids_bytes']:.1f}x its token ids). The rollout with the record "
             f"{statistics.median(ro['recorded_s']):.3f} s against {statistics.median(ro['plain_s']):.3f} s without: "
             f"{ro['ratio']:.3f}x ± {ro['ratio_se']:.3f}.", "",
             "| trainer | routing_mismatch | kl_engine_trainer off | with replay | max logp gap off | with replay | "
             "mean gap off | with replay | step s off | with replay | step ratio |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in r["rows"]:
        off, on = row["off"], row["rollout"]
        lines.append(f"| {row['trainer']} | {off['routing_mismatch']:.4f} | {off['kl_engine_trainer']:.2e} | "
                     f"{on['kl_engine_trainer']:.2e} | {off['gap_max']:.3f} | {on['gap_max']:.3f} | "
                     f"{off['gap_mean']:.2e} | {on['gap_mean']:.2e} | {statistics.median(off['step_s']):.3f} | "
                     f"{statistics.median(on['step_s']):.3f} | {row['step_ratio']:.3f}x ± {row['step_ratio_se']:.3f} |")
    lines += ["", "routing_mismatch is measured before replay applies, so it is the same either way. kl_engine_trainer "
              "is the step's mean of engine minus trainer log-probabilities over the sampled tokens (signed, k1); the "
              "gaps are |trainer - engine| per sampled token before the step (what is left with replay is bf16 "
              "rounding). Step ratio: with replay over without, per interleaved pair, mean ± standard error."]
    return "\n".join(lines)


# -- `fastgrpo bench replay`: its sub-parser (fastgrpo/bench/command.py) --
def add_arguments(parser) -> None:
    """`fastgrpo bench replay` has only every benchmark's flags; it writes its own policy."""
    parser.set_defaults(run=from_cli, needs="config")


def from_cli(args, cfg) -> dict:
    return bench_replay(cfg, args.quick, args.output, extra=args.extra)
