"""The plain decode step against its memory-bandwidth bound: the run's policy (decode_bound) and a
random-weight Llama-3.1-8B shape (decode_8b)."""

from __future__ import annotations

import contextlib
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastgrpo.bench.gpu_check.harness import Check, log, sync, timed
from fastgrpo.bench.gpu_check.records import engine_info, generate_call, kernels_per_call

if TYPE_CHECKING:  # annotations only: importing gpu_check must not need the engine (pins runs first)
    from transformers import PretrainedConfig

    from fastgrpo.engines.embedded.engine import EmbeddedEngine

DECODE_BATCHES = (1, 64)
ROOT = Path(__file__).resolve().parents[3]  # the repository: configs/models/
BIG_MODEL = "llama-3.1-8b-instruct.json"
# decode_8b at test size: the 8B's structure (4 query heads a KV head, an MLP 3.5x the width, untied, the
# llama3 rope scaling) at a size a CPU decodes in milliseconds
SCALED_8B = {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 896, "num_attention_heads": 8,
             "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 4096}


def _launch_us(device) -> float:
    """Host time per launched op: a 1-element add_ issued 2000 times, synchronised at the end."""
    import torch

    x = torch.zeros(1, device=device)
    for _ in range(50):
        x.add_(1.0)
    _, s = timed(lambda: [x.add_(1.0) for _ in range(2000)])
    return s / 2000 * 1e6


def _matmul_chain(model, B: int, device, graph: bool) -> float:
    """ms of the decode forward's matmuls alone (each layer's qkv, o, gate+up and down, and the LM head)
    on B rows: the same weight bytes streamed, nothing else. On CUDA timed by events, eagerly or
    replayed from a CUDA graph (no launch gaps); on a CPU by the clock."""
    import torch

    from fastgrpo.engines.embedded.model import MATRICES

    weights = [L[k] for L in model.layers for k in MATRICES] + [model.lm_head]
    inputs = {w.shape[1]: torch.randn(B, w.shape[1], device=device, dtype=w.dtype) for w in weights}

    def chain():
        for w in weights:
            inputs[w.shape[1]] @ w.T

    reps = 20
    if device.type != "cuda":
        chain()
        times = [timed(chain)[1] for _ in range(5)]
        return 1000 * statistics.median(times)
    run = chain
    if graph:
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                chain()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(g):
            chain()
        run = g.replay
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def decode_bound(c: Check) -> dict:
    """The engine's plain decode step (no speculation; as the engine runs it on this device: static steps
    replayed from CUDA graphs on a GPU, eager on a CPU) at batch 1 and 64 against its memory-bandwidth
    bound, and where the rest goes.

    measured: the step's wall time (the engine's own per-step trace: forward, sampling, bookkeeping, the
    host round trips it makes on purpose); the forward alone (synchronised wall time); on CUDA, the
    profiler's count of device operations per forward and their summed device time; the forward's
    matmuls alone as a CUDA graph (the weight bytes streamed with no launch gaps) and eagerly; the host
    cost of one launched op. estimated: the bound (bytes / spec-sheet bandwidth; bytes = every weight the
    step reads once + the KV cache rows it attends over), and launch overhead = operations x that cost."""
    import torch

    from fastgrpo.engines import build_engine
    from fastgrpo.bench.rollout import WARMUP_STEPS, timed_generate
    from fastgrpo.types import Request, SamplingParams

    policy, text = c.policy()
    prompt = c.prompts(text)[0]
    engine = build_engine(c.with_batch(max(DECODE_BATCHES)), policy.config, text, policy.state_dict().items(),
                          speculation="off")
    del policy
    m, device = engine.model, c.compute.device
    cfg = m.cfg
    bandwidth, source = c.bandwidth()
    weight_bytes = sum(t.numel() * t.element_size() for L in m.layers for t in L.values())
    weight_bytes += m.lm_head.numel() * m.lm_head.element_size() + m.norm.numel() * m.norm.element_size()
    kv_per_token = 2 * cfg.num_hidden_layers * m.n_kv * m.head_dim * engine.cache.k.element_size()
    T = c.size.decode_tokens
    out: dict[str, Any] = {"weight_bytes": weight_bytes, "kv_bytes_per_token": kv_per_token,
                           "bandwidth_gb_s": bandwidth / 1e9, "bandwidth_source": source, "tokens": T,
                           "prompt_tokens": len(prompt), "engine": engine_info(engine),
                           "graphs": ("on" if engine_info(engine)["graphs"] else "off")
                           + (" (static steps)" if engine_info(engine)["static_steps"] else " (eager steps)"),
                           "model": {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
                                     "intermediate": cfg.intermediate_size, "heads": cfg.num_attention_heads,
                                     "kv_heads": cfg.num_key_value_heads, "vocab": cfg.vocab_size},
                           "dtype": str(m.embed.dtype), "batches": {},
                           "measured": ["step_ms", "forward_ms", "outside_forward_ms (step - forward)",
                                        "forward_device_ops", "forward_device_busy_ms", "forward_device_idle_ms "
                                        "(forward - busy)", "matmul_chain_ms", "matmul_chain_graph_ms", "launch_us",
                                        "copy bandwidth"],
                           "estimated": ["bound_ms (bytes / bandwidth)", "step_vs_bound",
                                         "launch_overhead_est_ms (device ops x launch_us)"]}
    on_cuda = device.type == "cuda"
    if on_cuda:
        with contextlib.suppress(Exception):
            out["launch_us"] = _launch_us(device)
    for B in DECODE_BATCHES:
        sampling = SamplingParams(temperature=1.0, max_new_tokens=T, ignore_eos=True)
        steps: list[float] = []
        for rep in range(3):  # a warm-up call, then two timed
            r = timed_generate(engine, [Request(prompt, max_new_tokens=T)] * B, sampling, seed=rep)
            if rep:
                steps += [s[3] for s in r["trace"][WARMUP_STEPS:]]
        step_s = statistics.median(steps)
        # the steps timed read contexts from prompt + WARMUP_STEPS to prompt + T: their middle
        context = len(prompt) + (WARMUP_STEPS + T) / 2
        kv_bytes = B * context * kv_per_token
        bound_s = (weight_bytes + kv_bytes) / bandwidth
        row: dict[str, Any] = {"step_ms": 1000 * step_s, "context": context, "kv_bytes": kv_bytes,
                               "bound_ms": 1000 * bound_s, "step_vs_bound": step_s / bound_s}
        # the forward alone, as a decode step calls it (rows 0..B-1 at this context)
        with engine._on_device():
            tokens = torch.full((B, 1), prompt[-1], dtype=torch.long)
            rows = slice(0, B)

            def forward():
                engine.cache.lengths[:B] = int(context)
                m.forward(tokens, engine.cache, rows)

            forward()
            row["forward_ms"] = 1000 * statistics.median(timed(forward)[1] for _ in range(10))
            if on_cuda:
                try:
                    ops, busy_ms = kernels_per_call(forward, 5)
                    row |= {"forward_device_ops": ops, "forward_device_busy_ms": busy_ms,
                            "forward_device_idle_ms": max(row["forward_ms"] - busy_ms, 0.0)}
                    if "launch_us" in out:
                        row["launch_overhead_est_ms"] = ops * out["launch_us"] / 1000
                except Exception as e:  # CUPTI missing: the rest stands
                    row["profiler_error"] = f"{type(e).__name__}: {e}"[:300]
            row["matmul_chain_ms"] = _matmul_chain(m, B, device, graph=False)
            if on_cuda:
                with contextlib.suppress(Exception):
                    row["matmul_chain_graph_ms"] = _matmul_chain(m, B, device, graph=True)
        row["outside_forward_ms"] = max(row["step_ms"] - row["forward_ms"], 0.0)  # sampling, bookkeeping, host syncs
        chain = row.get("matmul_chain_graph_ms", row["matmul_chain_ms"])
        row["matmul_gb_s"] = (weight_bytes - m.norm.numel() * m.norm.element_size()) / (chain / 1000) / 1e9
        out["batches"][str(B)] = row
        log(f"decode batch {B}: step {row['step_ms']:.2f} ms against a bound of {row['bound_ms']:.3f} ms "
             f"({row['step_vs_bound']:.1f}x); forward {row['forward_ms']:.2f} ms"
             + (f", {row['forward_device_ops']:.0f} device ops busy {row['forward_device_busy_ms']:.2f} ms"
                if "forward_device_ops" in row else "")
             + f"; its matmuls alone {chain:.3f} ms ({row['matmul_gb_s']:.0f} GB/s)")
    return out


def random_weights(engine: EmbeddedEngine, seed: int = 0, std: float = 0.02) -> None:
    """Random weights in place of a checkpoint: normal(0, std) matrices, norms of one (the activations stay
    finite through any depth), generated on the engine's device one tensor at a time."""
    import torch

    specs = [(n, tuple(t.shape), t.dtype) for n, t in engine.model.named_weights()]
    g = torch.Generator(device=engine.device).manual_seed(seed)

    def tensors():
        for name, shape, dtype in specs:
            if len(shape) == 1:
                yield name, torch.ones(shape, dtype=dtype, device=engine.device)
            else:
                yield name, (torch.randn(shape, generator=g, device=engine.device) * std).to(dtype)

    engine.update_weights(tensors(), version=0)


def decoder_parameters(config: PretrainedConfig) -> int:
    """A dense Llama-style decoder's parameters: per layer the q, k, v, o projections, the gated MLP's three
    matrices and two norms; the embedding, the LM head unless tied, the final norm."""
    h, L, V, I = config.hidden_size, config.num_hidden_layers, config.vocab_size, config.intermediate_size
    hd = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    return L * (h * (q + 2 * kv) + q * h + 3 * h * I + 2 * h) + V * h * (1 if config.tie_word_embeddings else 2) + h


def decode_8b(c: Check) -> dict:
    """A random-weight Llama-3.1-8B shape (configs/models/, bf16) decoding plainly at batch 1, 16 and 64
    in the static engine (CUDA graphs), its layers' pointwise regions op by op and fused (`fused`), each
    step against its memory-bandwidth bound: the bytes it must read (every weight once, the embedding's B
    rows aside, and each row's KV cache) over the device's peak bandwidth. Steps are the engine's per-step trace after its first WARMUP_STEPS, two timed calls
    after a warm-up. At test size a scaled-down model of the same structure (SCALED_8B) runs instead (the
    full shape is recorded as skipped); at gpu size it is skipped, with the reason, on a CPU or where the
    device lacks the memory. Measurements that would take the stages after it below their plans are
    skipped and recorded (`skipped_for_time`)."""
    import random

    import torch
    from transformers import LlamaConfig

    from fastgrpo.bench.rollout import WARMUP_STEPS, rotated
    from fastgrpo.engines.embedded.engine import STATIC_TREE_ROOM, TREE_SLACK, EmbeddedEngine
    from fastgrpo.engines.embedded.steps import batch_bucket, context_bucket
    from fastgrpo.speculation.policy import Off
    from fastgrpo.types import Request, SamplingParams

    size, device = c.size, c.compute.device
    config = LlamaConfig.from_json_file(str(ROOT / "configs" / "models" / BIG_MODEL))
    out: dict[str, Any] = {"config": f"configs/models/{BIG_MODEL}", "batches": {}, "full_shape": size.big_full}
    if not size.big_full:
        config = LlamaConfig.from_dict({**config.to_dict(), **SCALED_8B})
        out["skipped_full_shape"] = "test size: a scaled-down model of the same structure (SCALED_8B) instead"
    elif device.type != "cuda":
        return out | {"skipped": f"the 8B shape needs a GPU (device {device.type}): minutes a step on a CPU"}
    dtype = torch.bfloat16 if size.big_full else c.compute.dtype
    element = torch.empty((), dtype=dtype).element_size()
    h, L, V, I = config.hidden_size, config.num_hidden_layers, config.vocab_size, config.intermediate_size
    hd = getattr(config, "head_dim", None) or h // config.num_attention_heads
    kv = config.num_key_value_heads * hd
    params = decoder_parameters(config)
    prompt_len, T = (32 if size.big_full else 16), size.big_tokens
    max_context = 64 * -(-(prompt_len + T + 8) // 64)
    rows = batch_bucket(max(size.big_batches))
    kv_per_token = 2 * L * kv * element
    need = params * element + kv_per_token * rows * (max_context + TREE_SLACK) + 2e9  # + activations, graphs
    out |= {"model": {"layers": L, "hidden": h, "intermediate": I, "heads": config.num_attention_heads,
                      "kv_heads": config.num_key_value_heads, "head_dim": hd, "vocab": V},
            "parameters": params, "dtype": str(dtype).removeprefix("torch."), "needs_gb": need / 1e9,
            "prompt_tokens": prompt_len, "tokens": T}
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        out["free_gb"] = free / 1e9
        if need > 0.95 * free:
            return out | {"skipped": f"needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free on the device"}
    t = time.perf_counter()
    engine = EmbeddedEngine(config, max(size.big_batches), max_context, eos_id=0, device=device, dtype=dtype,
                            static_steps=True)
    random_weights(engine)
    sync()
    out["build_s"] = time.perf_counter() - t
    m = engine.model
    weight_bytes = sum(t.numel() * t.element_size() for layer in m.layers for t in layer.values())
    weight_bytes += m.lm_head.numel() * m.lm_head.element_size() + m.norm.numel() * m.norm.element_size()
    bandwidth, source = c.bandwidth()
    out |= {"weight_bytes": weight_bytes, "kv_bytes_per_token": kv_per_token, "bandwidth_gb_s": bandwidth / 1e9,
            "bandwidth_source": source, "engine": engine_info(engine)}
    rng = random.Random(0)
    prompt = [rng.randrange(1, V) for _ in range(prompt_len)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=T, ignore_eos=True)
    out["fused"] = {"batches": {}}

    def measure(B: int) -> dict:
        steps: list[float] = []
        counts = [0, 0]
        t = time.perf_counter()
        for rep in range(3):  # a warm-up call (captures; with fused kernels, their compile too), then two timed
            r = generate_call(engine, Off(), [Request(prompt, max_new_tokens=T)] * B, sampling, seed=rep)
            if rep:
                steps += r["trace"]["ms"][WARMUP_STEPS:]
                counts = [counts[0] + r["captures"], counts[1] + r["replays"]]
            else:
                first_call_s = time.perf_counter() - t
        step_ms = statistics.median(steps)
        context = prompt_len + (WARMUP_STEPS + T) / 2  # the middle of the steps timed
        kv_bytes = B * context * kv_per_token
        bound_ms = 1000 * (weight_bytes + kv_bytes) / bandwidth
        bucket = context_bucket(int(context) + 1, max_context + TREE_SLACK - STATIC_TREE_ROOM)
        padded_ms = 1000 * (weight_bytes + B * bucket * kv_per_token) / bandwidth
        row = {"step_ms": step_ms, "steps": len(steps), "bound_ms": bound_ms, "step_vs_bound": step_ms / bound_ms,
               "context": context, "kv_bytes": kv_bytes, "context_bucket": bucket, "bound_padded_ms": padded_ms,
               "tok_s": B / (step_ms / 1000), "captures": counts[0], "replays": counts[1], "first_call_s": first_call_s}
        # the static forward's kernels (what its graph replays) and their device time, by the profiler on a GPU
        with engine._on_device():
            tokens = torch.full((B, 1), prompt[-1], dtype=torch.long)

            def forward():
                engine.cache.lengths[:B] = int(context)
                engine.model.forward(tokens, engine.cache, slice(0, B), ctx=bucket)

            forward()  # (on a CPU too: the call the profile makes)
            if device.type == "cuda":
                try:
                    row["forward_device_ops"], row["forward_device_busy_ms"] = kernels_per_call(forward, 5)
                except Exception as e:  # CUPTI missing: the rest stands
                    row["profiler_error"] = f"{type(e).__name__}: {e}"[:300]
        return row

    # each batch with the layers' pointwise regions op by op and fused (models.fused), in turn (switching
    # drops the captured graphs); a failure of the fused kernels is recorded and ends only their rows. After
    # the first, a measurement is skipped, and recorded, where it would take the stages after this one
    # below their plans: where less is left than twice the last one's two timed calls (its first call, of
    # captures and compiles, is not a price for the next: a compile comes once)
    out["skipped_for_time"], need = [], 0.0
    for i, B in enumerate(size.big_batches):
        for fused in rotated([False, True], i):
            if fused and "error" in out["fused"]:
                continue
            if need and c.stage_left() < need:
                out["skipped_for_time"].append({"batch": B, "fused": fused})
                continue
            t = time.perf_counter()
            try:
                engine.fused = fused
                row = measure(B)
            except Exception as e:
                if not fused:
                    raise
                out["fused"]["error"] = f"{type(e).__name__}: {e}"
                log(f"8B shape: the fused kernels failed ({out['fused']['error']}); their rows are left out")
                continue
            (out["fused"] if fused else out)["batches"][str(B)] = row
            need = 2 * (time.perf_counter() - t - row["first_call_s"])
            log(f"8B shape{'' if size.big_full else ' (scaled)'} batch {B}{', fused' if fused else ''}: step "
                 f"{row['step_ms']:.2f} ms against a bound of {row['bound_ms']:.3f} ms ({row['step_vs_bound']:.2f}x); "
                 f"graphs captured {row['captures']}, replayed {row['replays']}"
                 + (f"; a forward {row['forward_device_ops']:.0f} device ops, busy {row['forward_device_busy_ms']:.2f} ms"
                    if "forward_device_ops" in row else ""))
    engine.fused = False
    out["engine"] = engine_info(engine)
    for where in (out, out["fused"]):
        if one := where["batches"].get("1"):
            where["batch1_within_1_5x"] = one["step_vs_bound"] <= 1.5
    return out
