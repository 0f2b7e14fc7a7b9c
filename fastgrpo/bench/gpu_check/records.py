"""What the stages that run the engine share: one synchronised generate() call and what is kept of it (the
engine's step mode, its per-step trace, a speculation policy's state as JSON), and the profiler's count of a
call's device operations."""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

from fastgrpo.bench.gpu_check.harness import sync

if TYPE_CHECKING:  # annotations only: importing gpu_check must not need the engine (pins runs first)
    from fastgrpo.engines.embedded.engine import EmbeddedEngine
    from fastgrpo.speculation.policy import SpeculationPolicy
    from fastgrpo.types import Request, SamplingParams

JSON_ITEMS = 2000  # the most items of one list or dict a policy's state records (its tables are smaller)


def _key(k: Any) -> str:
    from fastgrpo.speculation.spec import SpecConfig

    if isinstance(k, SpecConfig):
        return k.name
    if isinstance(k, tuple):
        return "/".join(_key(v) for v in k)
    return str(k)


def jsonable(x: Any, depth: int = 0) -> Any:
    """`x` as JSON values, whatever it holds: a tree shape by its name, an object with `to_json` by what
    that returns, other objects by their public attributes (four levels deep at most), small tensors and
    arrays as lists, anything else by its repr. For state whose layout this module does not own (a
    speculation policy's, which changes with the policy): what is there is recorded, never a failure."""
    import numpy as np
    import torch

    from fastgrpo.speculation.spec import SpecConfig

    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, SpecConfig):
        return x.name
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, (torch.Tensor, np.ndarray)):
        n = x.numel() if isinstance(x, torch.Tensor) else x.size
        return x.tolist() if n <= JSON_ITEMS else {"shape": list(x.shape)}
    if depth > 6:
        return repr(x)[:200]
    if callable(getattr(x, "to_json", None)) and not isinstance(x, type):
        try:
            return jsonable(x.to_json(), depth + 1)
        except Exception as e:  # a state that cannot be written is recorded as such
            return f"to_json failed: {type(e).__name__}: {e}"[:300]
    if isinstance(x, dict):
        return {_key(k): jsonable(v, depth + 1) for k, v in list(x.items())[:JSON_ITEMS]}
    if isinstance(x, (list, tuple)):
        return [jsonable(v, depth + 1) for v in list(x)[:JSON_ITEMS]]
    if isinstance(x, (set, frozenset)):
        return sorted((jsonable(v, depth + 1) for v in list(x)[:JSON_ITEMS]), key=str)
    if depth < 4 and hasattr(x, "__dict__"):
        return {k: jsonable(v, depth + 1) for k, v in vars(x).items() if not k.startswith("_") and not callable(v)}
    return repr(x)[:200]


def policy_state(policy: Any) -> dict:
    """A speculation policy's public state (every attribute not starting with "_": for `aware`, its cost
    model, corrections, probes, acceptance counts and whatever else it keeps), plus its acceptance
    model's per-level estimates where it has `acceptance.alpha(depth)`. Read through public names only,
    whatever they are: the policy's model changes independently of this check."""
    try:
        state = jsonable(policy)
        state = state if isinstance(state, dict) else {"value": state}
        acceptance = getattr(policy, "acceptance", None)
        if callable(getattr(acceptance, "alpha", None)):
            with contextlib.suppress(Exception):
                state["acceptance_alpha"] = [float(acceptance.alpha(d)) for d in range(1, 9)]
        return state
    except Exception as e:  # the run's numbers matter more than this snapshot
        return {"error": f"{type(e).__name__}: {e}"[:300]}


def _graph_counts(engine: Any) -> tuple[int, int]:
    """(CUDA graphs captured, replayed) by the engine so far. Where none is captured but each static step is
    held to its graph's replay (`--check-replays` on a CPU), the graphs a GPU would have captured and
    replayed at the same steps: which calls would pay a capture depends only on the steps' keys, so a CPU
    run says where a GPU run's timed calls would. (0, 0) where the engine keeps neither."""
    graphs = getattr(engine, "graphs", None)
    if (check := getattr(graphs, "replay_check", None)) is not None:
        return check.keys, check.checked
    return int(getattr(graphs, "captures", 0) or 0), int(getattr(graphs, "replays", 0) or 0)


