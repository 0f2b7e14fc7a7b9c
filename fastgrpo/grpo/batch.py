"""The rollout batch: what the trainer needs from one rollout, as padded tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class RolloutBatch:
    """Per-position tensors [N, L]; a value at position t belongs to token t (predicted from t-1)."""

    input_ids: Tensor  # prompt + response, right-padded
    attention_mask: Tensor  # 1 on real tokens
    response_mask: Tensor  # 1 on response tokens (the ones trained)
    engine_logprobs: Tensor  # the engine's sampling log-probabilities of the response tokens
    advantages: Tensor  # [N]

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx: Tensor | list[int]) -> RolloutBatch:
        """Rows `idx`, trimmed to their longest sequence (saves compute on short micro-batches)."""
        idx = torch.as_tensor(idx, dtype=torch.long)
        width = int(self.attention_mask[idx].sum(-1).max())
        return RolloutBatch(
            self.input_ids[idx, :width], self.attention_mask[idx, :width], self.response_mask[idx, :width],
            self.engine_logprobs[idx, :width], self.advantages[idx],
        )


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
