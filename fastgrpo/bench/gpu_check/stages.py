"""The gpu check's stages, in run order: each takes the run (`Check`) and returns its numbers (or raises:
the harness records the error and goes on)."""

from __future__ import annotations

import contextlib
import math
import os
import platform
import statistics
import time
from typing import Any

from fastgrpo.bench.gpu_check.harness import Check, copy_bandwidth, log, peak_bandwidth, release, sync, timed

SWEEP_MODES = ("off", "static", "fastgrpo", "tlt", "aware", "aware_per_sequence")
DECODE_BATCHES = (1, 64)


def environment(c: Check) -> dict:
    import torch
    import transformers

    d = c.compute.device
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "transformers": transformers.__version__, "device": str(d), "dtype": str(c.compute.dtype),
           "cpu_threads": torch.get_num_threads(), "machine": platform.machine(),
           "wheels_installed_here": os.environ.get("GPU_CHECK_INSTALLED", "").split(),
           "budget_s": c.budget_s, "size": c.size_name}
    if d.type == "cuda":
        p = torch.cuda.get_device_properties(d)
        out |= {"device_name": torch.cuda.get_device_name(d), "capability": f"{p.major}.{p.minor}",
                "memory_gb": p.total_memory / 1e9, "multiprocessors": p.multi_processor_count,
                "bf16": torch.cuda.is_bf16_supported(), "cudnn": torch.backends.cudnn.version()}
        peak = peak_bandwidth(out["device_name"])
        out["peak_bandwidth_gb_s"] = None if peak is None else peak / 1e9
    else:
        out |= {"device_name": platform.processor() or platform.machine(), "peak_bandwidth_gb_s": None}
    out["copy_bandwidth_gb_s"] = copy_bandwidth(d)
    log(f"{out['device_name']}, torch {out['torch']} (CUDA {out['cuda']}), transformers {out['transformers']}, "
         f"{out['dtype']}; copy {out['copy_bandwidth_gb_s']:.0f} GB/s, spec {out['peak_bandwidth_gb_s']} GB/s")
    return out


