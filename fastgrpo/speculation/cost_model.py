"""A cost model of this machine: forward latency against tokens per forward, measured, not assumed.

The curve is measured by a short calibration sweep of the target and the draft at a range of
tokens per forward (the embedded engine's is `fastgrpo/engines/embedded/calibrate.py`; a GPU's
roofline, `roofline.py`, stands in where nothing is measured): flat while the hardware is
memory-bound, then linear once it is compute-bound. The sweep's point of t tokens holds
min(t, 64) sequences of one token each (a plain step's shape) over CONTEXT cached tokens each. Two
things a step pays beyond that point are priced too:
- context: each sequence reads its own cached keys and values, and each new token attends over them.
  Two shapes of 64 tokens (64 rows of one, 4 rows of 16) timed over CONTEXT and CONTEXT + 256 cached
  tokens separate the two rates (per row x cached token, per new token x cached token), so
  `at_context` prices a step of B rows over the rows' real context. Where contexts run to thousands
  of tokens (reasoning RL on a GPU) reading the caches is most of a step and costs a plain step and a
  tree step alike; priced at the sweep's 128 tokens, a tree looked 3x dearer than it is (SIMULATED
  H100, BENCHMARKS.md section 8).
- rows: a tree's verify forward holds B sequences of n tokens, not min(B n, 64) of one, and each
  sequence costs something beyond its tokens (the row probes measure it): `target(tokens, rows)`
  prices a forward of fewer rows that much lower.
  `aware` does not use it: its calibration lacks a speculative step's fixed work, for which the
  over-priced verify stands in (BENCHMARKS.md section 2).
The engine corrects the curve online from real step timings.
"""

from __future__ import annotations

import bisect

import numpy as np

SWEEP = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# Past SWEEP the sweep goes on doubling (FURTHER, a kind at a time) while that kind's forward is still
# flat (`still_flat`): its curve's last segment prices every larger forward, and a flat one prices them
# all as free. A mixture-of-experts model is flat at 512 (Qwen3-30B-A3B on an H100: a forward reads more
# experts up to a few hundred tokens, compute takes over near 2,000, roofline.py) while a tree at 128
# rows verifies up to 8,192 tokens. Where a forward already grows with its tokens at 512 (a dense model
# on a CPU), the sweep stops there.
FURTHER = (1024, 2048, 4096, 8192)
LINEAR = 1.5  # a doubling of tokens that cost at least this factor more: the forward grows with its tokens
CONTEXT = 128  # typical cached length during the sweep
ROWS = 64  # the sweep's point of t tokens holds min(t, ROWS) sequences
ROW_PROBES = ((1, 16), (4, 16))  # (rows, tokens each): the sweep's 16 and 64 tokens in fewer rows
CONTEXT_PROBES = ((64, 1), (4, 16))  # (rows, tokens each): 64 tokens reading 64 rows' caches, and 4 rows'
CONTEXT_EXTRA = 256  # the probes are timed over CONTEXT and CONTEXT + CONTEXT_EXTRA cached tokens
KINDS = ("target", "draft")


def piecewise_linear_at(xs: list[float], ys: list[float], tokens: float) -> float:
    """The curve through the points (xs, ys) at one size, in plain Python: flat below the first point, the
    last segment's (compute-bound) slope beyond the last. `aware` prices ~100 candidate trees per search, at
    the draft's catch-up tokens (a float that moves with acceptance), and a torch call per price is too
    slow for that many."""
    t = max(tokens, xs[0])
    i = min(max(bisect.bisect_left(xs, t), 1), len(xs) - 1)  # the segment [xs[i-1], xs[i]]: the first with t <= xs[i]
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (t - xs[i - 1]) / (xs[i] - xs[i - 1])


