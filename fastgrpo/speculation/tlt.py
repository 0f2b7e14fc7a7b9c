"""A TLT-style speculation policy: the baseline `aware` must beat (docs/speculation.md).

What it follows: TLT ("Taming the Long-Tail: Efficient Reasoning RL Training with Adaptive Drafter",
Hu et al., MIT / NVIDIA, arXiv 2511.16665, ASPLOS'26; code in github.com/mit-han-lab/fastrl, an SGLang
fork). Its adaptive rollout engine turns speculative decoding on only once the running batch has
shrunk below a threshold (the long tail), and picks the speculative-decoding strategy for each
decode step with a multi-armed bandit per batch-size bucket over a small pool of fixed tree
configurations, rewarded by accepted tokens per second. We implement exactly that shape of policy
(epsilon-greedy per bucket; UCB1 as an option). Not taken from their code, which we have not read:
the threshold, the arm set and epsilon are ours (constructor arguments), chosen to resemble the
settings the paper describes (speculation only in the tail, a handful of EAGLE tree shapes).

It keeps no cost model and no acceptance model: everything it knows is the reward of the arms it
pulled, per bucket, so what it learns at 8 running sequences does not transfer to 4 or 16.
"""

from __future__ import annotations

import math
import random

from fastgrpo.speculation.policy import concurrency_bucket
from fastgrpo.speculation.spec import SpecConfig

# a few EAGLE-style shapes from shallow-narrow to deep-wide (depth, top-k, tokens verified per sequence)
DEFAULT_ARMS = (SpecConfig(3, 1, 4), SpecConfig(4, 4, 8), SpecConfig(5, 4, 16), SpecConfig(6, 8, 32))


class TLT:
    """Speculation off at more than `threshold` running sequences; below, a bandit per power-of-two
    batch-size bucket over `arms`, rewarded by tokens emitted per second of the step."""

    name = "tlt"

    def __init__(self, threshold: int = 32, arms: tuple[SpecConfig, ...] = DEFAULT_ARMS, epsilon: float = 0.1,
                 method: str = "epsilon", seed: int = 0):
        if method not in ("epsilon", "ucb1"):
            raise ValueError(f"method must be epsilon or ucb1, not {method!r}")
        if not arms:
            raise ValueError("TLT needs at least one arm")
        self.threshold = threshold
        self.arms = list(arms)
        self.epsilon = epsilon
        self.method = method
        self.rng = random.Random(seed)
        self.pulls: dict[int, list[int]] = {}  # bucket -> pulls per arm
        self.mean: dict[int, list[float]] = {}  # bucket -> mean reward (tokens / s) per arm

    bucket = staticmethod(concurrency_bucket)

    def _stats(self, b: int) -> tuple[list[int], list[float]]:
        if b not in self.pulls:
            self.pulls[b] = [0] * len(self.arms)
            self.mean[b] = [0.0] * len(self.arms)
        return self.pulls[b], self.mean[b]

    def choose(self, running: int, context: float | None = None) -> SpecConfig | None:
        if running > self.threshold:
            return None
        pulls, mean = self._stats(self.bucket(running))
        untried = [i for i, p in enumerate(pulls) if p == 0]
        if untried:  # every arm once first
            return self.arms[untried[0]]
        if self.method == "ucb1":
            total = sum(pulls)
            scale = max(mean) or 1.0  # rewards are tokens/s, not in [0, 1]: scale the bonus to them
            return self.arms[max(range(len(self.arms)),
                                 key=lambda i: mean[i] + scale * math.sqrt(2 * math.log(total) / pulls[i]))]
        if self.rng.random() < self.epsilon:
            return self.rng.choice(self.arms)
        return self.arms[max(range(len(self.arms)), key=mean.__getitem__)]

    def observe(self, config: SpecConfig | None, running: int, emitted: int, seconds: float | None,
                accepted: list[int] | None = None) -> None:
        if config is None or seconds is None or config not in self.arms:
            return
        pulls, mean = self._stats(self.bucket(running))
        i = self.arms.index(config)
        pulls[i] += 1
        mean[i] += (emitted / max(seconds, 1e-9) - mean[i]) / pulls[i]
