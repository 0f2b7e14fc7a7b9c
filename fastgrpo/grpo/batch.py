"""Building the rollout batch (`fastgrpo.types.RolloutBatch`) from a rollout's prompts and completions."""

from __future__ import annotations

import torch
from torch import Tensor

from fastgrpo.types import RolloutBatch


def build_batch(prompts: list[list[int]], responses: list[list[int]], engine_logprobs: list[list[float]],
                advantages: Tensor, pad_id: int) -> RolloutBatch:
    if not (len(prompts) == len(responses) == len(engine_logprobs) == advantages.shape[0]):
        raise ValueError("prompts, responses, logprobs and advantages must have one entry per sequence")
    n = len(prompts)
    width = max(len(p) + len(r) for p, r in zip(prompts, responses))
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    resp = torch.zeros((n, width), dtype=torch.bool)
    lps = torch.zeros((n, width), dtype=torch.float32)
    for i, (p, r, lp) in enumerate(zip(prompts, responses, engine_logprobs)):
        if len(lp) != len(r):
            raise ValueError(f"sequence {i}: {len(r)} tokens but {len(lp)} logprobs")
        a, b = len(p), len(p) + len(r)
        ids[i, :b] = torch.tensor(p + r)
        attn[i, :b] = 1
        resp[i, a:b] = True
        lps[i, a:b] = torch.tensor(lp)
    return RolloutBatch(ids, attn, resp, lps, advantages.float())
