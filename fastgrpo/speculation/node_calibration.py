"""How likely a proposed tree node is to be accepted, learned online per source: what makes the learned
draft's and the suffix index's nodes comparable in one hybrid tree (`tree.hybrid_tree`).

A node is accepted when its parent was reached and the target samples its token there: with
probability p(token | parent's path), the target's mass on it (docs/drafts.md). Each source estimates
that conditional its own way: the learned draft by its softmax, the index by how often the matched
context was followed by the token (c / (n + prior / m)). Neither is a probability of the target's, and
the two are not on one scale: a draft may be overconfident where the index is cautious, or the other
way round. A merged tree that ranks nodes by either raw estimate spends its node budget on whichever
source overstates itself.

So each verify step's nodes are observed: a node whose parent was reached either was accepted or not,
and that outcome is counted in the node's class (its source: the learned draft, the index after a
short match, the index after a long match, or both) and the bucket of its raw conditional estimate.
The calibrated conditional of a class and bucket is (accepted + prior x estimate) / (reached + prior):
the raw estimate until the counts outweigh the prior. A path's calibrated probability is the product
of its nodes' calibrated conditionals; keeping the `num_verify - 1` paths of highest probability keeps
an ancestor-closed set (no node is likelier than its parent) that holds the most expected accepted
tokens (each node adds its path's probability to the expected accepted length).

Counts are one tensor and every node of a step is looked up and counted in one batched operation (or
in one pass in C, `tree.observe_verified`, from the same tensor): the engine calibrates every row of
every hybrid step, so per-node Python work would grow with the batch.

Nothing here changes what is emitted: verification samples the target whatever the tree holds.
"""

from __future__ import annotations

import torch
from torch import Tensor

LEARNED_CLASS, INDEX_SHORT, INDEX_LONG, BOTH = "learned", "index-short", "index-long", "both"
CLASSES = (LEARNED_CLASS, INDEX_SHORT, INDEX_LONG, BOTH)  # a class's id is its position here
LONG_MATCH = 4  # matched tokens from which an index continuation counts as a long match's


def node_classes(learned: Tensor, index: Tensor, match_len: Tensor) -> Tensor:
    """Each node's class id (`CLASSES`), from who proposed it (bool tensors of one shape) and, for
    the index, how long a stretch of the sequence's end it matched (broadcast to them): a longer match
    predicts better."""
    only_index = torch.where(match_len >= LONG_MATCH, CLASSES.index(INDEX_LONG), CLASSES.index(INDEX_SHORT))
    return torch.where(learned, torch.where(index, CLASSES.index(BOTH), CLASSES.index(LEARNED_CLASS)),
                       only_index.expand_as(learned))


class NodeCalibration:
    """Acceptance counts per (class, raw-estimate bucket), with a prior at the raw estimate (module
    docstring)."""

    def __init__(self, buckets: int = 10, prior: float = 4.0):
        if buckets < 1 or prior <= 0:
            raise ValueError(f"buckets must be >= 1 and prior > 0, got {buckets} and {prior}")
        self.buckets, self.prior = buckets, prior
        self.counts = torch.zeros(len(CLASSES), buckets, 2, dtype=torch.float64)  # [class, bucket, (accepted, reached)]

    def _bucket(self, raw: Tensor) -> Tensor:
        return (raw * self.buckets).long().clamp(0, self.buckets - 1)

    def _on(self, device: torch.device) -> Tensor:
        if self.counts.device != device:  # follows the trees (an engine's device) after the first use
            self.counts = self.counts.to(device)
        return self.counts

    def conditionals(self, classes: Tensor, raw: Tensor) -> Tensor:
        """The calibrated probability that each node (its class id and raw conditional estimate, tensors
        of one shape) is accepted once its parent is reached, in float64."""
        raw = raw.double().clamp(0.0, 1.0)
        counts = self._on(raw.device)[classes, self._bucket(raw)]
        return (counts[..., 0] + self.prior * raw) / (counts[..., 1] + self.prior)

    def conditional(self, cls: str, raw: float) -> float:
        """`conditionals` of one node of class `cls`."""
        return float(self.conditionals(torch.tensor(CLASSES.index(cls)), torch.tensor(raw)))

    def observe(self, classes: Tensor, raw: Tensor, accepted: Tensor) -> None:
        """Count nodes whose parent was reached (class ids, raw estimates, whether each was accepted:
        1-D tensors of one length)."""
        counts = self._on(raw.device)
        bucket = self._bucket(raw.double().clamp(0.0, 1.0))
        counts.index_put_((classes, bucket, torch.zeros_like(bucket)), accepted.double(), accumulate=True)
        counts.index_put_((classes, bucket, torch.ones_like(bucket)), torch.ones_like(raw, dtype=torch.float64),
                          accumulate=True)

    def summary(self) -> dict[str, float]:
        """Each class's observed acceptance over all its buckets (nodes reached), for the engine's stats."""
        accepted, reached = self.counts.sum(1).unbind(-1)
        return {cls: float(accepted[i] / reached[i]) for i, cls in enumerate(CLASSES) if reached[i] > 0}
