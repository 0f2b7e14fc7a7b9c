"""Speculation policies: how much to speculate at a decode step, given how many sequences run.

All policies run inside the same engine, so they compare fairly. `choose` returns None for plain
decoding (one token per sequence per target forward).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from fastgrpo.speculation.cost_model import CostModel
from fastgrpo.speculation.spec import SpecConfig

if TYPE_CHECKING:
    from torch import Tensor


def concurrency_bucket(running: int) -> int:
    """1, 2, 4, 8, ...: the smallest power of two >= running (what policies learn per)."""
    return 1 << max(running - 1, 0).bit_length()


def context_level(context: float | None) -> float | None:
    """Cached tokens per running row, rounded to a quarter octave (19% steps): a step is priced, and its
    best tree searched, once per level, not at every step's context."""
    if context is None or context <= 0:
        return None
    return 2 ** (round(4 * math.log2(context)) / 4)


class SpeculationPolicy(Protocol):
    name: str

    def choose(self, running: int, context: float | None = None) -> SpecConfig | None:
        """`context`: cached tokens a step's attention reads per running row (the embedded engine: its
        longest row's, its cache is padded to it; a paged cache: the rows' mean); None: not known."""

    def observe(self, config: SpecConfig | None, running: int, emitted: int, seconds: float,
                accepted: list[int] | None = None) -> None: ...


@runtime_checkable
class PerSequencePolicy(SpeculationPolicy, Protocol):
    """A policy that also splits the verify budget between the running sequences: after the draft has
    proposed each row's tree of `config`, the engine verifies only the nodes `select` keeps
    (`isinstance(policy, PerSequencePolicy)` is how the engine asks; `aware_per_sequence` is one)."""

    def select(self, scores: Tensor, depth: Tensor, config: SpecConfig, running: int) -> Tensor:
        """Which drafted nodes to verify: scores and depth [B, N - 1] of each row's non-root nodes
        (cumulative draft log-probabilities, tree levels). Returns [B, N - 1] bool, ancestor-closed."""


class Off:
    name = "off"

    def choose(self, running: int, context: float | None = None) -> SpecConfig | None:
        return None

    def observe(self, config: SpecConfig | None, running: int, emitted: int, seconds: float,
                accepted: list[int] | None = None) -> None:
        pass


class Static(Off):
    """One fixed tree shape at every concurrency (what static speculative systems do)."""

    name = "static"

    def __init__(self, config: SpecConfig):
        self.config = config

    def choose(self, running: int, context: float | None = None) -> SpecConfig | None:
        return self.config


