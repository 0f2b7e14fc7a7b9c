"""Calibrating the cost model (`fastgrpo/speculation/cost_model.py`) on the embedded engine's own
kernels: this machine's forward latency against tokens per forward, measured, not assumed.

A short sweep times the target and the draft at each size of SWEEP: the point of t tokens holds
min(t, 64) sequences of t / 64 tokens each (a plain step's shape up to 64) over CONTEXT cached tokens
each, and goes on doubling (FURTHER) for a kind whose forward is still flat there (`still_flat`); then
the target at the ROW_PROBES shapes (what a sequence costs beyond its tokens) and both at the
CONTEXT_PROBES shapes over CONTEXT and CONTEXT + CONTEXT_EXTRA cached tokens (what context costs).
The curve is cached per (model shape, threads, torch version) so later runs skip the sweep.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from pathlib import Path

import torch

from fastgrpo.device import on_device
from fastgrpo.models.draft import DraftHead
from fastgrpo.engines.embedded.model import InferenceModel, KVCache, block_mask, cache_kv
from fastgrpo.speculation.cost_model import (CONTEXT, CONTEXT_EXTRA, CONTEXT_PROBES, FURTHER, KINDS, ROW_PROBES, ROWS,
                                             SWEEP, CostModel, context_rates, monotone, row_seconds, swept_on,
                                             sweep_rows)

log = logging.getLogger(__name__)


def _time(fn, reps: int, sync=lambda: None) -> float:
    """`sync`: waits for the device's queued work (a CUDA forward returns before its kernels end)."""
    fn()  # warm-up
    sync()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


@torch.inference_mode()
def calibrate(model: InferenceModel, draft: DraftHead, reps: int = 5, sweep: tuple[int, ...] = SWEEP,
              rounds: int = 2, further: tuple[int, ...] = FURTHER) -> CostModel:
    """Median latency of target and draft forwards at each size: B = min(tokens, 64) sequences of
    tokens / B new tokens each, over a cache of CONTEXT tokens, and for each kind at the sizes of
    `further` in turn while its curve is still flat (`still_flat`); then the target at the ROW_PROBES
    shapes (what a sequence costs beyond its tokens) and both at the CONTEXT_PROBES shapes over more
    cached tokens (what context costs). Every shape is timed `rounds` times, keeping the lowest median:
    a shared machine's noise only ever slows a sample down."""
    # on the model's device and in its dtype (an engine's on a GPU, bf16): caches, inputs and timing alike
    device, dtype = model.embed.device, model.embed.dtype
    with on_device(device):
        costs = _calibrate(model, draft, reps, sweep, further, rounds, dtype,
                           torch.cuda.synchronize if device.type == "cuda" else lambda: None)
    if device.type != "cpu":
        return CostModel.from_json(costs.to_json())  # its curves on the CPU, as a cached model's are
    return costs


