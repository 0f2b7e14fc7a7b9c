"""The step stages: the decode steps alone (step_bench: plain and five trees at each level, eager,
static and fused) and the simulator's constants fitted to them (simulator_fit)."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable

from fastgrpo.bench.gpu_check.harness import PLANNED_S, Check, log, spread, sync
from fastgrpo.bench.gpu_check.records import device_events, engine_info, generate_call

if TYPE_CHECKING:  # annotations only: importing gpu_check must not need the engine (pins runs first)
    from torch import Tensor
    from transformers import PretrainedConfig

    from fastgrpo.engines.embedded.engine import EmbeddedEngine
    from fastgrpo.models.tokenizer import TextFormat
    from fastgrpo.speculation.spec import SpecConfig
    from fastgrpo.types import SamplingParams

# step_bench's trees (depth, top-k, verified tokens): bench rollout's STATIC_SWEEP, the GRPO batch's fixed
# trees, and aware's widest candidate; with plain decoding, six step shapes at each level
STEP_SHAPES = ((2, 2, 4), (3, 4, 8), (4, 4, 12), (5, 8, 24), (6, 8, 48))
# the shapes step_bench also runs in a static engine with fused pointwise regions (engine.fused): plain
# decoding and the middle tree, so that its effect on a speculative step is measured beside a plain one's
FUSED_SHAPES = ("plain", "d4k4n12")
# the shapes step_bench also runs in a static engine drafting hybrid trees (speculation.drafts: hybrid): the
# learned draft's step, the host's index lookups and merge, the verify step; beside the learned step's cell
MERGED_SHAPES = ("d4k4n12",)
ENGINE_SHAPES = {"fused": FUSED_SHAPES, "hybrid": MERGED_SHAPES}  # engines that run only some shapes
STEP_WARMUP = 2  # steps of a step_bench call left out: a new shape's first (its graph capture) and one more


def _step_engines(c: Check, config: PretrainedConfig, text: TextFormat, weights: dict[str, Tensor],
                  draft: dict[str, Tensor], rows: int, max_context: int) -> dict[str, EmbeddedEngine]:
    """The policy in four engines of `rows` rows: eager steps, static ones (CUDA graphs on a GPU), static ones
    with fused pointwise regions (engine.fused), and static ones drafting hybrid trees (its suffix index
    keeps the stage's calls, which ask the same prompts each time: their earlier answers are its history)."""
    from fastgrpo.engines.embedded.engine import EmbeddedEngine
    from fastgrpo.speculation.suffix_index import IndexLimits

    engines = {}
    for name, static in (("eager", False), ("static", True), ("fused", True), ("hybrid", True)):
        engine = EmbeddedEngine(config, rows, max_context, eos_id=text.stop_ids, device=c.compute.device,
                                dtype=c.compute.dtype, static_steps=static)
        engine.update_weights(weights.items(), version=0)
        engine.update_draft(draft.items(), version=0)
        engine.fused = name == "fused"
        if name == "hybrid":
            engine.set_drafts("hybrid", IndexLimits.of(c.cfg.speculation))
        engines[name] = engine
    return engines


def _compile_fused(engine: EmbeddedEngine, shapes: dict[str, SpecConfig | None], prompts: list[list[int]],
                   sampling: SamplingParams, time_left: Callable[[], float]) -> tuple[list[float], str | None]:
    """Short calls of the fused engine's shapes at 1 and 2 rows before step_bench's timing: the regions'
    compile for one shape and the recompile for dynamic ones (dynamo's automatic dynamic shapes). Stops
    after a call that leaves `time_left()` negative (the compiler is the one part of the stage whose time
    cannot be planned). Returns each call's seconds, and the error or stop that ended them (None: compiled)."""
    from fastgrpo.speculation.policy import Off, Static
    from fastgrpo.types import Request

    seconds = []
    try:
        for rows in (1, 2):
            for name in FUSED_SHAPES:
                shape = shapes[name]
                requests = [Request(prompts[i % len(prompts)], max_new_tokens=4) for i in range(rows)]
                r = generate_call(engine, Off() if shape is None else Static(shape), requests,
                                  dataclasses.replace(sampling, max_new_tokens=4), seed=rows)
                seconds.append(round(r["wall_s"], 3))  # (the compile runs in the steps that capture)
                if time_left() < 0:
                    n = len(seconds)
                    return seconds, (f"stopped for time after {n} compiling call{'s' * (n > 1)} ({sum(seconds):.0f}s): "
                                     "the timing of the other engines' cells keeps the rest of the stage")
    except Exception as e:  # the compiler's failures are many; the other engines' cells still count
        return seconds, f"{type(e).__name__}: {e}"[:500]
    return seconds, None


def _step_kernels(engines: dict[str, EmbeddedEngine], shapes: dict[str, SpecConfig | None], prompt: list[int],
                  sampling: SamplingParams) -> dict[str, dict[str, float]]:
    """The kernels one step launches, for each FUSED_SHAPES shape in the static and fused engines, one row:
    the profiler over a step past its key's first call (on a GPU a graph replay: its device operations,
    kernels, copies and fills; on a CPU the step's kernel-launching ops, `graphs.launched_ops`)."""
    from torch.profiler import ProfilerActivity, profile

    from fastgrpo.engines.embedded.graphs import launched_ops
    from fastgrpo.speculation.policy import Off, Static
    from fastgrpo.types import Request

    out: dict[str, dict[str, float]] = {}
    for name in [n for n in ("static", "fused") if n in engines]:
        engine = engines[name]
        cuda = engine.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        for shape_name in FUSED_SHAPES:
            shape, counted, calls, run = shapes[shape_name], [], Counter(), engine.graphs.run

            def profiled(key, step, run=run, counted=counted, calls=calls, checked=engine.graphs.replay_check):
                calls[key] += 1
                if counted or calls[key] != 3:  # (a key's first call captures its graph; its third replays it)
                    return run(key, step)
                # (a CPU's replay check runs the step under a dispatch mode, which hides compiled regions and
                # changes the profile: the counted call runs the step itself)
                with profile(activities=activities) as prof:
                    result = step() if checked is not None else run(key, step)
                    sync()
                events = prof.events()
                counted.append(len(device_events(events)) if cuda else launched_ops(events))
                return result

            engine.graphs.run = profiled
            try:
                generate_call(engine, Off() if shape is None else Static(shape), [Request(prompt, max_new_tokens=12)],
                              dataclasses.replace(sampling, max_new_tokens=12), seed=7)
            finally:
                del engine.graphs.run  # (the instance attribute: the class's method again)
            if counted:
                out.setdefault(name, {})[shape_name] = counted[0]
    return out


def step_cells(B: int, shape: str, engine: str, calls: list[dict], warmup: int) -> dict:
    """One (level, shape, engine) of the step benchmark from its calls: each call's median step (its steps
    after `warmup`, of this shape, while the running rows still fill B's batch bucket: the static step's
    shape is B's then, and rows that finish a step apart under speculation leave most steps in; a fallback
    to a plain step is left out), then the median and standard error over the calls that kept a step."""
    from fastgrpo.engines.embedded.steps import batch_bucket

    bucket = batch_bucket(B)
    per_call, tokens, steps, host, hidden = [], [], 0, [], []
    for r in calls:
        merged = [(h, x) for n, h, x in r.get("host_steps", [])[warmup:] if batch_bucket(n) == bucket]
        if merged:  # (steps drafting from the index: the host's work a step, and the part a GPU hides)
            host.append(1000 * statistics.median(h for h, _ in merged))
            hidden.append(1000 * statistics.median(x for _, x in merged))
        t = r["trace"]
        kept = [(ms, e, run) for run, cfg, e, ms in
                list(zip(t["running"], t["config"], t["emitted"], t["ms"]))[warmup:]
                if batch_bucket(run) == bucket and (cfg == shape or (shape == "plain" and cfg == "off"))]
        if kept:
            per_call.append(statistics.median(ms for ms, _, _ in kept))
            tokens.append(sum(e for _, e, _ in kept) / sum(run for _, _, run in kept))
            steps += len(kept)
    ms = spread(per_call)
    row = {"level": B, "shape": shape, "engine": engine, "step_ms": ms, "steps": steps, "calls": len(calls),
           "tokens_per_row_step": statistics.median(tokens) if tokens else None,
           "captures": sum(r["captures"] for r in calls), "replays": sum(r["replays"] for r in calls)}
    if tokens and ms["median"] > 0:
        row["tok_s"] = B * row["tokens_per_row_step"] / (ms["median"] / 1000)
    if host:
        row["host_ms"], row["host_hidden_ms"] = statistics.median(host), statistics.median(hidden)
    return row


def step_bench(c: Check) -> dict:
    """The steps rollout runs, alone: plain decoding and five tree shapes (STEP_SHAPES) at each level of
    running rows, in the eager engine and in the static one (CUDA graphs on a GPU; on a CPU the same
    static step functions, run eagerly), plain decoding and d4k4n12 (FUSED_SHAPES) in a static engine
    with fused pointwise regions too (compiled before the timing; a failure to compile is recorded in
    `fused_error` and drops only that engine's cells), and d4k4n12 (MERGED_SHAPES) in a static engine
    drafting hybrid trees (two step functions and the host's merge a step). Each (level, shape, engine) is
    `step_reps` generate calls of `step_tokens` tokens per row (EOS ignored), the combinations' order
    rotated per repetition; a step is timed by the engine's own per-step trace (a step ends with its
    results on the host: synchronised), the first STEP_WARMUP steps of a call left out (a new shape's
    graph capture), the median step of each call (`step_cells`), then the median and standard error over
    the calls. A level that would overrun the stage's plan by a quarter (twice the last level's time), or
    take the stages after it below their plans, is skipped and recorded (gpu size), and the fused compile
    stops where it would leave the timing less than half the plan (`Check.stage_left`)."""
    from fastgrpo.bench.rollout import rotated
    from fastgrpo.models.draft import DraftHead
    from fastgrpo.paths import draft_dir
    from fastgrpo.speculation.policy import Off, Static
    from fastgrpo.speculation.spec import SpecConfig
    from fastgrpo.types import Request, SamplingParams

    cfg, size = c.cfg, c.size
    policy, text = c.policy()
    prompts = c.prompts(text)
    levels, T = size.step_levels, size.step_tokens
    used = [prompts[i % len(prompts)] for i in range(max(levels))]
    # a cache as long as the calls need (the KV of 256 rows at the run's context would take ~20 GB twice)
    max_context = min(cfg.model.max_context, 64 * -(-(max(map(len, used)) + T + 8) // 64))
    draft = DraftHead.load(draft_dir(cfg), policy.config, cfg.model.max_context)
    weights = policy.state_dict()
    m = policy.config
    engines = _step_engines(c, m, text, weights, draft.state_dict(), max(levels), max_context)
    del policy, weights, draft
    shapes = {"plain": None} | {SpecConfig(*s).name: SpecConfig(*s) for s in STEP_SHAPES}
    combos = [(name, engine) for name in shapes for engine in engines
              if engine not in ENGINE_SHAPES or name in ENGINE_SHAPES[engine]]
    sampling = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, max_new_tokens=T,
                              ignore_eos=True)
    # the fused compile stops where the stage would keep less than half its plan for the timing
    fused_first_s, fused_error = _compile_fused(engines["fused"], shapes, prompts, sampling,
                                                lambda: c.stage_left() - PLANNED_S["step_bench"] / 2)
    if fused_error:
        combos = [(name, engine) for name, engine in combos if engine != "fused"]
        log(f"steps: no fused cells ({fused_error})")
    step_kernels: dict[str, Any] = {}
    try:
        step_kernels = _step_kernels({k: e for k, e in engines.items() if k != "fused" or not fused_error}, shapes,
                                     prompts[0], sampling)
        log("steps: kernels a step (" + ("device ops" if c.compute.device.type == "cuda" else "kernel-launching ops")
            + "): " + ", ".join(f"{e} {s} {n:.0f}" for e, by in step_kernels.items() for s, n in by.items()))
    except Exception as e:  # CUPTI missing: the timings stand
        step_kernels = {"error": f"{type(e).__name__}: {e}"[:300]}
    element = engines["static"].model.embed.element_size()
    out: dict[str, Any] = {"levels": [], "levels_skipped_for_time": [], "shapes": list(shapes),
                           "engines": {name: engine_info(e) for name, e in engines.items()},
                           "tokens_per_sequence": T, "repetitions": size.step_reps, "warmup_steps": STEP_WARMUP,
                           "max_context": max_context, "draft_window": engines["static"].draft_window,
                           "model": {"layers": m.num_hidden_layers, "hidden": m.hidden_size,
                                     "intermediate": m.intermediate_size, "heads": m.num_attention_heads,
                                     "kv_heads": m.num_key_value_heads, "vocab": m.vocab_size,
                                     "head_dim": getattr(m, "head_dim", None) or m.hidden_size // m.num_attention_heads},
                           "bytes_per_param": element, "fused_shapes": list(FUSED_SHAPES),
                           "merged_shapes": list(MERGED_SHAPES),
                           "fused_first_calls_s": fused_first_s, "fused_error": fused_error,
                           "step_kernels": step_kernels, "cells": []}
    plan = 1.25 * PLANNED_S["step_bench"] if c.size_name == "gpu" else math.inf
    t0, last = time.perf_counter(), 0.0
    for B in levels:
        if out["levels"] and (time.perf_counter() - t0 + 2 * last > plan or c.stage_left() < 2 * last):
            out["levels_skipped_for_time"].append(B)
            continue
        t1 = time.perf_counter()
        requests = [Request(prompts[i % len(prompts)], max_new_tokens=T) for i in range(B)]
        context = statistics.mean(len(r.prompt_ids) for r in requests) + T / 2  # the steps' middle
        calls: dict[tuple[str, str], list[dict]] = {k: [] for k in combos}
        for rep in range(size.step_reps):
            for name, engine in rotated(combos, rep):
                shape = shapes[name]
                calls[(name, engine)].append(generate_call(engines[engine], Off() if shape is None else Static(shape),
                                                           requests, sampling, seed=1000 * rep + B))
        for (name, engine), rs in calls.items():
            row = step_cells(B, name, engine, rs, STEP_WARMUP)
            shape = shapes[name]
            # the draft's catch-up per row: a static step feeds its whole window, an eager one what it kept
            width = (out["draft_window"] if engine != "eager" else row["tokens_per_row_step"] or 1.0)
            row |= {"tree": None if shape is None else [shape.depth, shape.topk, shape.num_verify], "rows": B,
                    "context": context, "catch_up_width": width if shape is not None else 0}
            out["cells"].append(row)
        last = time.perf_counter() - t1
        out["levels"].append(B)
        by = {(r["shape"], r["engine"]): r for r in out["cells"] if r["level"] == B}
        log(f"steps at {B:3d} rows (eager / static / fused ms): " + ", ".join(
            f"{n} " + "/".join(f"{by[(n, e)]['step_ms']['median']:.2f}" if (n, e) in by else "-" for e in engines)
            for n in shapes) + f" ({last:.1f}s)")
        c.partial("step_bench", out)
    out["engines"] = {name: engine_info(e) for name, e in engines.items()}
    out["best"] = {}
    for B in out["levels"]:
        cells = [r for r in out["cells"] if r["level"] == B and r.get("tok_s")]
        for engine in engines:
            mine = [r for r in cells if r["engine"] == engine]
            if mine:
                best = max(mine, key=lambda r: r["tok_s"])
                out["best"].setdefault(str(B), {})[engine] = best["shape"]
    return out


# -- simulator_fit ---------------------------------------------------------------------------------------
def simulator_fit(c: Check) -> dict:
    """`bench simulate`'s GPU price (the roofline of speculation/roofline.py for this GPU, by name) fitted
    to step_bench's static steps (fit.py: the roofline's scale and the overhead constants), with its error
    per step before the fit, after it, and with each level held out of the fit."""
    from fastgrpo.bench.gpu_check.fit import StepPoint, fit_overheads
    from fastgrpo.speculation.roofline import ModelShape, accelerator_named
    from fastgrpo.speculation.spec import SpecConfig

    bench = c.result["stages"].get("step_bench") or {}
    if bench.get("status") != "ok":
        raise RuntimeError("simulator_fit needs step_bench's measured steps (run that stage first)")
    d = bench["data"]
    env = (c.result["stages"].get("environment") or {}).get("data") or {}
    device_name = env.get("device_name", "")
    hw = accelerator_named(device_name)
    m = d["model"]
    shape = ModelShape("policy", m["layers"], m["hidden"], m["intermediate"], m["heads"], m["kv_heads"], m["vocab"],
                       bytes_per_param=d["bytes_per_param"], head_size=m.get("head_dim") or 0)
    points = [StepPoint(None if r["tree"] is None else SpecConfig(*r["tree"]), r["rows"], r["catch_up_width"],
                        r["context"], r["step_ms"]["median"] / 1000, r["level"])
              for r in d["cells"] if r["engine"] == "static" and r["step_ms"]["n"]]
    out = fit_overheads(hw, shape, points) | {"engine": "static", "device_name": device_name,
                                             "graphs": d["engines"]["static"]["graphs"]}
    if "cuda" not in str(env.get("device", "")):
        out["note"] = (f"not a GPU: {hw.name}'s profile fitted to this device's steps exercises the code only")
    log(f"simulator fit to {len(points)} steps ({hw.name}): max |error| {100 * out['error_before']['max_abs_error']:.0f}% "
         f"before, {100 * out['error_after']['max_abs_error']:.0f}% after"
         + (f", {100 * out['error_held_out']['max_abs_error']:.0f}% held out" if "error_held_out" in out else ""))
    return out
