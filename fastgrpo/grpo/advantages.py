"""Group-relative advantages."""

from __future__ import annotations

from torch import Tensor


def group_advantages(rewards: Tensor, scale_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """rewards [P, G] -> A [P, G] = (r - mean_group) / (std_group + eps).

    std is the unbiased (Bessel-corrected) group standard deviation, as in TRL's GRPO; with
    `scale_by_std=False` the advantage is only centred (Dr. GRPO), which avoids up-weighting
    groups that are nearly all right or all wrong.
    """
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [prompts, group >= 2], got shape {tuple(rewards.shape)}")
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale_by_std:
        return centred
    return centred / (rewards.std(dim=1, keepdim=True) + eps)


def informative_groups(rewards: Tensor) -> Tensor:
    """[P] bool: groups whose rewards are not all equal (the others have zero advantage)."""
    return (rewards.max(dim=1).values - rewards.min(dim=1).values) > 0
