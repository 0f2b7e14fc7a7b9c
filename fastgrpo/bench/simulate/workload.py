"""bench simulate: workloads."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SimRequest:
    prompt: int  # prompt identity (samples of one prompt share its prefill)
    prompt_len: int
    length: int  # response tokens the target generates (EOS included), before any cap


@dataclass
class Workload:
    name: str
    requests: list[SimRequest]
    max_new: int
    max_context: int
    description: str = ""
    # EOS ignored (a bench's fixed lengths): every row runs to its length, and the engine tells the policy each
    # row's tokens left (`Aware.tokens_left`); else a length stands for where a row meets EOS, unknown ahead
    known_lengths: bool = False


def grpo_workload(name: str, prompt_lens: Sequence[int], lengths: Sequence[Sequence[int]], max_new: int,
                  max_context: int, description: str = "") -> Workload:
    """A GRPO batch: lengths[p] holds the responses of prompt p (its group)."""
    reqs = [SimRequest(p, prompt_lens[p], L) for p, group in enumerate(lengths) for L in group]
    return Workload(name, reqs, max_new, max_context, description)


def longtail_workload(n_prompts: int, group: int, mean: float, sigma: float, max_new: int, prompt_len: int,
                      seed: int) -> Workload:
    """Long-tailed reasoning responses: lognormal lengths of the given mean and log-space sigma, capped
    at max_new (capped ones are the truncated tail). Defaults (bench_simulate) are ASSUMPTIONS
    shaped after published reasoning-RL statistics, not fitted to a figure: DAPO (arXiv 2503.14476)
    trains with responses of up to 16,384 tokens (plus a 4,096-token overlong buffer) and mean lengths
    that grow into the thousands; TLT (arXiv 2511.16665) describes the same persistent long tail, a
    few responses near the cap dominating the step. A prompt's samples share a per-prompt difficulty
    factor (half of the log-variance), as samples of one problem do."""
    rng = np.random.default_rng(seed)
    mu = math.log(mean) - sigma**2 / 2
    lengths = []
    for _ in range(n_prompts):
        shift = rng.normal(0, sigma / math.sqrt(2))
        lengths.append([int(min(max(rng.lognormal(mu + shift, sigma / math.sqrt(2)), 1), max_new))
                        for _ in range(group)])
    return grpo_workload(f"long-tail reasoning (lognormal mean {mean:.0f}, sigma {sigma}, cap {max_new})",
                         [prompt_len] * n_prompts, lengths, max_new, prompt_len + max_new + 1)


def longtail_case(quick: bool) -> dict:
    """The long-tail reasoning case every SIMULATED GPU table uses (`bench simulate`, `--model`, `bench
    drafts`): 64 prompts x 8 (16 quick), lognormal mean 3000 tokens, sigma 1, capped at 16384 (8192
    quick), 256-token prompts (`longtail_workload`'s assumptions)."""
    return dict(prompts=16 if quick else 64, group=8, mean=3000.0, sigma=1.0, max_new=8192 if quick else 16384,
                prompt_len=256)


def longtail_of(case: dict, seed: int) -> Workload:
    """The workload of a `longtail_case`."""
    return longtail_workload(case["prompts"], case["group"], case["mean"], case["sigma"], case["max_new"],
                             case["prompt_len"], seed)


def resampled_workload(name: str, prompt_lens: Sequence[int], groups: Sequence[Sequence[int]], n_prompts: int,
                       max_new: int, max_context: int, seed: int) -> Workload:
    """n_prompts groups drawn with replacement from measured (prompt length, group lengths)."""
    rng = random.Random(seed)
    pick = [rng.randrange(len(groups)) for _ in range(n_prompts)]
    return grpo_workload(name, [prompt_lens[i] for i in pick], [groups[i] for i in pick], max_new, max_context)