def piecewise_linear_many(xs: np.ndarray, ys: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """piecewise_linear_at at many sizes in numpy: a search of `aware` prices every candidate tree at
    once (a torch call costs several times a numpy one at this size)."""
    t = np.maximum(tokens, xs[0])
    i = np.searchsorted(xs[1:-1], t) + 1  # piecewise_linear_at's segment: bisect on xs, clipped to [1, len - 1]
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (t - xs[i - 1]) / (xs[i] - xs[i - 1])


def still_flat(curve: dict[int, float]) -> bool:
    """Whether a sweep of `curve` (tokens: seconds) goes on past its last point: its last doubling of
    tokens cost less than LINEAR times more (memory- or launch-bound, not yet growing with its tokens)."""
    (_, before), (_, last) = sorted(curve.items())[-2:]
    return last < LINEAR * before


def swept_on(curve: dict[int, float], measure, further: tuple[int, ...] = FURTHER) -> dict[int, float]:
    """`curve` (tokens: seconds, SWEEP's points) with `measure(tokens)` added at each size of `further` in
    turn while it is `still_flat`: the one rule by which both the engine's calibration and the simulated
    one sweep on past 512 tokens."""
    for t in further:
        if not still_flat(curve):
            break
        curve[t] = measure(t)
    return curve


def monotone(curve: dict[int, float]) -> dict[int, float]:
    """More tokens per forward never cost less: a point above a later one is a noisy sample (a busy
    machine during calibration), lowered to the cheapest later point."""
    out, cheapest = {}, float("inf")
    for tokens in sorted(curve, reverse=True):
        cheapest = min(cheapest, curve[tokens])
        out[tokens] = cheapest
    return dict(sorted(out.items()))


def sweep_rows(tokens):
    return np.minimum(tokens, ROWS) if isinstance(tokens, np.ndarray) else min(tokens, ROWS)


def row_seconds(sweep_s: dict[int, float], probes: dict[tuple[int, int], float]) -> float:
    """Seconds a sequence adds to a forward beyond its tokens: the sweep's point of B n tokens (B n
    rows) against B rows of n tokens, per row saved, averaged over the probes (never below zero)."""
    per_row = [(sweep_s[B * n] - seconds) / (sweep_rows(B * n) - B) for (B, n), seconds in probes.items()]
    return max(sum(per_row) / len(per_row), 0.0) if per_row else 0.0


def context_rates(extra_s: dict[tuple[str, int, int], float], extra: int = CONTEXT_EXTRA) -> dict[str, float]:
    """Seconds per (row x cached token) and per (new token x cached token), of the target and the draft,
    from what `extra` more cached tokens add to each CONTEXT_PROBES shape, `extra_s[(kind, rows, n)]`:
    64 rows of one token add 64 rows' reads and 64 tokens' attention, 4 rows of 16 add 4 rows' reads
    and the same 64 tokens' attention. Never below zero (a noisy difference)."""
    (B1, n1), (B2, n2) = CONTEXT_PROBES
    out = {}
    for kind in KINDS:
        d1, d2 = extra_s[(kind, B1, n1)] / extra, extra_s[(kind, B2, n2)] / extra
        row = max((d1 - d2) / (B1 - B2), 0.0)
        out[f"{kind}_row"] = row
        out[f"{kind}_token"] = max((d2 - B2 * row) / (B2 * n2), 0.0)
    return out


class CostModel:
    def __init__(self, target_s: dict[int, float], draft_s: dict[int, float], target_row_s: float = 0.0,
                 context_s: dict[str, float] | None = None):
        self.target_s = monotone(target_s)  # seconds per target forward, by tokens in the forward
        self.draft_s = monotone(draft_s)  # seconds per draft forward (incl. LM head and tree bookkeeping)
        self.target_row_s = target_row_s  # a sequence's cost in a target forward beyond its tokens
        # seconds per row x cached token and per new token x cached token (context_rates); none: the
        # sweep's CONTEXT is taken for every step's
        self.context_s = context_s or {f"{kind}_{rate}": 0.0 for kind in KINDS for rate in ("row", "token")}
        # the curves' points as float lists (one size at a time) and tensors (many at once); no memo: a
        # price is a bisection and a few multiplications, and the draft's catch-up sizes are floats
        # that move with acceptance, which would grow a memo without bound over a training run
        self._points = {name: ([float(x) for x in c], [float(y) for y in c.values()])
                        for name, c in (("target_s", self.target_s), ("draft_s", self.draft_s))}
        self._arrays = {name: tuple(np.array(v, dtype=np.float64) for v in xy) for name, xy in self._points.items()}

    def _lookup(self, curve: str, tokens: float) -> float:
        return piecewise_linear_at(*self._points[curve], tokens)

    def _in_rows(self, seconds, tokens, rows):
        """A target forward of `tokens` in `rows` sequences: the sweep's point, less the rows it does
        not read; never below the sweep's cheapest forward."""
        saved = self.target_row_s * (sweep_rows(tokens) - rows)
        floor = self._points["target_s"][1][0]  # the cheapest forward
        if isinstance(seconds, np.ndarray):
            return np.maximum(seconds - np.maximum(saved, 0.0), floor)
        return max(seconds - max(saved, 0.0), floor)

    def target(self, tokens: float, rows: float | None = None) -> float:
        """A target forward of `tokens` tokens in `rows` sequences (default: the sweep's shape)."""
        seconds = self._lookup("target_s", tokens)  # a plain step under `aware` asks this, with no rows
        return seconds if rows is None else self._in_rows(seconds, tokens, rows)

    def draft(self, tokens: float) -> float:
        return self._lookup("draft_s", tokens)

    def at_context(self, kind: str, tokens: float, rows: float, context: float | None) -> float:
        """A `kind` forward ("target" or "draft") of `tokens` tokens at the sweep's point, plus what its
        `rows` rows spend on `context` cached tokens each beyond the sweep's CONTEXT (less below it, never
        less than the sweep's cheapest forward; a context of None: the sweep's)."""
        seconds = self._lookup(f"{kind}_s", tokens)
        if context is None:
            return seconds
        return max(seconds + self._past(kind, tokens, rows, context), self._points[f"{kind}_s"][1][0])

    def at_context_many(self, kind: str, tokens: np.ndarray, rows: float, context: float | None) -> np.ndarray:
        """at_context at many sizes at once (a search of `aware` prices every candidate tree)."""
        xs, ys = self._arrays[f"{kind}_s"]
        seconds = piecewise_linear_many(xs, ys, tokens)
        if context is None:
            return seconds
        return np.maximum(seconds + self._past(kind, tokens, rows, context), ys[0])

    def _past(self, kind, tokens, rows, context):
        """What `rows` rows spend on `context` cached tokens each beyond the sweep's CONTEXT (negative below)."""
        rates = self.context_s
        return (rates[f"{kind}_row"] * rows + rates[f"{kind}_token"] * tokens) * (context - CONTEXT)

    def target_many(self, tokens: np.ndarray, rows: float | None = None) -> np.ndarray:
        """target() at many sizes at once (a per-sequence budget weighs every total it could verify)."""
        t = np.asarray(tokens, dtype=np.float64)
        seconds = piecewise_linear_many(*self._arrays["target_s"], t)
        return seconds if rows is None else self._in_rows(seconds, t, rows)

    def to_json(self) -> dict:
        return {"target_s": self.target_s, "draft_s": self.draft_s, "target_row_s": self.target_row_s,
                "context_s": self.context_s}

    @classmethod
    def from_json(cls, d: dict) -> CostModel:
        return cls({int(k): v for k, v in d["target_s"].items()}, {int(k): v for k, v in d["draft_s"].items()},
                   d.get("target_row_s", 0.0), d.get("context_s"))
