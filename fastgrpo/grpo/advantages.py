"""Group-relative advantages: a baseline from the group's other samples, optionally scaled by a std.

- grpo (DeepSeekMath's GRPO, arXiv 2402.03300): A_i = r_i - mean(group);
- rloo (REINFORCE leave-one-out, Kool et al. 2019; Ahmadian et al. arXiv 2402.14740):
  A_i = r_i - mean of the group's other G - 1 rewards = G / (G - 1) * (r_i - mean(group)),
  an unbiased baseline (it does not depend on the sample it judges);
then, with `scale_by_std`, divided by (std + eps): the group's own std (GRPO) or the std of every
reward of the step (`std_scope=batch`, TRL's scale_rewards="batch"), which keeps a group that is
nearly all right or all wrong from being up-weighted. std is the unbiased (Bessel-corrected) standard
deviation, as in TRL.
"""

from __future__ import annotations

from torch import Tensor


def group_advantages(rewards: Tensor, scale_by_std: bool = True, eps: float = 1e-6, baseline: str = "grpo",
                     std_scope: str = "group") -> Tensor:
    """rewards [P, G] -> A [P, G] = (r - baseline) / (std + eps), or r - baseline without `scale_by_std`
    (Dr. GRPO, arXiv 2503.20783). `baseline`: "grpo" (the group's mean) or "rloo" (the mean of the
    others); `std_scope`: "group" (each group's std) or "batch" (the std of all of `rewards`)."""
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [prompts, group >= 2], got shape {tuple(rewards.shape)}")
    G = rewards.shape[1]
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if baseline == "rloo":
        centred = centred * (G / (G - 1))
    elif baseline != "grpo":
        raise ValueError(f"unknown advantage baseline {baseline!r}")
    if not scale_by_std:
        return centred
    if std_scope == "group":
        std = rewards.std(dim=1, keepdim=True)
    elif std_scope == "batch":
        std = rewards.std()
    else:
        raise ValueError(f"unknown std scope {std_scope!r}")
    return centred / (std + eps)


def informative_groups(rewards: Tensor) -> Tensor:
    """[P] bool: groups whose rewards are not all equal (the others have zero advantage)."""
    return (rewards.max(dim=1).values - rewards.min(dim=1).values) > 0
