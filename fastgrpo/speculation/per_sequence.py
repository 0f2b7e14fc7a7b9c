"""`aware_per_sequence`: aware's tree, with the verify budget split between the running sequences.

`aware` verifies the same tree shape for every running sequence, but a draft is not equally sure of
every row: in one the next tokens are forced, in another it is guessing. After the draft has proposed
each row's tree, a node's cumulative draft probability p_j estimates the chance that verification
reaches it (every token on its path must be what the target samples). Verifying an ancestor-closed
set S of nodes then yields B + sum_{j in S} p_j tokens in expectation from a target forward of
B + |S| tokens (a ragged forward: each row its own count). The policy verifies the M most probable
nodes of the whole batch (the top-M set is ancestor-closed, since a child is never more probable than
its parent), M chosen to maximise

    goodput(M) = (B + c * sum_{top M} p_j) / (T_draft + T_verify(B + M))

where c, the draft's calibration (accepted / predicted over the nodes verified), is learned online,
T_draft + T_verify is the step of this shape as aware predicts it (measured, at the width this policy
usually verifies) and the verify's change with M is priced by the cost model in B rows, rescaled by
the online correction of plain steps at this concurrency.
Sequences whose drafts are confident get deep trees, the others a few nodes or none. M = B (n - 1),
every node, is aware's uniform tree, so the choice is never predicted slower than aware's; as aware
does for speculating at all, it cuts the tree only for a predicted gain above `margin` (5%): one
calibration factor cannot price every depth right, and cuts on thinner predicted gains lose accepted
tokens. Lossless: only which proposed tokens
are verified changes, never how (tree.py).

A static engine (CUDA graphs: every shape fixed when captured) cannot run a ragged forward: its verify
costs B w tokens for a tree width w (root included) that every row shares, whatever each row keeps. There
the engine passes the widths it has step functions for, and the choice is the width: each row keeps its
w - 1 most probable nodes (ancestor-closed, as above; in a shared width a row's extra nodes cost nothing),
w maximising

    goodput(w) = (B + c * sum_rows sum_{top w - 1} p_j) / (T_draft + T_verify(B w)),

so the tree narrows when every row's draft is unsure, and never for one row alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from fastgrpo.speculation.cost_model import CostModel
from fastgrpo.speculation.policy import Aware
from fastgrpo.speculation.spec import SpecConfig


class AwarePerSequence(Aware):
    name = "aware_per_sequence"

    def __init__(self, costs: CostModel, calibration_decay: float = 0.98, **aware_options):
        super().__init__(costs, **aware_options)
        self.calibration_decay = calibration_decay
        # accepted and predicted draft tokens over recent steps (a prior of one token each: c starts at 1)
        self._accepted, self._predicted = 1.0, 1.0
        self._step_prediction: float | None = None
        self.offered_nodes = 0  # non-root nodes drafted at speculative steps, and those verified
        self.verified_nodes = 0
        # tokens verified per row with each tree shape (root included), recent steps weighted most: what a
        # step of that shape costs. Its acceptance is learned from the cut trees too, so the choice of
        # shape (aware's) weighs what a cut tree yields against what it costs
        self._width: dict[SpecConfig, tuple[float, float]] = {}

    def _verified_tokens(self, c: SpecConfig, running: int) -> float:
        total, weight = self._width.get(c, (float(c.num_verify), 1.0))  # an untried shape: every node
        return running * total / weight

    def _verified_tokens_many(self, running: int) -> np.ndarray:
        tried = {c: total / weight for c, (total, weight) in self._width.items()}  # the shapes tried: a few
        return running * self.shapes.scatter(tried, self.shapes.nodes)

    @property
    def calibration(self) -> float:
        return min(max(self._accepted / self._predicted, 0.05), 2.0)

    def select(self, scores: Tensor, depth: Tensor, config: SpecConfig, running: int,
               widths: Sequence[int] | None = None) -> Tensor:
        """Which drafted nodes to verify: scores and depth [B, N - 1] of each row's non-root nodes
        (cumulative draft log-probabilities, tree levels). Returns [B, N - 1] bool. `widths`: the tree
        widths (nodes a row, root included) a static engine can verify, one for every row (module
        docstring); None: any set of nodes (a ragged verify). Scores of K < N - 1 nodes a row (the
        simulator's draft confidences, a coarser picture of the tree) each stand for (N - 1) / K of its
        nodes: verifying a share of them verifies that share of the tree, and is priced so.

        In numpy on the host: a static step's device waits for this choice, and a few dozen torch calls on
        arrays this small cost several times as many microseconds. Exact ties go to the parent, then to
        the earlier node."""
        B, K = scores.shape
        p, levels = np.exp(scores.cpu().numpy().astype(np.float64)), depth.cpu().numpy()
        key = -(p - 1e-9 * levels)  # ascending: most probable first; exact ties: the parent first
        per_node = (config.num_verify - 1) / K  # tokens a scored node stands for (1 in the engine)
        if widths is not None:  # every row verifies the same width w (in `widths`), its w - 1 most probable nodes
            order = np.argsort(key, axis=1, kind="stable")
            # expected accepts of every row's top m nodes, m = 0..K
            reach = np.concatenate([[0.0], np.take_along_axis(p, order, 1).sum(0).cumsum()])
            w = np.array(sorted({min(max(int(x), 1), K + 1) for x in widths} | {K + 1}))  # the whole tree last
            kept = int(w[self._best(reach[w - 1], B * (1 + per_node * (w - 1)), config, running, B)]) - 1
            nodes = np.zeros((B, K), dtype=bool)
            np.put_along_axis(nodes, order[:, :kept], True, 1)
        else:
            order = np.argsort(key.ravel(), kind="stable")
            reach = np.concatenate([[0.0], p.ravel()[order].cumsum()])  # expected accepts, M = 0..BK
            kept = self._best(reach, B + per_node * np.arange(B * K + 1), config, running, B)
            nodes = np.zeros(B * K, dtype=bool)
            nodes[order[:kept]] = True
            nodes = nodes.reshape(B, K)
        return torch.from_numpy(self._chosen(nodes, levels, config, float(reach[kept]))).to(depth.device)

    def _best(self, reach: np.ndarray, tokens: np.ndarray, config: SpecConfig, running: int, B: int) -> int:
        """Which choice to verify: choice i verifies `tokens[i]` tokens and expects `reach[i]` draft tokens
        accepted; the last is the whole tree. A step of this shape as measured (at the width it usually
        verifies), less or plus the verify tokens a choice saves or adds, priced as the target's measured /
        calibrated time at this concurrency: the step's fixed work (drafting, tree building, sampling) is not
        saved by verifying less (priced as draft + verify forwards alone, that work missing, cutting looks
        more rewarding than it is). A near tie keeps the whole tree (as aware speculates only for a clear
        gain: a single calibration factor misjudges depths)."""
        usual = self.costs.target(self._verified_tokens(config, running), rows=B)
        extra = self.costs.target_many(tokens, rows=B) - usual
        seconds = np.maximum(self.predicted_seconds(config, running) + self._correction(running) * extra, 1e-9)
        rate = (B + self.calibration * reach) / seconds
        best = int(rate.argmax())
        return len(rate) - 1 if rate[best] < rate[-1] * (1 + self.margin) else best

    def _chosen(self, nodes: np.ndarray, depth: np.ndarray, config: SpecConfig, prediction: float) -> np.ndarray:
        """Record a step's choice of `nodes` [B, N - 1] (the levels acceptance may learn, the prediction the
        calibration compares with the step's accepts, the width this shape verifies) and return it."""
        B, K = nodes.shape
        verified = int(nodes.sum())
        self.verified_depth = (depth * nodes).max(1).tolist()  # what acceptance may learn
        self._step_prediction = prediction
        total, weight = self._width.get(config, (float(config.num_verify), 1.0))
        d = self.calibration_decay
        tokens = 1 + (config.num_verify - 1) * verified / (B * K)  # a row's, root included (`select`)
        self._width[config] = (d * total + tokens, d * weight + 1)
        self.offered_nodes += B * K
        self.verified_nodes += verified
        return nodes

    def observe(self, config: SpecConfig | None, running: int, emitted: int, seconds: float,
                accepted: list[int] | None = None) -> None:
        if config is not None and accepted is not None and self._step_prediction is not None:
            d = self.calibration_decay
            self._accepted = d * self._accepted + sum(accepted)
            self._predicted = d * self._predicted + self._step_prediction
        self._step_prediction = None
        super().observe(config, running, emitted, seconds, accepted)
