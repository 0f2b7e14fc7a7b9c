"""Building the rollout batch (`fastgrpo.types.RolloutBatch`) from a rollout's prompts and completions:
group advantages of the rewards, the groups that carry a signal, their rows padded into tensors."""

from __future__ import annotations

import torch
from torch import Tensor

from fastgrpo.config import GRPOConfig
from fastgrpo.grpo.advantages import group_advantages, informative_groups
from fastgrpo.types import Completion, RolloutBatch


def training_batch(prompts: list[list[int]], completions: list[Completion], rewards: Tensor,
                   cfg: GRPOConfig, max_groups: int | None = None) -> tuple[RolloutBatch | None, int]:
    """The batch to train on and how many groups it holds: advantages per group (`rewards` [prompts, G],
    completions[i * G + j] answering prompts[i]; `grpo.advantage`'s baseline, `grpo.std_scope`'s std over
    every group given); groups with all-equal rewards are dropped (they would add zero gradient) unless
    `grpo.drop_equal_reward_groups` is off; at most the first `max_groups` of the rest (a refilled step
    sampled more than it trains on). None when no group is left."""
    G = rewards.shape[1]
    advantages = group_advantages(rewards, cfg.scale_by_std, baseline=cfg.advantage, std_scope=cfg.std_scope)
    keep = informative_groups(rewards) if cfg.drop_equal_reward_groups else torch.ones(len(prompts), dtype=torch.bool)
    if max_groups is not None:
        keep &= keep.cumsum(0) <= max_groups
    rows = [i * G + j for i in range(len(prompts)) if keep[i] for j in range(G)]
    if not rows:
        return None, 0
    batch = build_batch([prompts[i // G] for i in rows], [completions[i].token_ids for i in rows],
                        [completions[i].logprobs for i in rows], advantages.flatten()[rows],
                        sample_sets=[completions[i].sample_sets for i in rows],
                        routing=[completions[i].routing for i in rows])
    return batch, int(keep.sum())


def build_batch(prompts: list[list[int]], responses: list[list[int]], engine_logprobs: list[list[float]],
                advantages: Tensor, pad_id: int = 0, sample_sets: list[list[list[int]] | None] | None = None,
                routing: list[Tensor | None] | None = None) -> RolloutBatch:
    """Right-padded rows of prompt + response; `sample_sets`: each response token's sampling set (from
    the engine's completions; None where nothing cut the distribution); `routing`: each sequence's
    recorded experts [positions, sparse layers, k] (`Completion.routing`; all or none)."""
    if not (len(prompts) == len(responses) == len(engine_logprobs) == advantages.shape[0]):
        raise ValueError("prompts, responses, logprobs and advantages must have one entry per sequence")
    n = len(prompts)
    width = max(len(p) + len(r) for p, r in zip(prompts, responses))
    # assembled on the host; each trainer moves its micro-batches to its device
    ids = torch.full((n, width), pad_id, dtype=torch.long, device="cpu")
    attn = torch.zeros((n, width), dtype=torch.long, device="cpu")
    resp = torch.zeros((n, width), dtype=torch.bool, device="cpu")
    lps = torch.zeros((n, width), dtype=torch.float32, device="cpu")
    for i, (p, r, lp) in enumerate(zip(prompts, responses, engine_logprobs)):
        if len(lp) != len(r):
            raise ValueError(f"sequence {i}: {len(r)} tokens but {len(lp)} logprobs")
        a, b = len(p), len(p) + len(r)
        ids[i, :b] = torch.tensor(p + r, device="cpu")
        attn[i, :b] = 1
        resp[i, a:b] = True
        lps[i, a:b] = torch.tensor(lp, device="cpu")
    sets = None
    if sample_sets is not None and any(x is not None for x in sample_sets):
        if len(sample_sets) != n or any(x is None or len(x) != len(r) for x, r in zip(sample_sets, responses)):
            raise ValueError("sample_sets must give every response token its set, or be None")
        K = max(len(kept) for row in sample_sets for kept in row)
        sets = torch.full((n, width, K), -1, dtype=torch.long, device="cpu")
        for i, (p, row) in enumerate(zip(prompts, sample_sets)):
            for t, kept in enumerate(row):
                sets[i, len(p) + t, : len(kept)] = torch.tensor(kept, device="cpu")
    return RolloutBatch(ids, attn, resp, lps, advantages.float(), sets, _routing(routing, width))


def _routing(per_row: list[Tensor | None] | None, width: int) -> Tensor | None:
    """Rows' routing records [positions, layers, k] right-padded with -1 to [N, width, layers, k]."""
    if per_row is None or all(r is None for r in per_row):
        return None
    if any(r is None for r in per_row):
        raise ValueError("routing must be recorded for every sequence of a batch, or for none")
    layers, k = per_row[0].shape[1:]
    out = torch.full((len(per_row), width, layers, k), -1, dtype=torch.int16, device="cpu")
    for i, r in enumerate(per_row):
        if r.shape[0] > width or r.shape[1:] != (layers, k):
            raise ValueError(f"sequence {i}: routing of shape {tuple(r.shape)} for {width} positions of "
                             f"{layers} sparse layers x {k}")
        out[i, : r.shape[0]] = r.to("cpu", torch.int16)
    return out
