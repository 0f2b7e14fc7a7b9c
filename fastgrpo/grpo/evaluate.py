"""Accuracy of a policy on held-out problems: greedy pass@1, mean accuracy over G samples, pass@G.

(MLflow metric names cannot hold "@", hence pass1_greedy and pass_at_G.)
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from fastgrpo.backends.protocols import Engine, Request
from fastgrpo.engine.sampling import SamplingParams
from fastgrpo.models.tokenizer import decode_response
from fastgrpo.tasks.rewards import score
from fastgrpo.tasks.source import EncodedProblem


def evaluate(engine: Engine, tokenizer: PreTrainedTokenizerBase, problems: list[EncodedProblem],
             samples: int, temperature: float, max_new_tokens: int, timeout_s: float = 2.0,
             seed: int = 0) -> dict[str, float]:
    def correct(sampling: SamplingParams, repeats: int) -> list[list[float]]:
        requests = [Request(e.prompt_ids) for e in problems for _ in range(repeats)]
        outs = engine.generate(requests, sampling, seed=seed)
        rewards = [score(decode_response(tokenizer, o.token_ids), problems[i // repeats].problem.answer, timeout_s)
                   for i, o in enumerate(outs)]
        return [rewards[i * repeats : (i + 1) * repeats] for i in range(len(problems))]

    greedy = correct(SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens), 1)
    sampled = correct(SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens), samples)
    n = len(problems)
    return {
        "pass1_greedy": sum(g[0] for g in greedy) / n,  # pass@1 of greedy decoding
        "mean_accuracy": sum(sum(s) / samples for s in sampled) / n,  # mean over G samples
        f"pass_at_{samples}": sum(max(s) for s in sampled) / n,  # any of G samples right
    }