class FastGRPOFormula(Off):
    """FastGRPO's published rule (docs/speculation.md), guarded: with a fixed capacity C = 160 verify
    tokens, n = min(C // B, 160) per sequence, depth = clamp(floor(log2(n / 0.75)), 3, 5),
    top-k = min(n - 1, 8). Where the original would build an empty tree (B > 80) or crash (B > 160),
    this falls back to plain decoding."""

    name = "fastgrpo"
    capacity = 160

    def choose(self, running: int, context: float | None = None) -> SpecConfig | None:
        n = min(self.capacity // max(running, 1), 160)
        topk = min(n - 1, 8)
        if n < 2 or topk < 1:
            return None
        depth = min(max(int(math.floor(math.log2(n / 0.75))), 3), 5)
        max_nodes = topk + (depth - 1) * topk**2
        return SpecConfig(depth=depth, topk=topk, num_verify=min(n, max_nodes + 1))


def candidate_configs(max_depth: int = 6) -> list[SpecConfig]:
    """The shapes `aware` chooses among (plain decoding is always a candidate too)."""
    out = []
    for depth in range(1, max_depth + 1):
        for topk in (1, 2, 4, 8):
            for n in (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64):
                chain, fits = n - 1 == depth, depth <= n - 1 <= topk + (depth - 1) * topk**2
                if fits and (chain if topk == 1 else not chain):  # a chain is width 1; a tree is wider
                    out.append(SpecConfig(depth, topk, n))
    return out


class AcceptanceModel:
    """Expected tokens emitted per sequence per step for any tree shape, learned online.

    Two pieces of evidence, both per sequence (so what is learned at one concurrency transfers to
    all others): the chance alpha_d that a step which reached depth d - 1 of its tree also accepts
    depth d (pooled over shapes: a prior for shapes never tried), and the mean emitted tokens of each
    shape actually used (which overrides the prior as it accumulates).
    """

    def __init__(self, prior_alpha: float = 0.6, prior_weight: float = 8.0, max_depth: int = 16):
        self.reached = [prior_weight] * (max_depth + 2)
        self.passed = [prior_weight * prior_alpha] * (max_depth + 2)
        self.prior_weight = prior_weight
        self.sum_emitted: dict[SpecConfig, float] = {}
        self.count: dict[SpecConfig, float] = {}

    def alpha(self, d: int) -> float:
        return self.passed[d] / self.reached[d]

    def prior(self, c: SpecConfig) -> float:
        # a tree of depth D and n - 1 nodes: nodes are spread over the levels, so a shape with fewer
        # nodes than depth * width accepts less at depth than a full one (crudely, by the fill ratio)
        width = max(1.0, c.topk * min(1.0, (c.num_verify - 1) / (c.depth * c.topk)))
        expected, reach = 1.0, 1.0
        for d in range(1, c.depth + 1):
            reach *= 1 - (1 - self.alpha(d)) ** width  # any of ~width alternatives accepted
            expected += reach
        return expected

    def expected(self, c: SpecConfig) -> float:
        n = self.count.get(c, 0.0)
        return (self.prior(c) * self.prior_weight + self.sum_emitted.get(c, 0.0)) / (self.prior_weight + n)

    def observe(self, c: SpecConfig, accepted: list[int], verified_depth: list[int] | None = None) -> None:
        """`verified_depth`: per sequence, the deepest level of its tree that was verified at all (a
        per-sequence budget verifies part of a tree): a level past it was never tried, so a sequence
        that accepted everything up to it says nothing of alpha beyond (counted as a rejection, the
        cut trees at one sequence pulled every shape's prior down, and so speculation at four). The
        deepest over the row's whole tree: a level verified on another branch than the accepted path
        still counts as tried there, a slight undercount of alpha the budget's cuts cause."""
        for i, a in enumerate(accepted):
            tried = c.depth if verified_depth is None else min(c.depth, verified_depth[i])
            for d in range(1, min(a + 1, tried) + 1):
                self.reached[d] += 1
                self.passed[d] += d <= a
        self.sum_emitted[c] = self.sum_emitted.get(c, 0.0) + sum(a + 1 for a in accepted)
        self.count[c] = self.count.get(c, 0.0) + len(accepted)


class Aware(Off):
    """fastgrpo's rule (docs/speculation.md): at B running sequences choose the shape c maximising

        goodput(c) = B * E[emitted | c] / (T_draft(c, B) + T_verify(B * n_c))

    over a candidate set that contains plain decoding (E = 1, no draft, n = 1). T_* come from the
    measured cost model at the running rows' context, rescaled online by the ratio of real to predicted
    step times (per kind and concurrency bucket); E comes from the acceptance model. A tree must beat
    plain decoding by `margin` to be chosen."""

    name = "aware"

    def __init__(self, costs: CostModel, candidates: list[SpecConfig] | None = None, correction_decay: float = 0.9,
                 probe_every: int = 64, max_probe_every: int = 1024, margin: float = 0.05, probe_budget: float = 0.0025):
        self.costs = costs
        # speculate only for a predicted gain above this fraction: near a tie the step-time noise and
        # the costs the model leaves out (catch-up after a gap, tree bookkeeping) decide, and they lose
        self.margin = margin
        self.candidates = candidates or candidate_configs()
        self.acceptance = AcceptanceModel()
        self.decay = correction_decay
        self.probe_every = probe_every
        # measured / predicted step time, per kind (off, spec) and concurrency bucket: the calibration's
        # error differs between one sequence and sixty-four, so a factor learned at one must not move another
        self.correction: dict[tuple[str, int], float] = {}
        self._measured: set[tuple[str, int]] = set()  # (kind, bucket) measured at least once
        # steps in a bucket since each kind was last measured there: the kind not being chosen is
        # measured again (one probe step) after `probe_every` steps, so that a decision never rests for
        # long on a calibration that was wrong or on a slow spell of a shared machine. A probe that
        # confirms the choice doubles the bucket's interval (up to max_probe_every): a probe costs
        # a slower step, and a clear decision needs few of them; one that overturns it resets it
        self._since: dict[tuple[str, int], int] = {}
        self.max_probe_every = max_probe_every
        # a probe of speculation while plain decoding is chosen costs (its predicted step time / a plain
        # step's) - 1 extra plain steps, several at high concurrency: probe no more often than keeps that
        # extra time below `probe_budget` of the time between probes: probes must cost well under the 3%
        # the never-slower guarantee allows (`bench guarantee`), leaving room for the machine's noise
        self.probe_budget = probe_budget
        self._probe_interval: dict[int, int] = {}
        self._probing: int | None = None  # bucket of the step being probed
        # best tree per concurrency: (shape, its goodput, its step seconds). Its inputs (the acceptance
        # model and the speculative correction) move only when speculative steps are observed, so it is
        # refreshed then (every 16 of them, or after a probe), not searched anew at every step: a
        # search over the candidates costs more than a small model's plain step
        self._trees: dict[tuple[int, float | None], tuple[SpecConfig | None, float, float]] = {}
        # the context level (context_level) of the step being decided: every price is at it. Reading
        # the rows' caches costs a plain step and a tree step alike, so a step priced at the sweep's
        # context and scaled by a measured ratio makes a tree look dearer the longer the context is
        self.context: float | None = None
        # per sequence, the deepest tree level this step verifies: set by a budget that cuts the tree
        # (aware_per_sequence), None for every level; acceptance learns only the levels tried
        self.verified_depth: list[int] | None = None
        self._spec_observed = 0
        self.probes = 0  # probe steps taken (the guarantee bench reports what they cost)

    _bucket = staticmethod(concurrency_bucket)

    def _correction(self, kind: str, running: int) -> float:
        return self.correction.get((kind, self._bucket(running)), 1.0)

    def predicted_seconds(self, c: SpecConfig | None, running: int) -> float:
        return self._calibrated_seconds(c, running) * self._correction("off" if c is None else "spec", running)

    def _calibrated_seconds(self, c: SpecConfig | None, running: int) -> float:
        """The step's time by the calibration alone (before the online correction)."""
        if c is None:
            return self.costs.at_context("target", running, running, self.context)
        tokens = self._verified_tokens(c, running)
        return self._draft_seconds(c, running) + self.costs.at_context("target", tokens, running, self.context)

    def _verified_tokens(self, c: SpecConfig, running: int) -> float:
        """Tokens in the verify forward of a step of tree c: every node of every row."""
        return running * c.num_verify

    def _draft_seconds(self, c: SpecConfig, running: int) -> float:
        catch_up = running * self.acceptance.expected(c)  # last step's accepted states, fed to the draft
        return (self.costs.at_context("draft", catch_up, running, self.context)
                + (c.depth - 1) * self.costs.at_context("draft", running * c.topk, running, self.context))

    def goodput(self, c: SpecConfig | None, running: int) -> float:
        emitted = 1.0 if c is None else self.acceptance.expected(c)
        return running * emitted / self.predicted_seconds(c, running)

    def best_tree(self, running: int) -> tuple[SpecConfig | None, float]:
        """The candidate tree of highest predicted goodput at `running`, and that goodput."""
        tree, rate, _ = self._tree(running)
        return tree, rate

    def _tree(self, running: int) -> tuple[SpecConfig | None, float, float]:
        if (key := (running, self.context)) not in self._trees:
            best, best_rate = None, 0.0
            for c in self.candidates:
                rate = self.goodput(c, running)
                if rate > best_rate:
                    best, best_rate = c, rate
            seconds = 0.0 if best is None else self.predicted_seconds(best, running)
            self._trees[key] = (best, best_rate, seconds)
        return self._trees[key]

    def _decide(self, running: int) -> SpecConfig | None:
        tree, rate, _ = self._tree(running)
        return tree if rate > self.goodput(None, running) * (1 + self.margin) else None

    def choose(self, running: int, context: float | None = None) -> SpecConfig | None:
        self.context = context_level(context)
        b = self._bucket(running)
        if ("off", b) not in self._measured:
            # a bucket's first step is plain: plain decoding is never a loss, and its measured time anchors
            # every later comparison (a calibration swept while another process held a core once read the
            # same ~225 ms for 1 and 512 tokens, so the largest tree looked free and cost 10 plain steps)
            return None
        choice = self._decide(running)
        other = "spec" if choice is None else "off"
        if self._since.get((other, b), 0) >= self._interval(running, choice):
            self._probing = b
            self.probes += 1
            return None if other == "off" else self._tree(running)[0]
        return choice

    def _interval(self, running: int, choice: SpecConfig | None) -> int:
        """Steps between probes of the kind not chosen in this bucket."""
        interval = self._probe_interval.get(self._bucket(running), self.probe_every)
        tree, _, tree_seconds = self._tree(running)
        if choice is None and tree is not None:  # the probe would be a speculative step: bound its share
            extra = tree_seconds / self.predicted_seconds(None, running) - 1
            interval = max(interval, math.ceil(extra / self.probe_budget))
        return interval

    def observe(self, config: SpecConfig | None, running: int, emitted: int, seconds: float,
                accepted: list[int] | None = None) -> None:
        kind, other = ("off", "spec") if config is None else ("spec", "off")
        b = self._bucket(running)
        # unbounded but for absurd values: a sweep taken while another process held a core can be wrong
        # by 80x (every forward a scheduler stall), and only this correction can undo it
        ratio = min(max(seconds / max(self._calibrated_seconds(config, running), 1e-9), 1e-3), 1e3)
        # the first measurement of a kind in a bucket replaces the calibration; later ones are averaged,
        # a probe (rare, and the only fresh evidence on its kind) with weight one half. Until the other
        # kind is measured there, it takes the same factor: a calibration is most likely off by a common
        # scale (a busier or faster machine than during the sweep), and so the two stay comparable
        probe = self._probing == b
        current = self.correction.get((kind, b)) if (kind, b) in self._measured else None
        self._measured.add((kind, b))
        keep = 0.5 if probe else self.decay
        self.correction[(kind, b)] = ratio if current is None else keep * current + (1 - keep) * ratio
        if (other, b) not in self._measured:
            self.correction[(other, b)] = self.correction[(kind, b)]
            if current is None:  # (searched again on the first measurement only: a search costs ~0.5 ms)
                self._trees.clear()
        self._since[(kind, b)] = 0
        self._since[(other, b)] = self._since.get((other, b), 0) + 1
        if config is not None:
            if accepted is not None:
                self.acceptance.observe(config, accepted, self.verified_depth)
                self.verified_depth = None  # this step's
            self._spec_observed += 1
            if self._spec_observed % 16 == 0 or probe or current is None:
                self._trees.clear()  # fresh evidence on speculation: search the trees again
        if probe:
            self._probing = None
            overturned = (self._decide(running) is None) == (config is None)
            interval = self._probe_interval.get(b, self.probe_every)
            self._probe_interval[b] = self.probe_every if overturned else min(2 * interval, self.max_probe_every)