def _calibrate(model: InferenceModel, draft: DraftHead, reps: int, sweep: tuple[int, ...], further: tuple[int, ...],
               rounds: int, dtype: torch.dtype, sync) -> CostModel:
    cfg = model.cfg
    positions = model.cos.shape[0]
    extra = min(CONTEXT_EXTRA, positions - CONTEXT - 17)  # within the model's position tables
    further = tuple(t for t in further if CONTEXT + t // ROWS <= positions)
    longest = max(extra + 16, *(t // ROWS for t in further), 512)
    cache = KVCache(cfg, ROWS, CONTEXT + longest, dtype)
    dcache = KVCache(cfg, ROWS, CONTEXT + longest, dtype, layers=1)

    def timed(kind: str, B: int, n: int, ctx: int) -> float:
        cache.lengths.fill_(ctx)
        dcache.lengths.fill_(ctx)
        ids = torch.randint(0, cfg.vocab_size, (B, n))
        r = slice(0, B)
        if kind == "target":
            return _time(lambda: model.forward(ids, cache, r), reps, sync)
        hidden = torch.randn(B, n, cfg.hidden_size, dtype=dtype)
        pos = ctx + torch.arange(n).expand(B, n)
        mask = block_mask(dcache.lengths[r], n, ctx + n, None)
        return _time(lambda: draft.logits(draft.features(hidden, ids, pos, mask, cache_kv(dcache, 0, r, pos, ctx + n)))
                     .topk(4, dim=-1), reps, sync)

    sweep_shapes = [(sweep_rows(t), max(t // ROWS, 1)) for t in sweep]
    probes = [p for p in ROW_PROBES if p[0] * p[1] in sweep]
    shapes = {(B, n, CONTEXT): KINDS for B, n in sweep_shapes}
    shapes |= {(B, n, CONTEXT): ("target",) for B, n in probes}  # only the target is priced by rows
    if extra > 0:
        shapes |= {(B, n, ctx): KINDS for B, n in CONTEXT_PROBES for ctx in (CONTEXT, CONTEXT + extra)}
    seconds: dict[tuple[str, int, int, int], float] = {}
    for (B, n, ctx), kinds in [shape for _ in range(rounds) for shape in shapes.items()]:  # rounds interleaved
        for kind in kinds:
            key = (kind, B, n, ctx)
            seconds[key] = min(seconds.get(key, float("inf")), timed(kind, B, n, ctx))
    curves = {kind: swept_on({t: seconds[(kind, B, n, CONTEXT)] for t, (B, n) in zip(sweep, sweep_shapes)},
                             lambda t, kind=kind: min(timed(kind, ROWS, t // ROWS, CONTEXT) for _ in range(rounds)),
                             further)
              for kind in KINDS}
    context_s = None  # no room for the context probes: the sweep's context is taken for every step's
    if extra > 0:
        context_s = context_rates({(kind, B, n): seconds[(kind, B, n, CONTEXT + extra)] - seconds[(kind, B, n, CONTEXT)]
                                   for kind in KINDS for B, n in CONTEXT_PROBES}, extra)
    return CostModel(curves["target"], curves["draft"],
                     row_seconds(monotone(curves["target"]), {(B, n): seconds[("target", B, n, CONTEXT)] for B, n in probes}),
                     context_s)


def shape_key(model: InferenceModel) -> str:
    """What a forward's cost depends on, of the model: its family, and every layer's tensor shapes (heads,
    head size, biases, q/k norms, experts), hashed: two models of equal hidden size, layers and MLP width
    but other heads or experts do not share a cost model."""
    shapes = [sorted(layout.shapes().items()) for layout in model.layouts]
    digest = hashlib.sha1(repr((model.cfg.model_type, model.cfg.vocab_size, shapes)).encode()).hexdigest()[:12]
    return f"{model.cfg.model_type}-h{model.cfg.hidden_size}-l{model.cfg.num_hidden_layers}-{digest}"


def machine_key(device: torch.device) -> str:
    """The processor a curve was measured on, hashed: its name (a GPU's, or the CPU's model name from
    /proc/cpuinfo where there is one) and the instruction set torch's CPU kernels use. A cache folder on a
    shared file system (or one copied between machines) must not hand an H100's curve to an H200, or a
    curve measured with AVX-512 to a machine with AVX2, whose forwards cost several times as much."""
    if device.type == "cuda":
        name = f"{torch.cuda.get_device_name(device)}-sm{''.join(map(str, torch.cuda.get_device_capability(device)))}"
    else:
        cpuinfo = Path("/proc/cpuinfo")
        models = [line.partition(":")[2].strip() for line in cpuinfo.read_text().splitlines()
                  if line.startswith("model name")] if cpuinfo.is_file() else []
        name = f"{platform.machine()}-{models[0] if models else platform.processor()}-{len(models) or os.cpu_count()}"
    name += f"-{torch.backends.cpu.get_cpu_capability()}"
    return hashlib.sha1(name.encode()).hexdigest()[:8]


def load_or_calibrate(model: InferenceModel, draft: DraftHead, cache_dir: Path) -> CostModel:
    device, dtype = model.embed.device, model.embed.dtype
    key = (f"{shape_key(model)}-t{torch.get_num_threads()}-torch{torch.__version__}-{model.kernel}"
           f"-m{machine_key(device)}")
    if (device.type, dtype) != ("cpu", torch.float32):  # a GPU's (or a bf16) curve is not the CPU's fp32 one
        key += f"-{device.type}-{str(dtype).removeprefix('torch.')}"
    path = Path(cache_dir) / f"cost_model-v4-{key}.json"  # v4: swept on while flat
    if path.is_file():
        try:
            return CostModel.from_json(json.loads(path.read_text()))
        except (ValueError, KeyError) as e:
            log.warning("ignoring unreadable cost model cache %s: %s", path, e)
    t0 = time.perf_counter()
    model_costs = calibrate(model, draft)
    log.info("calibrated the cost model in %.1fs", time.perf_counter() - t0)
    try:  # written beside it and renamed: engines of one node calibrating the same shape never read half a file
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.write_text(json.dumps(model_costs.to_json(), indent=2))
        os.replace(partial, path)
    except OSError as e:
        log.warning("could not cache the cost model at %s: %s", path, e)
    return model_costs
