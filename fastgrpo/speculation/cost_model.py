"""A cost model of this machine: forward latency against tokens per forward, measured, not assumed.

A short calibration sweep times the target and the draft at a range of tokens per forward (the
curve is flat while the hardware is memory-bound, then linear once it is compute-bound). The
sweep's point of t tokens holds min(t, 64) sequences of one token each (a plain step's shape), but a
tree's verify forward holds B sequences of n tokens, and each sequence reads its own cached keys and
values: so the sweep also measures what a sequence costs beyond its tokens (one row of 16 tokens
against 16 rows of one token), and `target(tokens, rows)` prices a forward of fewer rows that much
lower (on this CPU, timed ad hoc on 2026-11-25: one row of 16 tokens 3.6 ms, sixteen rows of one
5.9 ms). `aware` does not use it: its calibration lacks a speculative step's fixed work, for which
the over-priced verify stands in (BENCHMARKS.md section 2). The curve is cached per (model shape,
threads, torch version) so later runs skip the sweep, and the engine corrects it online from real
step timings.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from torch import Tensor

from fastgrpo.engine.model import InferenceModel, KVCache, block_mask, cache_kv
from fastgrpo.speculation.draft import DraftHead

log = logging.getLogger(__name__)
SWEEP = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
CONTEXT = 128  # typical cached length during the sweep
ROWS = 64  # the sweep's point of t tokens holds min(t, ROWS) sequences
ROW_PROBES = ((1, 16), (4, 16))  # (rows, tokens each): the sweep's 16 and 64 tokens in fewer rows


def piecewise_linear(xs: Tensor, ys: Tensor, tokens: Tensor) -> Tensor:
    """Piecewise linear through the points (xs, ys): flat below the first, the last segment's
    (compute-bound) slope beyond the last."""
    t = tokens.to(torch.float64).clamp(min=float(xs[0]))
    i = torch.searchsorted(xs, t).clamp(1, len(xs) - 1)  # the segment [xs[i-1], xs[i]]: the first with t <= xs[i]
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (t - x0) / (x1 - x0)


def monotone(curve: dict[int, float]) -> dict[int, float]:
    """More tokens per forward never cost less: a point above a later one is a noisy sample (a busy
    machine during calibration), lowered to the cheapest later point."""
    out, cheapest = {}, float("inf")
    for tokens in sorted(curve, reverse=True):
        cheapest = min(cheapest, curve[tokens])
        out[tokens] = cheapest
    return dict(sorted(out.items()))


def sweep_rows(tokens):
    return tokens.clamp(max=ROWS) if isinstance(tokens, Tensor) else min(tokens, ROWS)


def row_seconds(sweep_s: dict[int, float], probes: dict[tuple[int, int], float]) -> float:
    """Seconds a sequence adds to a forward beyond its tokens: the sweep's point of B n tokens (B n
    rows) against B rows of n tokens, per row saved, averaged over the probes (never below zero)."""
    per_row = [(sweep_s[B * n] - seconds) / (sweep_rows(B * n) - B) for (B, n), seconds in probes.items()]
    return max(sum(per_row) / len(per_row), 0.0) if per_row else 0.0


class CostModel:
    def __init__(self, target_s: dict[int, float], draft_s: dict[int, float], target_row_s: float = 0.0):
        self.target_s = monotone(target_s)  # seconds per target forward, by tokens in the forward
        self.draft_s = monotone(draft_s)  # seconds per draft forward (incl. LM head and tree bookkeeping)
        self.target_row_s = target_row_s  # a sequence's cost in a target forward beyond its tokens
        # `aware` asks for the same few sizes at every decode step: answered from a table, a plain
        # step under `aware` costs what one under `off` costs
        self._memo: dict[tuple[str, float], float] = {}
        f64 = torch.float64
        self._points = {name: (torch.tensor(list(c), dtype=f64), torch.tensor(list(c.values()), dtype=f64))
                        for name, c in (("target_s", self.target_s), ("draft_s", self.draft_s))}

    def _lookup(self, curve: str, tokens: float) -> float:
        if (seconds := self._memo.get((curve, tokens))) is None:
            t = torch.tensor([tokens], dtype=torch.float64)
            seconds = self._memo[(curve, tokens)] = float(piecewise_linear(*self._points[curve], t))
        return seconds

    def _in_rows(self, seconds, tokens, rows):
        """A target forward of `tokens` in `rows` sequences: the sweep's point, less the rows it does
        not read; never below the sweep's cheapest forward."""
        saved = self.target_row_s * (sweep_rows(tokens) - rows)
        floor = next(iter(self.target_s.values()))
        if isinstance(seconds, Tensor):
            return (seconds - saved.clamp(min=0.0)).clamp(min=floor)
        return max(seconds - max(saved, 0.0), floor)

    def target(self, tokens: float, rows: float | None = None) -> float:
        """A target forward of `tokens` tokens in `rows` sequences (default: the sweep's shape)."""
        seconds = self._lookup("target_s", tokens)  # a plain step under `aware` asks this, with no rows
        return seconds if rows is None else self._in_rows(seconds, tokens, rows)

    def draft(self, tokens: float) -> float:
        return self._lookup("draft_s", tokens)

    def target_many(self, tokens: Tensor, rows: float | None = None) -> Tensor:
        """target() at many sizes at once (a per-sequence budget weighs every total it could verify)."""
        t = tokens.to(torch.float64)
        seconds = piecewise_linear(*self._points["target_s"], t)
        return seconds if rows is None else self._in_rows(seconds, t, rows)

    def to_json(self) -> dict:
        return {"target_s": self.target_s, "draft_s": self.draft_s, "target_row_s": self.target_row_s}

    @classmethod
    def from_json(cls, d: dict) -> CostModel:
        return cls({int(k): v for k, v in d["target_s"].items()}, {int(k): v for k, v in d["draft_s"].items()},
                   d.get("target_row_s", 0.0))


