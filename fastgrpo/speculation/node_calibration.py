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

Nothing here changes what is emitted: verification samples the target whatever the tree holds.
"""

from __future__ import annotations

from collections.abc import Iterable

LEARNED_CLASS, INDEX_SHORT, INDEX_LONG, BOTH = "learned", "index-short", "index-long", "both"
LONG_MATCH = 4  # matched tokens from which an index continuation counts as a long match's


def node_class(learned: bool, index: bool, match_len: int) -> str:
    """The class a node's acceptance is learned in: who proposed it, and for the index how long a
    stretch of the sequence's end it matched (a longer match predicts better)."""
    if learned and index:
        return BOTH
    if learned:
        return LEARNED_CLASS
    return INDEX_LONG if match_len >= LONG_MATCH else INDEX_SHORT


class NodeCalibration:
    """Acceptance counts per (class, raw-estimate bucket), with a prior at the raw estimate (module
    docstring)."""

    def __init__(self, buckets: int = 10, prior: float = 4.0):
        if buckets < 1 or prior <= 0:
            raise ValueError(f"buckets must be >= 1 and prior > 0, got {buckets} and {prior}")
        self.buckets, self.prior = buckets, prior
        self.counts: dict[str, list[list[float]]] = {}  # class -> per bucket [accepted, reached]

    def _bucket(self, raw: float) -> int:
        return min(max(int(raw * self.buckets), 0), self.buckets - 1)

    def conditional(self, cls: str, raw: float) -> float:
        """The calibrated probability that a node of `cls` with raw conditional estimate `raw` is
        accepted once its parent is reached."""
        raw = min(max(raw, 0.0), 1.0)
        accepted, reached = self.counts.get(cls, [[0.0, 0.0]] * self.buckets)[self._bucket(raw)]
        return (accepted + self.prior * raw) / (reached + self.prior)

    def observe(self, outcomes: Iterable[tuple[str, float, bool]]) -> None:
        """Count each (class, raw estimate, accepted) of nodes whose parent was reached."""
        for cls, raw, accepted in outcomes:
            row = self.counts.setdefault(cls, [[0.0, 0.0] for _ in range(self.buckets)])[
                self._bucket(min(max(raw, 0.0), 1.0))]
            row[0] += float(accepted)
            row[1] += 1.0

    def summary(self) -> dict[str, float]:
        """Each class's observed acceptance over all its buckets (nodes reached), for the engine's stats."""
        out = {}
        for cls, rows in self.counts.items():
            reached = sum(r[1] for r in rows)
            if reached:
                out[cls] = sum(r[0] for r in rows) / reached
        return out
