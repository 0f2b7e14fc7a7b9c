"""`fastgrpo bench noise`: how much of one GRPO update is signal?

The policy gradient of one rollout batch is the true gradient G plus noise. With K gradients g_i of
independent batches of B prompts at the same weights, E[g_i . g_j] = |G|^2 for i != j and
E|g_i|^2 = |G|^2 + tr(Sigma)/B, so the pairwise products estimate |G|^2 without bias and
B_noise = tr(Sigma) / |G|^2 = B (E|g|^2 - |G|^2) / |G|^2 is the batch size (in prompts, of G samples
each) at which signal and noise in an update are equal: the "simple noise scale" of McCandlish et
al., An Empirical Model of Large-Batch Training (2018), section 2.2. Updates from batches much
smaller than B_noise are mostly noise, which an optimiser that normalises step sizes (Adam) turns
into a random walk of the weights.

Each batch goes through the training loop's own rollout, scoring and batch building, and the
trainer's own loss, at the run's starting policy.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fastgrpo.bench.report import command_line, publish
from fastgrpo.config import Config
from fastgrpo.device import thread_count
from fastgrpo.grpo.batch import training_batch
from fastgrpo.run_setup import setup_run
from fastgrpo.train import rollout


def bench_noise(cfg: Config, quick: bool, output: Path, batches: int | None = None,
                extra: list[str] | None = None) -> dict:
    if cfg.trainer.backend != "torch":
        raise ValueError(f"bench noise measures the torch trainer's gradients; trainer.backend={cfg.trainer.backend}")
    K = batches or (3 if quick else 8)
    if K < 3:
        raise ValueError(f"--batches must be >= 3 (pairs of independent batches estimate the signal), got {K}")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, thread_count(cfg.threads):
        run_cfg = dataclasses.replace(cfg, run_dir=tmp, tracking=dataclasses.replace(cfg.tracking, enabled=False),
                                      draft=dataclasses.replace(cfg.draft, online="off"))
        run = setup_run(run_cfg, resume=False)
        grads, rows, empty = [], [], 0
        for attempt in range(4 * K):  # a batch whose groups all have equal rewards has no gradient: draw another
            if len(grads) == K:
                break
            problems = run.data.next_batch(cfg.rollout.prompts_per_step)
            answers = rollout(run, problems, seed=cfg.seed * 1_000_003 + attempt)
            rewards = answers.rewards
            batch, kept = training_batch([p.prompt_ids for p in problems], answers.completions, rewards, cfg.grpo)
            if batch is None:
                empty += 1
                continue
            grads.append(run.trainer.loss_gradient(batch).double())
            rows.append({"reward_mean": rewards.mean().item(), "groups_kept": kept,
                         "grad_sq": float(grads[-1].square().sum())})
            print(f"batch {len(grads)}/{K}: reward {rows[-1]['reward_mean']:.3f}, {kept} informative groups, "
                  f"|g|^2 {rows[-1]['grad_sq']:.3e}", flush=True)
        if len(grads) < K:
            raise RuntimeError(f"only {len(grads)} of {4 * K} batches had a group with unequal rewards; "
                               f"use more prompts per batch or a stronger policy")
    result = {"meta": {"date": datetime.date.today().isoformat(), "quick": quick, "cores": torch.get_num_threads(),
                       "torch": torch.__version__, "policy": cfg.model.path, "seconds": time.perf_counter() - t0},
              "prompts_per_batch": cfg.rollout.prompts_per_step, "group_size": cfg.rollout.group_size,
              "batches": rows, "batches_without_signal": empty} | noise_scale(grads, cfg.rollout.prompts_per_step)
    publish(result, output, command_line("noise", quick, output, extra), markdown)
    return result


def noise_scale(grads: list[torch.Tensor], prompts_per_batch: int) -> dict[str, float]:
    """|G|^2 from the pairwise products (with its standard error over pairs), E|g|^2, B_noise, and the
    mean cosine between two batches' gradients (0 when updates are pure noise)."""
    pairs = [float(a @ b) for a, b in itertools.combinations(grads, 2)]
    signal = statistics.mean(pairs)
    signal_se = statistics.stdev(pairs) / math.sqrt(len(grads) / 2)  # pairs share batches: K/2 independent ones
    total = statistics.mean(float(g @ g) for g in grads)
    cosines = [float(a @ b) / math.sqrt(float(a @ a) * float(b @ b)) for a, b in itertools.combinations(grads, 2)]
    noise = total - signal  # tr(Sigma) / B
    return {"signal_sq": signal, "signal_sq_se": signal_se, "grad_sq": total, "mean_cosine": statistics.mean(cosines),
            # when |G|^2 is not above two standard errors, B_noise is only bounded from below
            "b_noise_prompts": prompts_per_batch * noise / signal if signal > 0 else math.inf,
            "b_noise_prompts_lower_bound": prompts_per_batch * noise / max(signal + 2 * signal_se, 1e-300)}


def markdown(r: dict, command: str) -> str:
    m, P, G = r["meta"], r["prompts_per_batch"], r["group_size"]
    significant = r["signal_sq"] > 2 * r["signal_sq_se"]
    b_noise = (f"{r['b_noise_prompts']:.3g} prompts ({r['b_noise_prompts'] * G:.3g} samples)" if significant else
               f"> {r['b_noise_prompts_lower_bound']:.0f} prompts ({r['b_noise_prompts_lower_bound'] * G:.0f} samples): "
               f"|G|^2 is within two standard errors of 0")
    return "\n".join([
        f"Command: `{command}`  ",
        f"Date {m['date']}, {m['cores']} threads, torch {m['torch']}, policy `{m['policy']}`; "
        f"{len(r['batches'])} independent batches of {P} prompts x {G} samples at the starting weights.",
        "",
        "| quantity | value |", "| --- | ---: |",
        f"| E\\|g\\|^2 (one batch's gradient) | {r['grad_sq']:.3e} |",
        f"| \\|G\\|^2 (mean product of two batches' gradients) | {r['signal_sq']:.3e} ± {r['signal_sq_se']:.1e} |",
        f"| mean cosine between two batches' gradients | {r['mean_cosine']:+.4f} |",
        f"| B_noise = tr(Sigma) / \\|G\\|^2 | {b_noise} |",
    ])


# -- `fastgrpo bench noise`: its sub-parser (fastgrpo/bench/command.py) --
def add_arguments(parser) -> None:
    """`fastgrpo bench noise`'s own flags (--quick, --output, --config and overrides are every benchmark's)."""
    from fastgrpo.bench.command import at_least_one

    parser.add_argument("--batches", type=at_least_one, help="independent rollout batches (default 8; 3 with --quick)")
    parser.set_defaults(run=from_cli, needs_of=needs)


def needs(args, cfg: Config) -> str:
    """Rollouts without speculation (the config's policy off) need no draft: none is built for them."""
    return "policy" if cfg.speculation.policy == "off" else "draft"


def from_cli(args, cfg) -> dict:
    return bench_noise(cfg, args.quick, args.output, args.batches, extra=args.extra)
