"""Speculation policies: how much to speculate at a decode step, given how many sequences run.

All policies run inside the same engine, so they compare fairly. `choose` returns None for plain
decoding (one token per sequence per target forward).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from fastgrpo.speculation.batch_time import batch_seconds
from fastgrpo.speculation.cost_model import CostModel
from fastgrpo.speculation.spec import SpecConfig

if TYPE_CHECKING:
    from torch import Tensor


def concurrency_bucket(running: int) -> int:
    """1, 2, 4, 8, ...: the smallest power of two >= running (what policies learn per)."""
    return 1 << max(running - 1, 0).bit_length()


def quarter_octave(x: float) -> float:
    """x > 0 rounded to a quarter octave (19% steps)."""
    return 2 ** (round(4 * math.log2(x)) / 4)


def running_level(running: int) -> float:
    """Running sequences, by quarter octave: the best tree is searched once per level, and its price taken
    at each running count (a GRPO batch's tail meets every count from its batch down to one, and a search
    at each cost a few percent of a small model's replayed steps)."""
    return quarter_octave(max(running, 1))


def context_level(context: float | None) -> float | None:
    """Cached tokens per running row, by quarter octave: a step is priced, and its best tree searched,
    once per level, not at every step's context."""
    if context is None or context <= 0:
        return None
    return quarter_octave(context)


# a step this many times its kind's mean is read as a stall of the machine, not as the kind's cost
# (`running_mean`): a shared CPU stalls single steps by 2-3x, and one such step taken for a tree's cost
# chose plain decoding, whose probes of speculation are then hundreds of steps apart
SPIKE = 1.5


def running_mean(mean: float, n: float, value: float, weight: float) -> tuple[float, float]:
    """A kind's running mean of step costs after `value` joins its `n` earlier steps (weight `weight`), and the
    weight `value` had in it. Robust to stalls of the machine, which make steps slower and never faster: of a
    kind's first two steps, when more than SPIKE apart, the lesser stands alone; a later step counts as at
    most SPIKE times the mean (at least 1 / SPIKE of it), so a real change of pace still moves the mean, a
    few percent a step."""
    if n == 1 and max(mean, value) > SPIKE * min(mean, value):
        return min(mean, value), float(value < mean)
    return (1 - weight) * mean + weight * min(max(value, mean / SPIKE), mean * SPIKE), weight


class SpeculationPolicy(Protocol):
    """What an engine asks each decode step: `choose`, then, after the step, `observe`. A policy may also
    define `ahead(running, context, config)`, which a static engine calls while the device computes the
    step (between its launch and its results' read-back), for work no step need wait for (`Aware.ahead`)."""

    name: str

    def choose(self, running: int, context: float | None = None) -> SpecConfig | None:
        """`context`: cached tokens a step's attention reads per running row (the embedded engine: its
        longest row's, its cache is padded to it; a paged cache: the rows' mean); None: not known."""

    def observe(self, config: SpecConfig | None, running: int, emitted: int, seconds: float | None,
                accepted: list[int] | None = None) -> None:
        """`seconds`: the step's wall time, or None where that time is not what such a step costs (it
        captured a CUDA graph: an eager run and a recording, tens of steps' worth): learn from its tokens
        alone."""


@runtime_checkable
class PerSequencePolicy(SpeculationPolicy, Protocol):
    """A policy that also splits the verify budget between the running sequences: after the draft has
    proposed each row's tree of `config`, the engine verifies only the nodes `select` keeps
    (`isinstance(policy, PerSequencePolicy)` is how the engine asks; `aware_per_sequence` is one)."""

    def select(self, scores: Tensor, depth: Tensor, config: SpecConfig, running: int,
               widths: Sequence[int] | None = None) -> Tensor:
        """Which drafted nodes to verify: scores and depth [B, N - 1] of each row's non-root nodes
        (cumulative draft log-probabilities, tree levels). Returns [B, N - 1] bool, ancestor-closed.
        `widths`: a static engine's tree widths (nodes a row, root included): then every row keeps at
        most one width's nodes less the root, the verify running at that width for all rows."""


class Off:
    name = "off"

    def choose(self, running: int, context: float | None = None) -> SpecConfig | None:
        return None

    def observe(self, config: SpecConfig | None, running: int, emitted: int, seconds: float | None,
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


def tree_width(c: SpecConfig) -> float:
    """Candidates a tree keeps per level, crudely: its nodes spread over its levels, at most top-k (a
    shape with fewer nodes than depth x top-k keeps fewer alternatives at each level than a full one)."""
    return max(1.0, min(float(c.topk), (c.num_verify - 1) / c.depth))


class Shapes:
    """Tree shapes as arrays, so that one search prices every candidate in a few numpy operations: a GRPO
    batch searches again at each running count of its tail, every few steps, and one shape at a time in
    Python (~4 us each) that was several percent of a graph-replayed step of a small model."""

    def __init__(self, configs: list[SpecConfig]):
        self.configs = configs
        self.index = {c: i for i, c in enumerate(configs)}
        self.depth = np.array([c.depth for c in configs], dtype=np.float64)
        self.topk = np.array([c.topk for c in configs], dtype=np.float64)
        self.nodes = np.array([c.num_verify for c in configs], dtype=np.float64)  # root included
        self.levels = np.arange(1, int(self.depth.max(initial=0)) + 1)  # 1..the deepest shape's depth
        self.width = np.array([tree_width(c) for c in configs], dtype=np.float64)
        self.has_level = self.levels[None, :] <= self.depth[:, None]

    def scatter(self, values: dict[SpecConfig, float], base: np.ndarray | float = 0.0) -> np.ndarray:
        """An array over the shapes: `values` where a shape has one (the few measured), else `base`."""
        out = np.array(np.broadcast_to(base, (len(self.configs),)), dtype=np.float64)
        for c, v in values.items():
            if (i := self.index.get(c)) is not None:
                out[i] = v
        return out


class AcceptanceModel:
    """Expected tokens emitted per sequence per step for any tree shape, learned online.

    Two pieces of evidence, both per sequence (so what is learned at one concurrency transfers to
    all others): the chance alpha_d that the draft's first candidate at level d is the target's token,
    given the path to it (pooled over shapes: a prior for shapes never tried), and the mean emitted
    tokens of each shape actually used (which overrides the prior as it accumulates).

    Each level's alpha_d is its own passes and reaches shrunk toward the pooled alpha of every level
    (`prior_weight` rows of it), and the pooled alpha toward `prior_alpha` (as many): a level no tree
    has reached yet takes what the levels tried say, not the fixed prior. Held to the prior, the levels
    beyond the tree in use priced every deeper tree by a guess (0.6 against a draft's 0.7: deep trees
    4-6% short of their tokens a step, and a shallower tree held where a deeper one was best).

    A tree keeping w candidates a level (`tree_width`) misses level d with chance (1 - alpha_d) w^-beta,
    the law `bench simulate` fits to measured acceptance (beta 0.4-0.9 over its profiles, median 0.7):
    a draft's alternatives are not independent guesses, and (1 - alpha)^w promised a width-8 tree nearly
    every level. Evidence from a tree of width w is taken in first-candidate units, so that it carries
    to every width: a level passed counts 1, a level missed 1 - w^beta (the expectation of which is
    alpha_d, as a level of that tree is passed with chance 1 - (1 - alpha_d) w^-beta). Counted as the
    tree's own pass rate, a wide tree's evidence raised alpha, and the prior then widened it again.
    """

    def __init__(self, prior_alpha: float = 0.6, prior_weight: float = 8.0, max_depth: int = 16, beta: float = 0.7):
        # per level, rows that reached it and of those the passes, in first-candidate units (`observe`)
        self.reached = [0.0] * (max_depth + 2)
        self.passed = [0.0] * (max_depth + 2)
        self.prior_alpha, self.prior_weight = prior_alpha, prior_weight
        self.beta = beta
        self.sum_emitted: dict[SpecConfig, float] = {}
        self.sum_squares: dict[SpecConfig, float] = {}  # of each row's tokens a step (`moments_many`)
        self.count: dict[SpecConfig, float] = {}

    def pooled(self) -> float:
        """The alpha of every level's rows together, shrunk toward `prior_alpha`: an untried level's."""
        return (sum(self.passed) + self.prior_weight * self.prior_alpha) / (sum(self.reached) + self.prior_weight)

    def alpha(self, d: int, pooled: float | None = None) -> float:
        pooled = self.pooled() if pooled is None else pooled
        alpha = (self.passed[d] + self.prior_weight * pooled) / (self.reached[d] + self.prior_weight)
        return min(max(alpha, 0.0), 1.0)  # (a few misses of a wide tree: below 0)

    def prior(self, c: SpecConfig) -> float:
        miss = tree_width(c) ** -self.beta  # of a level, relative to one candidate's
        expected, reach, pooled = 1.0, 1.0, self.pooled()
        for d in range(1, c.depth + 1):
            reach *= 1 - (1 - self.alpha(d, pooled)) * miss
            expected += reach
        return expected

    def expected(self, c: SpecConfig) -> float:
        n = self.count.get(c, 0.0)
        return (self.prior(c) * self.prior_weight + self.sum_emitted.get(c, 0.0)) / (self.prior_weight + n)

    def _reach_many(self, shapes: Shapes) -> np.ndarray:
        """[shapes, levels]: the prior's chance that a row's accepted path reaches each level (0 past a shape's
        depth), `prior`'s product over levels as one cumulative product."""
        pooled = self.pooled()
        alpha = np.array([self.alpha(d, pooled) for d in shapes.levels], dtype=np.float64)
        miss = shapes.width[:, None] ** -self.beta
        reach = np.cumprod(np.where(shapes.has_level, 1 - (1 - alpha[None, :]) * miss, 1.0), axis=1)
        return np.where(shapes.has_level, reach, 0.0)

    def _blend(self, shapes: Shapes, prior: np.ndarray, sums: dict[SpecConfig, float]) -> np.ndarray:
        """The prior's figure per shape, weighed `prior_weight` rows, with the rows measured of each (`sums`
        over `count` rows; the shapes measured are a few)."""
        return (prior * self.prior_weight + shapes.scatter(sums)) / (self.prior_weight + shapes.scatter(self.count))

    def expected_many(self, shapes: Shapes) -> np.ndarray:
        """`expected` of every shape at once."""
        return self._blend(shapes, 1.0 + self._reach_many(shapes).sum(axis=1), self.sum_emitted)

    def moments_many(self, shapes: Shapes) -> tuple[np.ndarray, np.ndarray]:
        """Every shape's tokens a row a step X: E[X] (`expected_many`) and E[X^2], the prior's (X = 1 + A, A
        the levels accepted: E[A^2] = sum over levels d of (2d - 1) P(A >= d)) blended with the measured
        rows' as the mean is. How unevenly rows finish a fixed length depends on it (`batch_seconds`)."""
        reach = self._reach_many(shapes)
        levels = reach.sum(axis=1)
        second = 1.0 + 2.0 * levels + (reach * (2.0 * shapes.levels - 1.0)[None, :]).sum(axis=1)
        return self._blend(shapes, 1.0 + levels, self.sum_emitted), self._blend(shapes, second, self.sum_squares)

    def observe(self, c: SpecConfig, accepted: list[int], verified_depth: list[int] | None = None) -> None:
        """`verified_depth`: per sequence, the deepest level of its tree that was verified at all (a
        per-sequence budget verifies part of a tree): a level past it was never tried, so a sequence
        that accepted everything up to it says nothing of alpha beyond (counted as a rejection, the
        cut trees at one sequence pulled every shape's prior down, and so speculation at four). The
        deepest over the row's whole tree: a level verified on another branch than the accepted path
        still counts as tried there, a slight undercount of alpha the budget's cuts cause."""
        # counted per distinct (accepted, tried) pair, not per sequence: a step of 256 rows has a few
        if verified_depth is None:  # (every row tried every level: counting the lengths alone is 3x faster)
            pairs = [((a, c.depth), rows) for a, rows in Counter(accepted).items()]
        else:
            pairs = Counter(zip(accepted, (min(c.depth, v) for v in verified_depth))).items()
        missed = 1.0 - tree_width(c) ** self.beta  # a level missed, in first-candidate units
        for (a, t), rows in pairs:
            for d in range(1, min(a + 1, t) + 1):
                self.reached[d] += rows
                self.passed[d] += rows * (1.0 if d <= a else missed)
        self.sum_emitted[c] = self.sum_emitted.get(c, 0.0) + (sum(accepted) + len(accepted))
        self.sum_squares[c] = self.sum_squares.get(c, 0.0) + sum(rows * (a + 1) ** 2 for (a, _), rows in pairs)
        self.count[c] = self.count.get(c, 0.0) + len(accepted)


class StepFit:
    """A speculative step's seconds in one concurrency bucket, fitted online to measured steps:

        T(c) = max(U - u, 0) + f * min(U / u, 1) * F(c) + U * (h + g * depth(c) + q * (nodes(c) - 1))

    u is a plain step's calibrated forward and U its measured time there (the calibration times plain's
    correction). A plain step slower than its forward (U > u) pays U - u beyond it: host work (sampling,
    bookkeeping, launches) that a speculative step pays too. One faster than its forward (U < u) says the
    calibration overprices this machine (a sweep taken while it was busy): every forward is scaled by
    U / u. F(c) is the step's calibrated forwards (the draft's levels and the verify,
    `Aware._calibrated_seconds`), h a further fixed cost, g a cost per draft level and q one per verified
    node of a row beyond its root, in plain steps. On an eager GPU engine most of a step is host work per
    step and per level that no forward timing sees, and a verify of many tokens can cost more than its
    forward alone; h, g and q price them, and since f, g and q weigh trees by their size and depth,
    measured times change which shape wins, not only whether to speculate.

    The evidence is kept per shape, not per step: each shape's running mean of (F, seconds, u) (its
    first measurement sets it; later ones move it by `1 - decay`, a probe by a half). Aware takes
    one shape for long stretches and measures the others only at its rare probes; a window of recent
    steps would hold the chosen shape alone, whose cost cannot separate f from h and g, and the fit would
    fall back to its prior exactly where shapes must be compared. Each shape weighs min(its steps,
    `cap`) in a weighted least squares, with a ridge of `prior_weight` toward f = 1, h = g = q = 0 (until
    shapes disagree, a speculative step costs a plain step's overhead plus its forwards); h, g, q stay >= 0,
    and g (q) is fitted only once shapes of two depths (node counts) are measured. A measured shape is
    priced by the fit plus its own excess over it, as far as its weight w earns against one step's
    (w / (w + 1)): a shape whose costs are not the others' kind is priced by its own steps."""

    def __init__(self, prior_weight: float = 1.0, decay: float = 0.9, cap: float = 4.0, per_node: bool = True):
        self.shapes: dict[SpecConfig, list[float]] = {}  # per shape: mean [F, seconds, u], its steps, mean log2 context
        self.per_node = per_node  # fit q (else 0: forwards alone price a tree's size)
        self.prior_weight, self.decay, self.cap = prior_weight, decay, cap
        self.f, self.h, self.g, self.q = 1.0, 0.0, 0.0, 0.0
        self.residual: dict[SpecConfig, float] = {}  # per measured shape, in plain steps (`fit`)

    def add(self, forwards: float, c: SpecConfig, seconds: float, plain: float, probe: bool = False,
            context: float | None = None) -> None:
        octave = math.log2(context) if context else 0.0
        seen = self.shapes.get(c)
        if seen is None:
            self.shapes[c] = [forwards, seconds, plain, 1.0, octave]
            return
        # the pace (seconds / u: the context's growth taken out) is a robust mean (`running_mean`); the other
        # terms follow with the weight it gave this step
        pace, w = running_mean(seen[1] / seen[2], seen[3], seconds / plain, 0.5 if probe else 1 - self.decay)
        for i, value in ((0, forwards), (2, plain), (4, octave)):
            seen[i] += w * (value - seen[i])
        seen[1] = pace * seen[2]
        seen[3] += 1

    def pace(self, c: SpecConfig) -> float | None:
        """Shape c's measured seconds in plain steps of its context (its mean seconds / its mean u), or None
        if never measured: how fast the machine runs it now, the context's growth taken out."""
        seen = self.shapes.get(c)
        return None if seen is None else seen[1] / seen[2]

    def follow(self, factor: float, measured: SpecConfig | None = None) -> None:
        """Scale every shape's seconds but `measured`'s by `factor`: the machine's pace moved by it."""
        for c, seen in self.shapes.items():
            if c != measured:
                seen[1] *= factor

    def fit(self, scale: float, context: float | None = None) -> None:
        """Refit with `scale`, plain's current correction (U = u * scale), for steps at `context` cached
        tokens a row: against the shapes measured nearest that context, a shape measured an octave further
        weighs half as much, two octaves a quarter, further not at all. How far the calibration is off
        depends on the context, and a wide shape tried once early and never again, however lightly
        weighted, would set the per-node cost q alone (its node count gives it the leverage) and price
        every tree its size out of reach. Relative to the nearest, so that evidence is never all dropped:
        with none left, the calibration alone, however wrong, would decide again."""
        self.f, self.h, self.g, self.q = 1.0, 0.0, 0.0, 0.0
        self.residual = {}
        if not self.shapes:
            return
        octave = math.log2(context) if context else None
        far = {c: 0.0 if octave is None else abs(octave - v[4]) for c, v in self.shapes.items()}  # octaves away
        nearest = min(far.values())
        rows = [(c, F, sec, u, min(n, self.cap) * 0.5 ** (far[c] - nearest))
                for c, (F, sec, u, n, _) in self.shapes.items() if far[c] - nearest <= 2]
        w = np.sqrt(np.array([weight for *_, weight in rows], dtype=np.float64))[:, None]
        x = w * np.array([[F * min(scale, 1) / (u * scale), 1.0, float(c.depth), c.num_verify - 1.0]
                          for c, F, _, u, _ in rows], dtype=np.float64)
        y = w[:, 0] * np.array([(sec - u * max(scale - 1, 0)) / (u * scale) for _, _, sec, u, _ in rows],
                               dtype=np.float64)
        prior = np.array([1.0, 0.0, 0.0, 0.0])
        # a cost per level (per node) is fitted only from shapes of two depths (node counts) or more: from
        # one, it cannot be told from the fixed cost, and the ridge gave most of a shape's unexplained
        # time to its largest feature, the node count, which then priced every larger tree out of reach
        keep = [0, 1] + [2] * (len({c.depth for c, *_ in rows}) > 1)
        keep += [3] * (self.per_node and len({c.num_verify for c, *_ in rows}) > 1)
        while True:  # least squares with the overheads >= 0: drop a negative one and solve again
            xs, ridge = x[:, keep], self.prior_weight * np.eye(len(keep))
            solved = np.linalg.solve(xs.T @ xs + ridge, xs.T @ y + ridge @ prior[keep])
            negative = [k for k, v in zip(keep, solved.tolist()) if k > 0 and v < 0]
            if not negative:
                break
            keep.remove(negative[0])
        theta = np.zeros(4)
        theta[keep] = solved
        self.f, self.h, self.g, self.q = theta.tolist()  # (q: 0 unless per_node)
        # each measured shape's own evidence, beyond the fit, as its weight earns it against one step's
        weights = w[:, 0] ** 2
        residual = (y - x @ theta) / w[:, 0] * weights / (weights + 1)
        self.residual = {c: r for (c, *_), r in zip(rows, residual.tolist())}

    def seconds(self, forwards: float, c: SpecConfig, plain: float, scale: float) -> float:
        """plain: u, a plain step's calibrated forward; scale: plain's correction (U = u * scale)."""
        return self.seconds_of(forwards, c.depth, c.num_verify, plain, scale, self.residual.get(c, 0.0))

    def seconds_of(self, forwards, depth, nodes, plain: float, scale: float, residual=0.0):
        """`seconds` of a shape of `depth` levels and `nodes` verified a row (floats, or arrays of shapes)."""
        overhead = self.h + self.g * depth + self.q * (nodes - 1) + residual
        return plain * max(scale - 1, 0) + self.f * min(scale, 1) * forwards + plain * scale * overhead

    def to_json(self) -> dict:
        return {"f": self.f, "h": self.h, "g": self.g, "q": self.q, "shapes": len(self.shapes),
                "steps": int(sum(v[3] for v in self.shapes.values()))}


# a search's findings (`Aware._search`): the best tree, the best `explore` shapes by goodput (probed), the best
# `BATCH_SHAPES` of distinct sizes (ranked again by a batch's time where its rows' lengths are known), the
# contrast to measure
Searched = tuple[SpecConfig | None, list[SpecConfig], list[SpecConfig], SpecConfig | None]

# steps a probe of speculation takes while plain decoding is chosen: the first catches the draft up (`observe`
# does not price it), the second is measured
PROBE_STEPS = 2


class Aware(Off):
    """fastgrpo's rule (docs/speculation.md): at B running sequences choose the shape c maximising

        goodput(c) = B * E[emitted | c] / T_step(c, B)

    over a candidate set that contains plain decoding (E = 1, one target forward of B tokens). A plain
    step's T is its calibrated forward times the bucket's measured correction; a speculative step's is
    `StepFit`'s model of whole measured steps (its calibrated forwards, a fixed cost and a cost per draft
    level), per concurrency bucket at the running rows' context; E comes from the acceptance model,
    seeded with the draft's measured acceptance when known. Where every row's length is known (EOS
    ignored: `tokens_left`), the best few shapes by goodput are ranked again by the batch's remaining
    time, each held to its end (`batch_seconds`: rows that end unevenly keep the batch running at its
    slowest). A tree must beat plain decoding by `margin` to be chosen; the shapes not chosen (plain
    decoding, the next best trees) are probed now and then, and between probes their evidence follows the
    machine's pace as the running kind's steps read it (`observe`). Before a bucket holds a tree, trees of
    contrasting sizes are measured there, until the step fit can part its costs (`_contrast`)."""

    name = "aware"

    def __init__(self, costs: CostModel, candidates: list[SpecConfig] | None = None, correction_decay: float = 0.9,
                 probe_every: int = 64, max_probe_every: int = 1024, margin: float = 0.05, probe_budget: float = 0.0025,
                 acceptance_prior: float | None = None, explore: int = 3, switch_margin: float = 0.01):
        self.costs = costs
        # speculate only for a predicted gain above this fraction: near a tie the step-time noise and
        # the costs the model leaves out (catch-up after a gap, tree bookkeeping) decide, and they lose
        self.margin = margin
        self.candidates = candidates or candidate_configs()
        self.shapes = Shapes(self.candidates)
        # a bucket keeps the tree it speculates with (`_held`) until another is predicted faster by this
        # much: near the best, trees differ by less than the prices' noise (the top ten of a search within
        # a few percent), and on a GPU each tree new to a bucket costs a graph capture (an eager step and
        # a recording); a search without it took a different tree almost every time
        self.switch_margin = switch_margin
        self._held: dict[int, SpecConfig] = {}
        # seeded with the draft's measured acceptance where known (its held-out top-1 agreement): a prior
        # of 0.6 is optimistic for a fresh draft and pushes a cold start toward wide trees
        self.acceptance = AcceptanceModel() if acceptance_prior is None else AcceptanceModel(acceptance_prior)
        self.fits: dict[int, StepFit] = {}  # per concurrency bucket: the speculative step's cost
        self.explore = explore  # probes of speculation rotate over the best `explore` shapes
        self.decay = correction_decay
        self.probe_every = probe_every
        # a plain step's measured / calibrated time, per concurrency bucket (a speculative step's is its bucket's
        # step fit): the calibration's error differs between one sequence and sixty-four, so a factor learned
        # at one must not move another
        self.correction: dict[int, float] = {}
        self._steps: Counter[tuple[str, int]] = Counter()  # (kind, bucket): steps measured (0: never)
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
        self._probe_turn: dict[int, int] = {}  # per bucket: which of the shapes not chosen the next probe tries
        self._probing: int | None = None  # bucket of the step being probed
        # a shape whose first step in a bucket cost over SPIKE times its price, where the bucket's step fit
        # already held other shapes' steps (the bucket, the shape): unless the next search chooses it anyway,
        # the shape is taken once more first (`_retaken`) and the trees are searched again on its second
        # step. One step alone may be a stall of the machine, and of two the lesser stands (`running_mean`);
        # a stall taken for the shape's cost turns the bucket to plain decoding, which probes speculation
        # hundreds of steps apart, or teaches the step fit a cost per node or level that prices every tree
        # of its size out, and the shapes not chosen are measured again only at rare probes. Not a
        # bucket's first tree: priced by its forwards alone it is a surprise wherever the calibration
        # misses the host's work, and retaking it in each cold bucket of a GRPO batch's tail cost 1.5-2%
        # where trees pay (simulated)
        self._again: tuple[int, SpecConfig] | None = None
        self._retaken: SpecConfig | None = None
        # the searches, per bucket, running level (running_level) and context level: the best tree and the best
        # `explore` shapes. Their inputs (the acceptance model and the step fits) move only when speculative
        # steps are observed, so a search is kept until a probe, a kind's or a shape's first measurement, or
        # SEARCH_EVERY speculative steps, not run anew at every step: a search costs a tenth of a small
        # model's graph-replayed step. The step fits are refit once per bucket in that time, and acceptance
        # read once. Each: the best tree, the best `explore` shapes, the contrast to measure (`_contrast`)
        self._searched: dict[tuple[int, float, float | None], Searched] = {}
        # per running count, context level and longest row's tokens left (quarter octaves; None: not known):
        # the searched tree, its goodput and its step seconds there (and plain decoding's goodput then: a
        # decision compares the two as priced together, not a tree priced a search ago with plain now)
        self._trees: dict[tuple[int, float | None, float | None], tuple[SpecConfig | None, float, float, float]] = {}
        self._refit: set[int] = set()  # buckets whose step fit was refit since the searches were forgotten
        self._prices: dict[tuple[SpecConfig | None, int, float | None], float] = {}  # _calibrated_seconds, likewise
        # every candidate's expected tokens a row and their second moment (`AcceptanceModel.moments_many`), likewise
        self._moments: tuple[np.ndarray, np.ndarray] | None = None
        self._since_search = 0  # speculative steps since the searches were forgotten
        # an engine that calls `ahead` while the device runs a step (its static steps) takes the periodic
        # search off the steps' path: a refresh due after a step waits for the next `ahead` (`_stale`)
        self._ahead = False
        self._stale = False
        self._chosen_since_ahead = 0  # steps decided since the last `ahead`: two, and one step had none
        self._unlearned: list[tuple[SpecConfig, list[int], list[int] | None]] = []  # steps acceptance learns at `ahead`
        # the context level (context_level) of the step being decided: every price is at it. Reading
        # the rows' caches costs a plain step and a tree step alike, so a step priced at the sweep's
        # context and scaled by a measured ratio makes a tree look dearer the longer the context is
        self.context: float | None = None
        # per sequence, the deepest tree level this step verifies: set by a budget that cuts the tree
        # (aware_per_sequence), None for every level; acceptance learns only the levels tried
        self.verified_depth: list[int] | None = None
        self.probes = 0  # probe and contrast steps taken (the guarantee bench reports what they cost)
        # the running rows' tokens left, where exact (`tokens_left`)
        self._left: Sequence[int] | None = None
        self._batch_prices: dict[tuple[int, float | None, SpecConfig], tuple] = {}  # `_batch_shapes`, likewise
        self._after_plain = False  # the last step observed was plain (`observe`)

    _bucket = staticmethod(concurrency_bucket)
    # speculative steps between searches: waits doubled while searches agreed (up to 256) left a GRPO
    # batch's tail on trees chosen on stale acceptance (0.93-0.97x the best fixed tree, simulated)
    SEARCH_EVERY = 16
    # steps of a kind's evidence before its moves are read as the machine's pace (`_settled`): about the
    # memory of its running mean (1 / (1 - correction_decay))
    SETTLED = 10
    # shapes that a batch of known lengths ranks by its remaining time (`_batch_tree`): the best of each depth
    # by goodput and the next best (`_distinct`): a batch's best is a shallower tree than a step's
    BATCH_SHAPES = 10

    def tokens_left(self, left: Sequence[int] | None) -> None:
        """Each running row's tokens left, where every row will emit exactly that many (EOS ignored, as a
        bench's fixed lengths), else None: an engine calls it before each `choose` (kept as given: read only
        when a batch's time is ranked, `_batch_tree`)."""
        self._left = left if left else None

    @staticmethod
    def _row_groups(left: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Rows' tokens left as at most 32 distinct counts (rounded up to a 32nd of the longest) and the rows
        of each: a batch's time prices every distinct count at every step of its end, and rows far from the
        longest hardly move it."""
        counts = np.asarray(left, dtype=np.float64)
        grain = max(1.0, math.ceil(float(counts.max()) / 32))
        values, rows = np.unique(np.ceil(counts / grain) * grain, return_counts=True)
        return values, rows.astype(np.float64)

    def _correction(self, running: int) -> float:
        return self.correction.get(self._bucket(running), 1.0)

    def predicted_seconds(self, c: SpecConfig | None, running: int) -> float:
        if c is None:
            return self._calibrated_seconds(None, running) * self._correction(running)
        return self._fit(running).seconds(self._calibrated_seconds(c, running), c,
                                          self._calibrated_seconds(None, running), self._correction(running))

    def _fit(self, running: int) -> StepFit:
        return self._fit_of(self._bucket(running))

    def _fit_of(self, b: int) -> StepFit:
        if b not in self.fits:
            self.fits[b] = StepFit()  # at its prior until a search fits it (`_search`)
        return self.fits[b]

    def _calibrated_seconds(self, c: SpecConfig | None, running: int) -> float:
        """The step's time by the calibration alone (before the online correction): the draft's catch-up
        on last step's accepted states, its further levels, and the verify of every node of every row.
        Kept until the searches are forgotten, as the searches are: it moves only with what they read as
        of their first (acceptance, the draft's catch-up; a per-sequence budget's widths), and every step
        asks it two to four times (each a few curve lookups)."""
        key = (c, running, self.context)
        if (seconds := self._prices.get(key)) is None:
            seconds = self._prices[key] = self._price(c, running)
        return seconds

    def _price(self, c: SpecConfig | None, running: int) -> float:
        if c is None:
            return self.costs.at_context("target", running, running, self.context)
        catch_up = running * self.acceptance.expected(c)
        return (self.costs.at_context("draft", catch_up, running, self.context)
                + (c.depth - 1) * self.costs.at_context("draft", running * c.topk, running, self.context)
                + self.costs.at_context("target", self._verified_tokens(c, running), running, self.context))

    def _calibrated_seconds_many(self, emitted: np.ndarray, running: int) -> np.ndarray:
        """`_calibrated_seconds` of every candidate (`emitted`: their expected tokens a row)."""
        s, price = self.shapes, self.costs.at_context_many
        return (price("draft", running * emitted, running, self.context)
                + (s.depth - 1) * price("draft", running * s.topk, running, self.context)
                + price("target", self._verified_tokens_many(running), running, self.context))

    def _verified_tokens(self, c: SpecConfig, running: int) -> float:
        """Tokens in the verify forward of a step of tree c: every node of every row."""
        return running * c.num_verify

    def _verified_tokens_many(self, running: int) -> np.ndarray:
        return running * self.shapes.nodes

    def goodput(self, c: SpecConfig | None, running: int) -> float:
        emitted = 1.0 if c is None else self.acceptance.expected(c)
        return running * emitted / self.predicted_seconds(c, running)

    def _acceptance_moments(self) -> tuple[np.ndarray, np.ndarray]:
        """Every candidate's E[X] and E[X^2] a row, read from acceptance once a search cycle."""
        if self._moments is None:
            self._moments = self.acceptance.moments_many(self.shapes)
        return self._moments

    def _rates(self, running: int) -> np.ndarray:
        """`goodput` of every candidate by the same arithmetic, as arrays (`Shapes`): on a GPU a search one
        shape at a time cost a few percent of a graph-replayed step, which `aware` must not lose to its
        fixed rivals."""
        emitted = self._acceptance_moments()[0]
        forwards = self._calibrated_seconds_many(emitted, running)
        plain, scale = self._calibrated_seconds(None, running), self._correction(running)
        fit = self._fit(running)
        return running * emitted / fit.seconds_of(forwards, self.shapes.depth, self.shapes.nodes, plain, scale,
                                                  self.shapes.scatter(fit.residual))

    def _tree(self, running: int) -> tuple[SpecConfig | None, float, float, float]:
        """The best tree at `running` and the step's context, its goodput and its step seconds there, and plain
        decoding's goodput there, priced at the same time; where the rows' lengths are known, the goodputs
        are over the batch's remaining time (`_batch_tree`), searched again as its longest row's tokens
        left fall by a quarter octave."""
        left = self._left if self._left is not None and len(self._left) == running else None
        key = (running, self.context, None if left is None else quarter_octave(max(left)))
        if key not in self._trees:
            best, plain = self._search(running)[0], self.goodput(None, running)
            if best is None:
                self._trees[key] = (None, 0.0, 0.0, plain)
            elif left is not None:
                self._trees[key] = self._batch_tree(running, best, *self._row_groups(left))
            else:
                self._trees[key] = (best, self.goodput(best, running), self.predicted_seconds(best, running), plain)
        return self._trees[key]

    def _batch_tree(self, running: int, best: SpecConfig, left: np.ndarray, rows: np.ndarray
                    ) -> tuple[SpecConfig, float, float, float]:
        """`_tree` for a batch whose `rows[u]` rows have `left[u]` tokens left each: the search's best and its
        next `BATCH_SHAPES` by goodput, and plain decoding, priced by the batch's remaining time, each held
        to its end (`batch_seconds`; a step at one row is priced by this bucket's step fit at one row's
        forwards). Goodputs are the batch's tokens over that time; the bucket's held tree stays while within
        `switch_margin` of the best. The shapes' moments and step prices are kept per running count and
        context as the searches are: as the rows' tokens left fall, only the batch's time is priced anew."""
        if (key := (running, self.context, best)) not in self._batch_prices:
            self._batch_prices[key] = self._batch_shapes(running, best)
        shapes, mean, second, at_batch, at_one = self._batch_prices[key]
        seconds = batch_seconds(left, rows, mean, second, at_batch, at_one, running)
        rates = float((left * rows).sum()) / seconds
        held = self._held.get(self._bucket(running))
        i = self._holding(rates, 1 + int(np.argmax(rates[1:])), shapes.index(held) if held in shapes else None)
        return shapes[i], float(rates[i]), float(at_batch[i]), float(rates[0])

    def _batch_shapes(self, running: int, best: SpecConfig) -> tuple[list[SpecConfig | None], np.ndarray, np.ndarray,
                                                                      np.ndarray, np.ndarray]:
        """`_batch_tree`'s shapes (plain decoding first), their E[X] and E[X^2] a row, and their step seconds at
        `running` rows and at one. A step at one row is priced by the one-row bucket's measurements where it
        has them (plain's correction; its step fit where trees were measured there), else by this bucket's
        at one row's forwards: a calibration flat in the rows (a GPU's memory-bound forwards) misses a cost
        per row of the host's, and a tail priced at the batch's step cost ranked deep trees above the
        shallower ones whose rows end more evenly (the batch's best at 256 rows where trees pay)."""
        shapes: list[SpecConfig | None] = [None, *dict.fromkeys([best, *self._search(running)[2]])]
        emitted, squares = self._acceptance_moments()
        at = np.array([self.shapes.index[c] for c in shapes[1:]])
        s = self.shapes

        def step_seconds(n: int) -> np.ndarray:  # plain's and the trees' at n rows
            b = self._bucket(n)
            b = b if self._steps["off", b] else self._bucket(running)
            fit = self._fitted(b if self._fit_of(b).shapes else self._bucket(running))
            plain, scale = self._calibrated_seconds(None, n), self.correction.get(b, 1.0)
            trees = fit.seconds_of(self._calibrated_seconds_many(emitted, n)[at], s.depth[at], s.nodes[at], plain,
                                   scale, s.scatter(fit.residual)[at])
            return np.concatenate([[plain * scale], trees])

        mean, second = np.concatenate([[1.0], emitted[at]]), np.concatenate([[1.0], squares[at]])
        return shapes, mean, second, step_seconds(running), step_seconds(1)

    def _search(self, running: int) -> Searched:
        """The best tree among the candidates (the bucket's held tree while within `switch_margin` of it)
        and the best shapes (`Searched`), searched at the first running count of `running`'s level."""
        b = self._bucket(running)  # (a level may straddle two buckets, each with its own step fit)
        if (level := (b, running_level(running), self.context)) not in self._searched:
            self._fitted(b)
            rates = self._rates(running)
            order = np.argsort(-rates, kind="stable").tolist()  # best first (of a tie, the earlier)
            ranked = order[: self.explore]
            held = self.shapes.index.get(self._held.get(b))  # (a held tree means candidates: ranked is not empty)
            best = self.candidates[self._holding(rates, ranked[0], held)] if ranked else None
            self._searched[level] = (best, [self.candidates[i] for i in ranked], self._distinct(order),
                                     self._contrast(b, rates))
        return self._searched[level]

    def _fitted(self, b: int) -> StepFit:
        """Bucket b's step fit, refit once a search cycle (at plain's correction there, the step's context)."""
        fit = self._fit_of(b)
        if b not in self._refit:
            fit.fit(self.correction.get(b, 1.0), self.context)
            self._refit.add(b)
        return fit

    def _holding(self, rates: np.ndarray, best: int, held: int | None) -> int:
        """`best`, unless the bucket's held tree (`held`, an index into `rates`) is within `switch_margin` of it."""
        return held if held is not None and rates[held] * (1 + self.switch_margin) >= rates[best] else best

    def _distinct(self, order: list[int]) -> list[SpecConfig]:
        """The best candidate of each depth in `order` (best first), then the next of distinct depth and node
        count, `BATCH_SHAPES` in all. A batch's best is shallower than a step's (its rows end more evenly),
        and the best few by goodput were all deeper: at 64 rows where trees pay, eight of depths 3 to 5
        and not the batch's best, of depth 2; and shapes of one size whose top-k differs price alike."""
        sizes: dict[tuple[int, int], SpecConfig] = {}
        depths: set[int] = set()
        for i in order:  # (the best of each depth)
            if (c := self.candidates[i]).depth not in depths:
                depths.add(c.depth)
                sizes[c.depth, c.num_verify] = c
        for i in order:
            if len(sizes) >= self.BATCH_SHAPES:
                break
            c = self.candidates[i]
            sizes.setdefault((c.depth, c.num_verify), c)
        return list(sizes.values())

    def _contrast(self, b: int, rates: np.ndarray) -> SpecConfig | None:
        """While the sizes (depth d, nodes beyond the root m) of the shapes measured in bucket b lie on one
        line: the best tree twice or half as far from it. The step fit prices a tree's fixed cost, its cost
        per level and per node (`StepFit.fit`); from shapes of one depth it cannot tell a cost per level from
        a fixed cost, from one node count a cost per node, from shapes whose nodes grow with their depth
        (d2k2n4, d4k2n8) the two from each other. Until then the search prices the other trees alike but
        for their forwards and stays where it started: the deepest, widest trees, on forwards that cost a
        GPU nearly nothing while memory-bound. One shape measured: a tree far in both sizes; shapes of one
        depth (node count): one far in that size; shapes on a slanted line: one whose nodes are twice or
        half the line's at its depth."""
        points = sorted({(c.depth, c.num_verify - 1) for c in self._fit_of(b).shapes})
        if not points:
            return None  # (the first tree is the search's own)
        d, m = self.shapes.depth, self.shapes.nodes - 1
        (d0, m0), (d1, m1) = points[0], points[-1]
        if any((d1 - d0) * (mi - m0) != (m1 - m0) * (di - d0) for di, mi in points):
            return None  # (not on one line: the costs are told apart)
        far = lambda size, v: (size * 2 <= v) | (size >= 2 * v)  # noqa: E731
        if d0 == d1 or m0 == m1:
            allowed = (far(d, d0) if d0 == d1 else True) & (far(m, m0) if m0 == m1 else True)
        else:
            allowed = far(m, m0 + (m1 - m0) / (d1 - d0) * (d - d0))
        if not np.any(allowed):
            return None
        return self.candidates[int(np.argmax(np.where(allowed, rates, -np.inf)))]

    def _forget_searches(self) -> None:
        self._learn_deferred()  # (a search reads acceptance: never without every step observed)
        self._stale = False
        self._searched.clear()
        self._prices.clear()
        self._trees.clear()
        self._refit.clear()
        self._moments = None
        self._batch_prices.clear()
        self._since_search = 0

    def _probe_choice(self, running: int, choice: SpecConfig | None) -> SpecConfig | None:
        """What a probe tries: the best tree while plain decoding is chosen; else, in turn, plain decoding
        and the next best shapes (a shape is only ever measured when it is taken)."""
        tree = self._tree(running)[0]
        if choice is None:
            return tree
        others = [None] + [c for c in self._search(running)[1] if c != choice]
        b = self._bucket(running)
        turn = self._probe_turn.get(b, 0)
        self._probe_turn[b] = turn + 1
        return others[turn % len(others)]

    def _decide(self, running: int) -> SpecConfig | None:
        tree, rate, _, plain = self._tree(running)
        return tree if rate > plain * (1 + self.margin) else None

    def choose(self, running: int, context: float | None = None) -> SpecConfig | None:
        self.context = context_level(context)
        self._chosen_since_ahead += 1
        if self._chosen_since_ahead > 1:  # the last step called no `ahead` (an eager step of a static engine):
            self._learn_deferred()  # what it would have done is done now
            if self._stale:
                self._forget_searches()
        b = self._bucket(running)
        if not self._steps["off", b]:
            # a bucket's first step is plain: plain decoding is never a loss, and its measured time anchors
            # every later comparison (a calibration swept while another process held a core once read the
            # same ~225 ms for 1 and 512 tokens, so the largest tree looked free and cost 10 plain steps)
            return None
        choice = self._decide(running)
        if (again := self._again) is not None and again[0] == b and not self._stale:  # (decided on that step)
            self._again = None
            if choice != again[1]:
                self.probes += 1
                self._retaken = again[1]
                return again[1]
        if choice is not None:
            self._held[b] = choice
            if (contrast := self._search(running)[3]) is not None:  # measured before the tree is held on
                self.probes += 1
                return contrast
        if self._since.get(("probe", b), 0) >= self._interval(running, choice):
            self._probing = b
            self.probes += 1
            return self._probe_choice(running, choice)
        return choice

    def ahead(self, running: int, context: float | None = None, config: SpecConfig | None = None) -> None:
        """Work for the next step, done while the device runs this one (`running` rows at `context`, of tree
        `config`): the engine calls it between launching a step and reading its results back, when the
        host would only wait. The periodic search, when due, runs here, and the next step decides on the
        searches one step older; the searches of the levels the next step may reach (its context grows by
        one token to `config`'s depth + 1, and a row may retire) are made before it asks. So on a GPU a
        search costs no step its time (a search is a tenth of a small model's replayed step). Once an
        engine calls it, the periodic search waits for it; a caller that never does searches in `choose`.
        Where the rows' lengths are known, their tokens left shrink as the context grows (a batch's time is
        ranked anew at each quarter octave of its longest row's, `_batch_tree`, several times a step's
        search), and a row that retires changes them past guessing: the next step at these rows only."""
        self._ahead, self._chosen_since_ahead = True, 0
        self._learn_deferred()
        if self._stale:
            self._forget_searches()
        grow = 1 + (config.depth if config is not None else 0)
        decided, told = self.context, self._left  # (this step's: `choose` and `tokens_left` set them)
        for rows in dict.fromkeys((running, max(running - 1, 1))):
            if not self._steps["off", self._bucket(rows)] or (told is not None and rows != running):
                continue  # (its first step is plain, and its first measurement searches anew)
            for d in dict.fromkeys((1, grow)):
                self.context = context_level(None if context is None else context + d)
                if told is not None:
                    self._left = [max(n - d, 1) for n in told]
                self._tree(rows)
        self.context, self._left = decided, told

    def _learn_acceptance(self, config: SpecConfig | None, accepted: list[int] | None) -> None:
        """Learn from a step's accepted lengths: at once, or, where an engine calls `ahead`, there (a step of
        many rows takes tens of microseconds to count, which the device's next step then hides)."""
        if config is not None and accepted is not None:
            self._unlearned.append((config, accepted, self.verified_depth))
            if not self._ahead:
                self._learn_deferred()
        self.verified_depth = None  # this step's

    def _learn_deferred(self) -> None:
        for config, accepted, verified_depth in self._unlearned:
            self.acceptance.observe(config, accepted, verified_depth)
        self._unlearned.clear()

    def _interval(self, running: int, choice: SpecConfig | None) -> int:
        """Steps between probes in this bucket: `probe_every`, doubled by each probe that confirms the
        choice; while plain decoding is chosen, long enough that a probe's extra time stays within
        `probe_budget`; never over `max_probe_every` (a probe must come, or a decision taken on a wrong
        price would never be undone)."""
        interval = self._probe_interval.get(self._bucket(running), self.probe_every)
        tree, _, tree_seconds, _ = self._tree(running)
        if choice is None and tree is not None:  # the probe would be speculative steps: bound their share
            extra = PROBE_STEPS * (tree_seconds / self.predicted_seconds(None, running) - 1)
            interval = max(interval, math.ceil(extra / self.probe_budget))
        return min(interval, self.max_probe_every)

    def _settled(self, kind: str, b: int, config: SpecConfig | None) -> bool:
        """Whether the running kind's evidence in bucket b (plain's correction, or shape config's mean) holds
        SETTLED steps: before that its mean still moves toward the truth from its first noisy step, which
        is no change of the machine's pace and must not move what is not running."""
        if kind == "off":
            return self._steps["off", b] >= self.SETTLED
        seen = self.fits[b].shapes.get(config) if b in self.fits else None
        return seen is not None and seen[3] >= self.SETTLED

    def observe(self, config: SpecConfig | None, running: int, emitted: int, seconds: float | None,
                accepted: list[int] | None = None) -> None:
        # a speculative step right after a plain one first catches the draft up on the states the plain steps
        # added (a window a row, on the eager engine; the static one catches up a window every step): a cost
        # its shape's next steps do not pay. Taken for the shape's, a probe's catch-up makes every tree look
        # dear, and with plain decoding chosen every measurement of speculation is a probe: it stays chosen
        caught_up = config is not None and self._after_plain
        self._after_plain = config is None
        if seconds is None or caught_up:  # no price in it (a graph's capture, or the catch-up): its tokens
            self._probing = None  # only; a probe measured nothing, and the next step probes again
            self._learn_acceptance(config, accepted)
            return
        kind, other = ("off", "spec") if config is None else ("spec", "off")
        b = self._bucket(running)
        # unbounded but for absurd values: a sweep taken while another process held a core can be wrong
        # by 80x (every forward a scheduler stall), and only this correction can undo it
        calibrated = self._calibrated_seconds(config, running)
        ratio = min(max(seconds / max(calibrated, 1e-9), 1e-3), 1e3)
        probe = self._probing == b
        decided = self._decide(running) if probe else None  # the choice the probe tests
        first = not self._steps[kind, b]  # (this kind's first measurement in the bucket)
        fit = self._fit(running)
        settled = self._settled(kind, b, config)  # (before this step joins its evidence)
        self._steps[kind, b] += 1
        fresh = False  # (a shape's first step in this bucket, or the step retaking it)
        if config is None:
            # plain's first measurement in a bucket replaces the calibration; later ones are averaged
            # (`running_mean`: robust to stalls), a probe (rare, and the only fresh evidence on its kind) with
            # weight one half. moved: how far this step moved the running kind's evidence
            current = self.correction.get(b, 1.0)
            updated = ratio if first else running_mean(current, self._steps["off", b] - 1, ratio,
                                                       0.5 if probe else 1 - self.decay)[0]
            moved = None if first else updated / current
            self.correction[b] = updated
        else:  # (clipped as the ratio is: beyond it the measurement is absurd, not the model wrong)
            pace = fit.pace(config)
            fresh, self._retaken = pace is None or config == self._retaken, None
            if pace is None and fit.shapes and seconds > SPIKE * self.predicted_seconds(config, running):
                self._again = (b, config)
            fit.add(calibrated, config, ratio * calibrated, self._calibrated_seconds(None, running), probe,
                    self.context)
            moved = None if pace is None else fit.pace(config) / pace
            if first and not self._steps["off", b]:
                # plain decoding not yet measured here takes speculation's factor: a calibration is most
                # likely off by a common scale (a busier or faster machine than during the sweep), and so
                # the two stay comparable (a bucket's first step is plain when `aware` chooses it)
                self.correction[b] = ratio
        if settled and moved is not None and not probe and self._steps[other, b]:
            # the machine's pace, read from the kind running, moves the evidence on what is not running:
            # a shared machine's speed drifts by tens of percent over seconds, and plain decoding measured
            # in a slow spell, set against speculation measured since, chose speculation at a loss (and the
            # reverse). So kinds are compared as their last paired measurement (a probe) left them
            if config is None:
                fit.follow(moved)
            else:
                self.correction[b] *= moved
                fit.follow(moved, config)
        if first and not self._steps[other, b]:
            self._forget_searches()  # (a first measurement replaces the calibration: searched again)
        self._since[("probe", b)] = 0 if probe else self._since.get(("probe", b), 0) + 1
        self._learn_acceptance(config, accepted)
        if config is not None:
            self._since_search += 1
            # fresh evidence on speculation: search the trees again. A probe's search decides below whether
            # the probe overturned the choice, and a first measurement replaces the calibration: neither
            # waits. A shape's first measurement (a contrast's, `_contrast`), a retaken shape's second, and
            # the periodic search wait for `ahead` where an engine calls it
            if probe or first:
                self._forget_searches()
            elif fresh or self._since_search >= self.SEARCH_EVERY:
                if self._ahead:
                    self._stale = True
                else:
                    self._forget_searches()
        if probe:
            self._probing = None
            overturned = self._decide(running) != decided
            interval = self._probe_interval.get(b, self.probe_every)
            self._probe_interval[b] = self.probe_every if overturned else min(2 * interval, self.max_probe_every)
