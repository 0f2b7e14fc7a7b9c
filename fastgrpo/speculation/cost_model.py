"""A cost model of this machine: forward latency against tokens per forward, measured, not assumed.

A short calibration sweep times the target and the draft at a range of tokens per forward (the
curve is flat while the hardware is memory-bound, then linear once it is compute-bound). The curve
is cached per (model shape, threads, torch version) so later runs skip the sweep, and the engine
corrects it online from real step timings.
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


def _interp(xs: Tensor, ys: Tensor, tokens: Tensor) -> Tensor:
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


class CostModel:
    def __init__(self, target_s: dict[int, float], draft_s: dict[int, float]):
        self.target_s = monotone(target_s)  # seconds per target forward, by tokens in the forward
        self.draft_s = monotone(draft_s)  # seconds per draft forward (incl. LM head and tree bookkeeping)
        # `aware` asks for the same few sizes at every decode step: answered from a table, a plain
        # step under `aware` costs what one under `off` costs
        self._memo: dict[tuple[str, float], float] = {}
        f64 = torch.float64
        self._points = {name: (torch.tensor(list(c), dtype=f64), torch.tensor(list(c.values()), dtype=f64))
                        for name, c in (("target_s", self.target_s), ("draft_s", self.draft_s))}

    def _lookup(self, curve: str, tokens: float) -> float:
        if (seconds := self._memo.get((curve, tokens))) is None:
            t = torch.tensor([tokens], dtype=torch.float64)
            seconds = self._memo[(curve, tokens)] = float(_interp(*self._points[curve], t))
        return seconds

    def target(self, tokens: float) -> float:
        return self._lookup("target_s", tokens)

    def draft(self, tokens: float) -> float:
        return self._lookup("draft_s", tokens)

    def target_many(self, tokens: Tensor) -> Tensor:
        """target() at many sizes at once (a per-sequence budget weighs every total it could verify)."""
        return _interp(*self._points["target_s"], tokens)

    def to_json(self) -> dict:
        return {"target_s": self.target_s, "draft_s": self.draft_s}

    @classmethod
    def from_json(cls, d: dict) -> CostModel:
        return cls({int(k): v for k, v in d["target_s"].items()}, {int(k): v for k, v in d["draft_s"].items()})


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
    tokens / B new tokens each, over a cache of CONTEXT tokens. The sweep runs `rounds` times and
    keeps the lowest median per size: a shared machine's noise only ever slows a sample down."""
    cfg = model.cfg
    rows = 64
    cache = KVCache(cfg, rows, CONTEXT + 512)
    dcache = KVCache(cfg, rows, CONTEXT + 512, layers=1)
    cache.lengths.fill_(CONTEXT)
    dcache.lengths.fill_(CONTEXT)
    target_s: dict[int, float] = {}
    draft_s: dict[int, float] = {}
    for tokens in [t for _ in range(rounds) for t in sweep]:
        B = min(tokens, rows)
        n = max(tokens // B, 1)
        ids = torch.randint(0, cfg.vocab_size, (B, n))
        r = slice(0, B)
        target_s[tokens] = min(target_s.get(tokens, float("inf")), _time(lambda: model.forward(ids, cache, r), reps))
        hidden = torch.randn(B, n, cfg.hidden_size)
        pos = CONTEXT + torch.arange(n).expand(B, n)
        mask = block_mask(dcache.lengths[r], n, CONTEXT + n, None)
        draft_s[tokens] = min(draft_s.get(tokens, float("inf")), _time(
            lambda: draft.logits(draft.features(hidden, ids, pos, mask, cache_kv(dcache, 0, r, pos, CONTEXT + n)))
            .topk(4, dim=-1), reps))
    return CostModel(target_s, draft_s)


def load_or_calibrate(model: InferenceModel, draft: DraftHead, cache_dir: Path) -> CostModel:
    cfg = model.cfg
    key = (f"h{cfg.hidden_size}-l{cfg.num_hidden_layers}-i{cfg.intermediate_size}-v{cfg.vocab_size}"
           f"-t{torch.get_num_threads()}-torch{torch.__version__}-{model.kernel}")
    path = Path(cache_dir) / f"cost_model-{key}.json"
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