def sft(c: Check) -> dict:
    from fastgrpo.sft import build_policy

    report = build_policy(c.cfg)
    s = c.cfg.sft
    return report | {"planned_steps": max(1, s.examples // s.batch_size), "batch_size": s.batch_size,
                     "steps_per_s": report["steps"] / max(60 * report["minutes"], 1e-9), "model_size": c.cfg.model.size}


def draft(c: Check) -> dict:
    from fastgrpo.draft_learning.pretrain import pretrain_draft

    report = pretrain_draft(c.cfg)
    return report | {"steps_per_s": report["steps"] / max(60 * report["minutes"], 1e-9)} | online_round(c)


def online_round(c: Check, sequences: int = 64, budget_s: float = 5.0) -> dict:
    """One round of the sync online learner as a run does it: the policy's states over `sequences`
    held-out solutions in host memory (as rollout's captured states are kept), trained on the run's
    device for `budget_s` seconds (a round's budget, as a run's share of a step), then published."""
    import torch

    from fastgrpo.device import resolve
    from fastgrpo.draft_learning.online import OnlineDraftLearner
    from fastgrpo.draft_learning.pretrain import target_states
    from fastgrpo.models.draft import DraftHead
    from fastgrpo.paths import draft_dir
    from fastgrpo.tasks.source import load_task

    compute = resolve(c.cfg)
    policy, text = c.policy()
    policy.to(compute.device, compute.dtype)
    _, evals = load_task(c.cfg.task)
    texts = [(text.prompt_ids(p.prompt) + text.response_ids(p.solution or str(p.answer)))
             [: c.cfg.model.max_context] for p in evals[:sequences]]
    hidden, ids, mask = target_states(policy, texts)
    rows = [(hidden[i, : len(t)].cpu(), ids[i, : len(t)].cpu(), torch.ones(len(t), dtype=torch.bool, device="cpu"))
            for i, t in enumerate(texts)]
    draft = DraftHead.load(draft_dir(c.cfg), policy.config, c.cfg.model.max_context)
    learner = OnlineDraftLearner(draft, c.cfg.draft, [], seed=c.cfg.seed, device=compute.device)
    learner.update_weights(policy.state_dict().items(), version=1)
    learner.buffer(rows, policy_version=1)
    sync()
    metrics = learner.train(budget_s)
    sync()
    return {"online_device": str(next(learner.draft.parameters()).device), "online_steps": metrics["draft_steps"],
            "online_version": learner.version, "online_train_s": metrics["draft_train_s"],
            "online_loss_fresh": learner.fresh.get("draft_loss_fresh"), "online_loss": metrics.get("draft_loss")}


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def train_step(c: Check) -> dict:
    """One GRPO step (its minibatches) of the Megatron trainer and of the torch trainer on the same batch
    (random tokens of rollout-like lengths, random advantages: `bench trainer`'s), from the same weights,
    in the run's precision; then a second step each, timed warm."""
    import torch

    from fastgrpo.trainers.torch_trainer import TorchPolicyTrainer
    from fastgrpo.bench.trainer import _batch
    from fastgrpo.models.policy import load_policy
    from fastgrpo.types import SamplingParams

    cfg, sampling = c.cfg, SamplingParams.of(c.cfg.rollout)
    tt = TorchPolicyTrainer(load_policy(cfg.model.path), cfg.grpo, cfg.optim, sampling, None, c.compute)
    c.held["torch_trainer"] = tt
    batch = _batch(tt.model.config.vocab_size, c.size.train_sequences)
    torch_lp = tt.logprobs(batch).cpu()
    reference = None
    if c.compute.dtype != torch.float32:  # the same weights in fp32: how far each bf16 trainer is from exact
        from fastgrpo.device import Compute

        fp32 = TorchPolicyTrainer(load_policy(cfg.model.path), cfg.grpo, cfg.optim, sampling, None,
                                  Compute(c.compute.device, torch.float32))
        reference = fp32.logprobs(batch).cpu()
        del fp32
        release()
    batch.engine_logprobs = torch_lp * batch.response_mask  # the engine sampled with these weights
    out: dict[str, Any] = {"sequences": batch.size, "tokens": int(batch.attention_mask.sum()),
                           "minibatches": cfg.grpo.minibatches, "dtype": str(c.compute.dtype),
                           "layer_spec": cfg.trainer.layer_spec}
    torch_first, out["torch_first_step_s"] = timed(lambda: tt.train_step(batch))
    torch_second, out["torch_step_s"] = timed(lambda: tt.train_step(batch))
    out["torch_metrics"] = torch_first
    log(f"torch trainer: first step {out['torch_first_step_s']:.2f}s, warm step {out['torch_step_s']:.2f}s, "
         f"loss {torch_first['loss']:.4g}, grad norm {torch_first['grad_norm']:.4g}")

    from fastgrpo.trainers.megatron.trainer import MegatronPolicyTrainer

    mt, out["megatron_build_s"] = timed(lambda: MegatronPolicyTrainer(
        cfg.model.path, cfg.grpo, cfg.optim, sampling, tensor=1, pipeline=1, seed=cfg.seed,
        layer_spec=cfg.trainer.layer_spec, compute=c.compute))
    c.held["megatron_trainer"] = mt
    import torch.distributed as dist

    out["megatron_backend"] = dist.get_backend() if dist.is_initialized() else None
    meg_lp = mt.logprobs(batch).cpu()
    mask = batch.response_mask
    out["logprob_max_abs_diff"] = float((meg_lp - torch_lp)[mask].abs().max())
    out["logprob_mean_abs_diff"] = float((meg_lp - torch_lp)[mask].abs().mean())
    if reference is not None:
        for name, lp in (("torch", torch_lp), ("megatron", meg_lp)):
            gap = (lp - reference)[mask].abs()
            out[f"{name}_vs_fp32_logprob_max_abs_diff"], out[f"{name}_vs_fp32_logprob_mean_abs_diff"] = (
                float(gap.max()), float(gap.mean()))
        log(f"against the same weights in fp32, log-probabilities mean |diff|: torch "
             f"{out['torch_vs_fp32_logprob_mean_abs_diff']:.3g}, megatron {out['megatron_vs_fp32_logprob_mean_abs_diff']:.3g}")
    meg_first, out["megatron_first_step_s"] = timed(lambda: mt.train_step(batch))
    meg_second, out["megatron_step_s"] = timed(lambda: mt.train_step(batch))
    out["megatron_metrics"] = meg_first
    for key in ("loss", "grad_norm", "entropy", "kl_engine_trainer"):
        out[f"{key}_relative_diff"] = _relative(meg_first[key], torch_first[key])
    out["second_step_loss_relative_diff"] = _relative(meg_second["loss"], torch_second["loss"])
    out["megatron_vs_torch_step"] = out["megatron_step_s"] / out["torch_step_s"]
    log(f"megatron trainer ({out['megatron_backend']}): first step {out['megatron_first_step_s']:.2f}s, warm step "
         f"{out['megatron_step_s']:.2f}s; against torch: loss {out['loss_relative_diff']:.2e}, grad norm "
         f"{out['grad_norm_relative_diff']:.2e} relative, log-probabilities max |diff| "
         f"{out['logprob_max_abs_diff']:.3g}")
    return out


def weight_push(c: Check) -> dict:
    """The run's weight push (`bridge.WeightBridge`: buckets, version, per-tensor checksums checked at the
    commit) from the trainer into an engine on the device, timed against copying the same bytes once."""
    import torch
    from transformers import AutoConfig

    from fastgrpo.engines import build_engine
    from fastgrpo.trainers.torch_trainer import TorchPolicyTrainer
    from fastgrpo.bridge import WeightBridge, checksum
    from fastgrpo.models.policy import load_policy
    from fastgrpo.models.tokenizer import load_text_format
    from fastgrpo.types import SamplingParams

    cfg = c.cfg
    tt = c.held.get("torch_trainer") or TorchPolicyTrainer(load_policy(cfg.model.path), cfg.grpo, cfg.optim,
                                                            SamplingParams.of(cfg.rollout), None, c.compute)
    engine = build_engine(c.with_batch(8), AutoConfig.from_pretrained(cfg.model.path),
                          load_text_format(cfg.model.path, cfg.task), speculation="off")
    bridge = WeightBridge([engine])
    bridge.push(tt.export_weights(), version=1)  # warm-up
    pushes = []
    for v in range(2, 2 + c.size.push_reps):
        report, seconds = timed(lambda: bridge.push(tt.export_weights(), version=v))
        pushes.append((report, seconds))
    held = dict(engine.model.named_weights())
    sent = dict(tt.export_weights())
    same = all(torch.equal(held[n], sent[n]) for n in held if n in sent)
    version = bridge.version
    # a tensor changed in flight: the commit compares it with the sender's checksum and refuses the version
    name = next(n for n in sent if n != "lm_head.weight")
    bad = sent[name].clone()
    bad.view(-1)[0] += 1
    engine.update_weights([(name, bad)], version + 1, complete=False)
    try:
        engine.commit_weights(version + 1, {n: checksum(t) for n, t in sent.items()})
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    bridge.version = version + 1  # what the refused push used; the next push is newer
    report, _ = timed(lambda: bridge.push(tt.export_weights(), version=version + 2))
    serving = engine.weights_version == version + 2
    # the bound: the same tensors copied once on the device
    sources = [t.clone() for t in held.values()]
    copies = []
    for _ in range(c.size.push_reps + 1):
        _, s = timed(lambda: [dst.copy_(src) for dst, src in zip(held.values(), sources)])
        copies.append(s)
    push_s = statistics.median(s for _, s in pushes)
    nbytes = pushes[0][0].bytes
    copy_s = statistics.median(copies[1:])
    out = {"tensors": pushes[0][0].tensors, "bytes": nbytes, "buckets": pushes[0][0].buckets, "push_s": push_s,
           "push_gb_s": nbytes / push_s / 1e9, "memcpy_s": copy_s,
           "memcpy_gb_s": sum(t.numel() * t.element_size() for t in sources) / copy_s / 1e9,
           "push_vs_memcpy": push_s / copy_s, "engine_holds_trainer_weights": same,
           "corrupted_push_refused": bool(refused), "refusal": refused[:300], "serving_after_refusal": serving,
           "dtype": str(next(iter(held.values())).dtype)}
    mt = c.held.get("megatron_trainer")
    if mt is not None:  # Megatron's export (full Hugging Face tensors) into the same engine
        report, seconds = timed(lambda: bridge.push(mt.export_weights(), version=bridge.version + 1))
        exported = dict(mt.export_weights())
        out |= {"megatron_push_s": seconds, "megatron_push_bytes": report.bytes,
                "megatron_engine_holds_weights": all(torch.equal(held[n], exported[n]) for n in held if n in exported)}
    if not (same and refused and serving):
        raise RuntimeError(f"weight push check failed: engine holds the trainer's weights {same}, corrupted push "
                           f"refused {bool(refused)}, serving after the refusal {serving}")
    log(f"weight push: {nbytes / 1e6:.0f} MB in {push_s * 1000:.1f} ms ({out['push_gb_s']:.1f} GB/s; a device copy "
         f"{out['memcpy_gb_s']:.0f} GB/s); a corrupted tensor refused at the commit: {out['corrupted_push_refused']}")
    return out


def _kernels_per_call(fn, calls: int) -> tuple[float, float]:
    """(device operations per call, their summed device time per call in ms), by torch's profiler
    (CUPTI): kernels, memcpys and memsets of `calls` calls."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        sync()
    device_events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    us = sum(e.time_range.elapsed_us() for e in device_events)  # each device event's own duration
    return len(device_events) / calls, us / 1000 / calls


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
    """The engine's plain decode step (no speculation, no CUDA graphs: the embedded engine runs eagerly)
    at batch 1 and 64 against its memory-bandwidth bound, and where the rest goes.

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
                           "prompt_tokens": len(prompt), "graphs": "off (the embedded engine runs eagerly)",
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
                    ops, busy_ms = _kernels_per_call(forward, 5)
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


def rollout(c: Check) -> dict:
    """`bench rollout`'s sweep and GRPO batch (its own functions), with every speculation mode and up to
    256 running sequences, on the run's device; aware's cost model is calibrated here first (timed)."""
    from fastgrpo.engines.embedded.build import build_engine, speculation_policy
    from fastgrpo.bench.rollout import STATIC_SWEEP, concurrency_sweep, grpo_batch

    cfg, size = c.cfg, c.size
    policy, text = c.policy()
    prompts = c.prompts(text)
    # the engine with its draft and aware's cost model, calibrated on this device (timed: it runs once per
    # machine and model shape, then comes from speculation.cost_model_dir)
    t = time.perf_counter()
    engine = build_engine(c.with_batch(max(max(size.levels), size.grpo_prompts * 8)), policy.config, text,
                          policy.state_dict().items(), speculation="aware")
    sync()
    calibration_s = time.perf_counter() - t
    del policy
    policies = {mode: speculation_policy(engine, cfg, mode) for mode in SWEEP_MODES}
    log(f"rollout: engine on {engine.device} ({engine.dtype}) built with aware's cost model in {calibration_s:.1f}s; "
         f"{c.left():.0f}s left in the budget")
    out: dict[str, Any] = {"modes": list(SWEEP_MODES), "levels": [], "levels_skipped_for_time": [],
                           "tokens_per_sequence": size.sweep_tokens, "repetitions": size.reps,
                           "calibration_s": calibration_s, "grpo_prompts": size.grpo_prompts}
    # the GRPO batch's generate calls: every mode, the static sweep and unshared prefill, each reps + 1 times
    calls = (len(SWEEP_MODES) + len(STATIC_SWEEP) + 1) * (size.reps + 1)
    sweep: list[dict] = []
    t = time.perf_counter()
    level_s = 0.0
    for B in size.levels:
        # within the budget: a level costs at most about twice the one before (the engine's steps cost much
        # the same at 4x the sequences until the GPU is busy), and the GRPO batch needs its least (64 tokens)
        step_s = sweep[-1]["concurrency"] / sweep[-1]["off_tok_s"] if sweep else 0.0
        if sweep and c.left() < 2 * level_s + calls * 64 * step_s:
            out["levels_skipped_for_time"].append(B)
            continue
        t1 = time.perf_counter()
        row = concurrency_sweep(engine, policies, prompts, cfg, (B,), size.sweep_tokens, size.reps, log)[0]
        level_s = time.perf_counter() - t1
        best = max(SWEEP_MODES, key=lambda mode: row[f"{mode}_tok_s"])
        row |= {"best": best, "best_vs_off": row[f"{best}_tok_s"] / row["off_tok_s"], "seconds": level_s}
        sweep.append(row)
        out["levels"].append(B)
        c.partial("rollout", out | {"sweep": sweep})
    out["sweep"], out["sweep_s"] = sweep, time.perf_counter() - t
    # the GRPO batch's length cap, lowered (to 32 at least) if its calls would not fit in what is left, priced
    # at plain decoding's step at the nearest concurrency measured, with half again for the other modes
    max_new = size.grpo_max_new
    if sweep and math.isfinite(c.left()):
        near = min(sweep, key=lambda r: abs(r["concurrency"] - 8 * size.grpo_prompts))
        step_s = near["concurrency"] / near["off_tok_s"]
        max_new = min(max_new, max(32, int(c.left() / (1.5 * calls * step_s))))
    out["grpo_max_new"] = max_new
    t = time.perf_counter()
    out["grpo_batch"] = grpo_batch(engine, policies, prompts, cfg, size.grpo_prompts, 8, max_new, size.reps, log)
    out["grpo_batch_s"] = time.perf_counter() - t
    if out["levels_skipped_for_time"] or max_new < size.grpo_max_new:
        log(f"rollout: to stay within the budget, skipped levels {out['levels_skipped_for_time']} and capped the "
             f"GRPO batch at {max_new} new tokens (planned {size.grpo_max_new})")
    return out


STAGE_FUNCTIONS = {"environment": environment, "sft": sft, "draft": draft, "train_step": train_step,
                   "weight_push": weight_push, "decode_bound": decode_bound, "rollout": rollout}
