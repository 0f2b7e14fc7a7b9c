"""Step-cost truths `aware` is graded on, SIMULATED, and the drivers that run a policy against them.

`aware` is given forwards timed alone (`gpu_calibration`) and must learn what a whole step costs from the
steps it takes. Each truth is a machine whose step seconds depend on the tree's shape in a way that
calibration cannot see: `eager_h100` (host work a step and a draft level, from the research note's H100
table), `graphed` (a graph-captured engine: steps 1.2x their forwards), `cheap_speculation` (trees pay)
and `dear_speculation` (every tree loses, as on a CPU). Acceptance follows the law `bench simulate`
fits: a level is accepted with chance 1 - (1 - ALPHA) w^-beta for a tree of w candidates a level.
The tests (tests/test_aware_steps.py, test_aware_batch.py) and the tools that replay the GPU check on
these truths (tools/aware_*.py) share them from here.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from fastgrpo.speculation.cost_model import CostModel
from fastgrpo.speculation.policy import Aware, SpeculationPolicy, candidate_configs
from fastgrpo.speculation.spec import SpecConfig

Truth = Callable[[SpecConfig | None, int], float]  # a step's seconds: the choice (None: plain), the rows running

GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
ALPHA = 0.7  # the true chance that a level is accepted by one drafted child


def gpu_calibration() -> CostModel:
    """What aware is given: forwards timed alone on a GPU, flat while memory-bound (2.5 ms to 512
    tokens), then linear; a draft forward of 0.3 ms."""
    return CostModel({t: 0.0025 * max(1.0, t / 512) for t in GRID}, {t: 0.0003 * max(1.0, t / 512) for t in GRID})


def eager_h100(c: SpecConfig | None, B: int) -> float:
    """Step seconds of an eager engine on an H100 (the research note's table: a plain step 26 ms at one
    sequence, d4k4n12 2.2-2.5x, wide trees 3-4x): host work per step and per draft level, verify tokens
    nearly free."""
    plain = 0.026 + 0.00005 * B
    return plain if c is None else plain + 0.008 + 0.006 * c.depth + 2e-5 * B * c.num_verify


def graphed(c: SpecConfig | None, B: int) -> float:
    """A graph-captured engine: steps cost 1.2x their forwards, plus 0.3 ms a draft level."""
    cal = gpu_calibration()
    if c is None:
        return 1.2 * cal.target(B)
    return 1.2 * (cal.target(B * c.num_verify) + c.depth * cal.draft(B * c.topk)) + 0.0003 * c.depth


def dear_speculation(c: SpecConfig | None, B: int) -> float:
    """A CPU-like truth where every tree loses: a step costs a plain step more per draft level (the chain of
    one, 1.9 plain steps for 1.7 tokens a row), so plain decoding is the best fixed choice."""
    plain = 0.010 * (1 + B / 256)
    return plain if c is None else plain * (1 + 0.9 * c.depth + 0.05 * (c.num_verify - 1))


def cheap_speculation(c: SpecConfig | None, B: int) -> float:
    """A truth where trees pay: a quarter of a plain step per draft level, a twentieth per verified node."""
    plain = 0.010 * (1 + B / 256)
    return plain if c is None else plain * (1 + 0.25 * c.depth + 0.05 * (c.num_verify - 1))


BETA = 0.7  # what a tree's width adds, as aware's prior assumes (the median of bench simulate's fits)


def level_acceptance(c: SpecConfig, beta: float = BETA) -> float:
    """The truth's chance that a tree of c accepts a level it reached: of ~w candidates a level (its
    nodes over its levels, at most top-k), the target's token is missed with chance (1 - ALPHA) w^-beta
    (the law `bench simulate` fits to measured acceptance)."""
    width = max(1.0, min(c.topk, (c.num_verify - 1) / c.depth))
    return 1 - (1 - ALPHA) * width**-beta


def expected_emitted(c: SpecConfig | None, beta: float = BETA) -> float:
    """Per sequence and step, by the truth's acceptance."""
    if c is None:
        return 1.0
    level = level_acceptance(c, beta)
    return 1 + sum(level**d for d in range(1, c.depth + 1))


def accepted(c: SpecConfig, B: int, rng: random.Random, beta: float = BETA) -> list[int]:
    """Each of B rows' accepted draft tokens under tree c, drawn level by level by the truth's acceptance."""
    level = level_acceptance(c, beta)
    out = []
    for _ in range(B):
        a = 0
        while a < c.depth and rng.random() < level:
            a += 1
        out.append(a)
    return out


def aware_rate(truth: Truth, B: int, steps: int, seed: int, beta: float = BETA) -> float:
    """aware's realised tokens per second over `steps` steps at B running (3% noise on every step)."""
    rng = random.Random(seed)
    aware = Aware(gpu_calibration())
    tokens = seconds = 0.0
    for _ in range(steps):
        c = aware.choose(B, 512)
        t = truth(c, B) * math.exp(rng.gauss(0, 0.03))
        acc = None if c is None else accepted(c, B, rng, beta)
        emitted = B if acc is None else sum(a + 1 for a in acc)
        aware.observe(c, B, emitted, t, acc)
        tokens, seconds = tokens + emitted, seconds + t
    return tokens / seconds


def best_fixed(truth: Truth, B: int, beta: float = BETA) -> tuple[float, SpecConfig | None]:
    """(tokens a second, choice) of the best choice held fixed at B running (plain or a candidate tree), by
    the truth's step seconds and expected acceptance: the bar `aware` is graded against."""
    rate, c = max(((B * expected_emitted(c, beta) / truth(c, B), c) for c in [None, *candidate_configs()]),
                  key=lambda rc: rc[0])
    return rate, c


TRUTHS: list[Truth] = [eager_h100, graphed, cheap_speculation, dear_speculation]


def rollout_seconds(truth: Truth, lengths: list[int], policy: SpeculationPolicy, seed: int, known: bool = False) -> float:
    """Seconds to finish a GRPO batch: every sequence runs until it has emitted its length; the running
    count falls as they finish (the long tail); 3% noise on every step. `known`: the policy is told each
    row's tokens left (`Aware.tokens_left`: lengths fixed, EOS ignored), else the lengths stand for EOS."""
    rng = random.Random(seed)
    left, seconds = list(lengths), 0.0
    while running := [i for i, n in enumerate(left) if n > 0]:
        B = len(running)
        if known and hasattr(policy, "tokens_left"):
            policy.tokens_left([left[i] for i in running])
        c = policy.choose(B, 512)
        t = truth(c, B) * math.exp(rng.gauss(0, 0.03))
        acc = [0] * B if c is None else accepted(c, B, rng)
        for i, a in zip(running, acc):
            left[i] -= a + 1
        policy.observe(c, B, sum(a + 1 for a in acc), t, None if c is None else acc)
        seconds += t
    return seconds