def _time(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


@torch.inference_mode()
def calibrate(model: InferenceModel, draft: DraftHead, reps: int = 5, sweep: tuple[int, ...] = SWEEP,
              rounds: int = 2) -> CostModel:
    """Median latency of target and draft forwards at each size: B = min(tokens, 64) sequences of
    tokens / B new tokens each, over a cache of CONTEXT tokens; then the target at the ROW_PROBES
    shapes, for what a sequence costs beyond its tokens. The sweep runs `rounds` times and keeps the
    lowest median per shape: a shared machine's noise only ever slows a sample down."""
    cfg = model.cfg
    cache = KVCache(cfg, ROWS, CONTEXT + 512)
    dcache = KVCache(cfg, ROWS, CONTEXT + 512, layers=1)
    cache.lengths.fill_(CONTEXT)
    dcache.lengths.fill_(CONTEXT)
    sweep_shapes = [(sweep_rows(t), max(t // ROWS, 1)) for t in sweep]
    probes = [p for p in ROW_PROBES if p[0] * p[1] in sweep]
    target_s: dict[tuple[int, int], float] = {}
    draft_s: dict[tuple[int, int], float] = {}
    for B, n in [shape for _ in range(rounds) for shape in sweep_shapes + probes]:
        ids = torch.randint(0, cfg.vocab_size, (B, n))
        r = slice(0, B)
        target_s[(B, n)] = min(target_s.get((B, n), float("inf")), _time(lambda: model.forward(ids, cache, r), reps))
        if (B, n) in probes:  # only the target is priced by rows
            continue
        hidden = torch.randn(B, n, cfg.hidden_size)
        pos = CONTEXT + torch.arange(n).expand(B, n)
        mask = block_mask(dcache.lengths[r], n, CONTEXT + n, None)
        draft_s[(B, n)] = min(draft_s.get((B, n), float("inf")), _time(
            lambda: draft.logits(draft.features(hidden, ids, pos, mask, cache_kv(dcache, 0, r, pos, CONTEXT + n)))
            .topk(4, dim=-1), reps))
    target = {t: target_s[shape] for t, shape in zip(sweep, sweep_shapes)}
    return CostModel(target, {t: draft_s[shape] for t, shape in zip(sweep, sweep_shapes)},
                     row_seconds(monotone(target), {p: target_s[p] for p in probes}))


def load_or_calibrate(model: InferenceModel, draft: DraftHead, cache_dir: Path) -> CostModel:
    cfg = model.cfg
    key = (f"h{cfg.hidden_size}-l{cfg.num_hidden_layers}-i{cfg.intermediate_size}-v{cfg.vocab_size}"
           f"-t{torch.get_num_threads()}-torch{torch.__version__}-{model.kernel}")
    path = Path(cache_dir) / f"cost_model-v2-{key}.json"  # v2: with the per-row costs
    if path.is_file():
        try:
            return CostModel.from_json(json.loads(path.read_text()))
        except (ValueError, KeyError) as e:
            log.warning("ignoring unreadable cost model cache %s: %s", path, e)
    t0 = time.perf_counter()
    model_costs = calibrate(model, draft)
    log.info("calibrated the cost model in %.1fs", time.perf_counter() - t0)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(model_costs.to_json(), indent=2))
    except OSError as e:
        log.warning("could not cache the cost model at %s: %s", path, e)
    return model_costs
