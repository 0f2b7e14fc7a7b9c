"""Accuracy of a policy on held-out problems: greedy pass@1, mean accuracy over k samples, pass@k,
each with its standard error over problems. Answers are scored by the task's reward (`task.reward`,
`fastgrpo.tasks.rewards.Reward.for_eval`): with the built-in math reward (1 or 0) these are
accuracies; with a reward of the user's, the mean and the best of its values.

(MLflow metric names cannot hold "@", hence pass1_greedy and pass_at_k.)
"""

from __future__ import annotations

import dataclasses
import logging
import math

from fastgrpo.protocols import Engine
from fastgrpo.types import SamplingParams, Request
from fastgrpo.models.tokenizer import TextFormat
from fastgrpo.tasks.rewards import Reward, check_not_all_failed, math_reward, score_answers
from fastgrpo.tasks.source import EncodedProblem

log = logging.getLogger(__name__)


def _mean_and_se(values: list[float]) -> tuple[float, float]:
    """Mean over problems and its standard error (samples of one problem are not independent, so
    the unit is the problem)."""
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / max(n - 1, 1)
    return mean, math.sqrt(var / n)


def scores(engine: Engine, text: TextFormat, problems: list[EncodedProblem],
           sampling: SamplingParams, repeats: int = 1, reward: Reward | None = None, seed: int = 0) -> list[list[float]]:
    """Each problem's rewards for `repeats` answers drawn with `sampling` (one list per problem);
    `reward`: the task's (None: the built-in math reward). An answer whose verifier failed scores 0 and
    is logged; every answer's failing is an error naming the reward."""
    reward = reward or math_reward()
    requests = [Request(e.prompt_ids) for e in problems for _ in range(repeats)]
    outs = engine.generate(requests, sampling, seed=seed)
    scored = score_answers(reward, [text.response_text(o.token_ids) for o in outs],
                           [problems[i // repeats].problem for i in range(len(outs))], training=False)
    check_not_all_failed(reward, len(outs), scored.errors, scored.first_error, "the eval")
    if scored.errors:
        log.warning("the reward %s raised on %d of %d eval answers (scored 0); the first: %s", reward.name,
                    scored.errors, len(outs), scored.first_error)
    rewards = scored.rewards
    return [rewards[i * repeats : (i + 1) * repeats] for i in range(len(problems))]


def greedy(sampling: SamplingParams) -> SamplingParams:
    return dataclasses.replace(sampling, temperature=0.0, top_p=1.0, top_k=0)


def evaluate(engine: Engine, text: TextFormat, problems: list[EncodedProblem],
             samples: int, sampling: SamplingParams, reward: Reward | None = None, seed: int = 0) -> dict[str, float]:
    """Greedy decoding once per problem, and `samples` draws of the rollout's own sampling
    distribution (temperature, top-k, top-p): the quantity GRPO optimises. `reward`: the task's
    (None: the built-in math reward)."""
    first = scores(engine, text, problems, greedy(sampling), 1, reward, seed)
    sampled = scores(engine, text, problems, sampling, samples, reward, seed)
    out: dict[str, float] = {}
    for name, per_problem in (("pass1_greedy", [g[0] for g in first]),
                              ("mean_accuracy", [sum(s) / samples for s in sampled]),
                              (f"pass_at_{samples}", [max(s) for s in sampled])):
        out[name], out[f"{name}_se"] = _mean_and_se(per_problem)
    return out