def engine_info(engine: Any) -> dict:
    """How the engine runs its steps: static (fixed shapes) or eager, replayed from CUDA graphs or not."""
    graphs = getattr(engine, "graphs", None)
    check = getattr(graphs, "replay_check", None)
    return {"static_steps": bool(getattr(engine, "static", False)), "graphs": bool(getattr(graphs, "enabled", False)),
            "captures": int(getattr(graphs, "captures", 0) or 0), "replays": int(getattr(graphs, "replays", 0) or 0),
            "replays_checked": check.checked if check is not None else None,
            "graphs_a_gpu_would_capture": check.keys if check is not None else None,
            "device": str(getattr(engine, "device", "")),
            "dtype": str(getattr(engine, "dtype", "")).removeprefix("torch.")}


def trace_columns(trace: list) -> dict[str, list]:
    """The engine's per-step trace ((running, config, tokens emitted, seconds) a step) as columns, the
    seconds in milliseconds."""
    rows = [tuple(step) for step in trace]
    return {"running": [int(r[0]) for r in rows], "config": [str(r[1]) for r in rows],
            "emitted": [int(r[2]) for r in rows], "ms": [round(1000 * float(r[3]), 4) for r in rows]}


def generate_call(engine: EmbeddedEngine, policy: SpeculationPolicy, requests: list[Request], sampling: SamplingParams,
                  seed: int, share_prefill: bool = True) -> dict:
    """One synchronised generate() call under `policy`: its time and tokens, the engine's statistics (the
    configurations it ran by concurrency, its per-step trace) and the CUDA graphs it captured and replayed.
    `seconds`, which every comparison takes, is the call's wall time (`wall_s`) less the seconds of its steps
    that captured a graph (`capture_s`): a capture is paid once per step key in an engine's life (SGLang and
    vLLM capture theirs before serving), and which timed call meets a key first depends on the seeds and
    on which mode ran first (the modes share the engine's graphs), not on the mode."""
    engine.set_speculation(policy)
    engine.share_prefill = share_prefill
    captures, replays = _graph_counts(engine)
    sync()
    t = time.perf_counter()
    out = engine.generate(requests, sampling, seed=seed)
    sync()
    wall = time.perf_counter() - t
    stats = engine.stats()
    capture_s = stats.get("capture_s", 0.0)
    seconds = wall - capture_s
    tokens = sum(len(o.token_ids) for o in out)
    steps = stats.get("decode_steps") or 0
    after = _graph_counts(engine)
    return {"seconds": seconds, "wall_s": wall, "capture_s": capture_s, "tokens": tokens,
            "tok_s": tokens / max(seconds, 1e-12),
            "accept_len": stats.get("accept_len", 1.0), "spec_fraction": stats.get("spec_steps", 0) / max(steps, 1),
            "prefill_s": stats.get("prefill_s", 0.0), "decode_steps": steps,
            # the policy's choices and updates (on the steps' path), its `ahead` in static steps, and the wait on
            # the device after it (> 0: the step hid it)
            "policy_s": stats.get("policy_s", 0.0), "ahead_s": stats.get("ahead_s", 0.0), "wait_s": stats.get("wait_s", 0.0),
            # steps that ran static (graph replays on a GPU); padded rows' token slots and the cache positions
            # attention read beyond each row's own, as shares (hardware-independent: what padding costs)
            "static_steps": stats.get("static_steps", 0), "pad_row_share": stats.get("pad_row_share", 0.0),
            "pad_kv_share": stats.get("pad_kv_share", 0.0),
            "configs": jsonable(stats.get("config_by_concurrency", {})), "trace": trace_columns(stats.get("trace", [])),
            # per speculative step drafting from the index: running rows, the host's seconds, and of those the
            # seconds spent while the learned draft's step function computed (hidden behind it on a GPU)
            "host_steps": [[int(n), round(float(h), 7), round(float(hidden), 7)]
                           for n, h, hidden in stats.get("host_steps", [])],
            "captures": after[0] - captures, "replays": after[1] - replays, "lengths": [len(o.token_ids) for o in out]}


def kernels_per_call(fn, calls: int) -> tuple[float, float]:
    """(device operations per call, their summed device time per call in ms), by torch's profiler
    (CUPTI): kernels, memcpys and memsets of `calls` calls."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        sync()
    ops = device_events(prof.events())
    us = sum(e.time_range.elapsed_us() for e in ops)  # each device event's own duration
    return len(ops) / calls, us / 1000 / calls


def device_events(events: Any) -> list:
    """A CUDA profile's device events: kernels, memcpys and memsets."""
    from torch.autograd import DeviceType

    return [e for e in events if e.device_type == DeviceType.CUDA]
