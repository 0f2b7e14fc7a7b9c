"""The gpu check's stages, in run order: each takes the run (`Check`) and returns its numbers (or raises:
the harness records the error and goes on)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import platform
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from fastgrpo.bench.gpu_check.harness import (PLANNED_S, Check, copy_bandwidth, log, peak_bandwidth, release, spread,
                                             sync, timed)

if TYPE_CHECKING:  # annotations only: importing gpu_check must not need the engine (pins runs first)
    from torch import Tensor
    from transformers import PretrainedConfig

    from fastgrpo.engines.embedded.engine import EmbeddedEngine
    from fastgrpo.models.tokenizer import TextFormat
    from fastgrpo.speculation.policy import SpeculationPolicy
    from fastgrpo.speculation.spec import SpecConfig
    from fastgrpo.types import Request, SamplingParams

# the rollout's modes: `static` twice under two names (the A/A pair: the same tree, policy and seeds, so
# their ratio is the run's noise floor), every fixed choice aware must match, and aware's two
SWEEP_MODES = ("off", "static", "static_aa", "fastgrpo", "tlt", "aware", "aware_per_sequence")
AA_PAIR = ("static", "static_aa")
FIXED_MODES = ("off", "static", "fastgrpo", "tlt")  # the GRPO batch adds bench rollout's static trees
AWARE_MODES = ("aware", "aware_per_sequence")
UNSHARED = "off_unshared_prefill"  # plain decoding, every sample prefilling its own copy of its prompt
DECODE_BATCHES = (1, 64)
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
ROOT = Path(__file__).resolve().parents[3]  # the repository: configs/models/
BIG_MODEL = "llama-3.1-8b-instruct.json"
# decode_8b at test size: the 8B's structure (4 query heads a KV head, an MLP 3.5x the width, untied, the
# llama3 rope scaling) at a size a CPU decodes in milliseconds
SCALED_8B = {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 896, "num_attention_heads": 8,
             "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 4096}


def environment(c: Check) -> dict:
    import torch
    import transformers

    d = c.compute.device
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "transformers": transformers.__version__, "device": str(d), "dtype": str(c.compute.dtype),
           "cpu_threads": torch.get_num_threads(), "machine": platform.machine(),
           "wheels_installed_here": os.environ.get("GPU_CHECK_INSTALLED", "").split(),
           "compiled_extensions": compiled_extensions(), "budget_s": c.budget_s, "size": c.size_name}
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


def compiled_extensions() -> dict[str, bool]:
    """Which of setup.py's C parts this Python runs (the draft index's trie, the hybrid merge): without them
    the index's lookups and the merge are their Python and torch equivalents, the same trees at more host
    time a step, which the step and rollout timings then include."""
    from fastgrpo.engines.embedded import tree
    from fastgrpo.speculation import suffix_index

    return {"suffix_trie": suffix_index.CompiledTrie is not None, "tree_merge": tree.compiled_merge_rows is not None}


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
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        sync()
    device_events = _device_events(prof.events())
    us = sum(e.time_range.elapsed_us() for e in device_events)  # each device event's own duration
    return len(device_events) / calls, us / 1000 / calls


def _device_events(events: Any) -> list:
    """A CUDA profile's device events: kernels, memcpys and memsets."""
    from torch.autograd import DeviceType

    return [e for e in events if e.device_type == DeviceType.CUDA]


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


# -- what the rollout and step stages share ------------------------------------------------------------
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
            # the policy's `ahead` in static steps, and the wait on the device after it (> 0: the step hid it)
            "ahead_s": stats.get("ahead_s", 0.0), "wait_s": stats.get("wait_s", 0.0),
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


def _shares(r: dict) -> dict[str, float]:
    """bench rollout's time shares (prefill, steps by running sequences) of one call."""
    from fastgrpo.bench.rollout import time_shares

    t = r["trace"]
    return time_shares({"seconds": r.get("wall_s", r["seconds"]), "prefill_s": r["prefill_s"],  # (the trace has the captures)
                        "trace": list(zip(t["running"], t["config"], t["emitted"], [ms / 1000 for ms in t["ms"]]))})


# -- rollout -------------------------------------------------------------------------------------------
def level_row(B: int, runs: dict[str, list[dict]]) -> dict:
    """One level of the sweep from each mode's timed calls: median tokens/s and its standard error, the
    A/A pair's ratio (the noise floor: two identical policies), the best fixed choice and aware against
    it and against plain decoding."""
    row: dict[str, Any] = {"concurrency": B}
    for mode, rs in runs.items():
        tok = spread([r["tok_s"] for r in rs])
        row |= {f"{mode}_tok_s": tok["median"], f"{mode}_tok_s_se": tok["se"], f"{mode}_runs": tok["n"],
                f"{mode}_accept_len": statistics.median(r["accept_len"] for r in rs),
                f"{mode}_spec_fraction": statistics.median(r["spec_fraction"] for r in rs)}
    modes = list(runs)
    best = max(modes, key=lambda m: row[f"{m}_tok_s"])
    row |= {"best": best, "best_vs_off": row[f"{best}_tok_s"] / row["off_tok_s"]}
    fixed = [m for m in FIXED_MODES if m in runs]
    best_fixed = max(fixed, key=lambda m: row[f"{m}_tok_s"])
    row |= {"best_fixed": best_fixed, "best_fixed_tok_s": row[f"{best_fixed}_tok_s"]}
    if "aware" in runs:
        row |= {"aware_vs_best": row["aware_tok_s"] / row["best_fixed_tok_s"],
                "aware_vs_off": row["aware_tok_s"] / row["off_tok_s"], **ahead_and_wait(runs["aware"])}
    a, b = AA_PAIR
    if a in runs and b in runs:
        row["aa_ratio"] = row[f"{b}_tok_s"] / row[f"{a}_tok_s"]
    return row


def ahead_and_wait(rs: list[dict]) -> dict[str, float]:
    """aware's calls: the median seconds of its `ahead` in static steps and of the wait on the device after
    it (a wait left: the device's steps hid `ahead`; none: `ahead` was on the steps' path)."""
    return {"aware_ahead_s": statistics.median(r.get("ahead_s", 0.0) for r in rs),
            "aware_wait_s": statistics.median(r.get("wait_s", 0.0) for r in rs)}


def grpo_summary(runs: dict[str, list[dict]], fixed: tuple[str, ...]) -> dict:
    """The GRPO batch from each contender's timed calls: median seconds and standard errors, the best of
    the `fixed` choices, aware against it and against plain decoding (speed ratios: > 1 faster), the A/A
    pair's ratio (static_aa's speed over static's)."""
    from fastgrpo.bench.rollout import padding

    spreads = {m: spread([r["seconds"] for r in rs]) for m, rs in runs.items()}
    med = {m: s["median"] for m, s in spreads.items()}
    statics = {m: med[m] for m in med if m.startswith("static_") and m != AA_PAIR[1]}
    best_static = min(statics or {"static": med["static"]}, key=lambda m: med[m])
    best_fixed = min((m for m in fixed if m in med), key=lambda m: med[m])
    out = {"off_s": med["off"], "static_best_s": med[best_static], "static_best": best_static,
           "all_s": med, "se_s": {m: s["se"] for m, s in spreads.items()}, "runs": {m: s["n"] for m, s in spreads.items()},
           "tokens_median": {m: statistics.median(r["tokens"] for r in rs) for m, rs in runs.items()},
           "best_fixed": best_fixed, "best_fixed_s": med[best_fixed], "padding": {m: padding(rs) for m, rs in runs.items()}}
    out |= {f"{m}_s": med[m] for m in med if m in (*SWEEP_MODES, UNSHARED)}
    if "aware" in med:
        out |= {"aware_vs_best": med[best_fixed] / med["aware"], "aware_vs_off": med["off"] / med["aware"],
                "aware_accept_len": statistics.median(r["accept_len"] for r in runs["aware"]),
                **ahead_and_wait(runs["aware"])}
    a, b = AA_PAIR
    if a in med and b in med:
        out["aa_ratio"] = med[a] / med[b]
    return out


def rollout(c: Check) -> dict:
    """`bench rollout`'s workloads on the run's device, repeated until they decide: the modes of
    SWEEP_MODES (an A/A pair among them) at each level of running sequences and on a GRPO batch (with
    bench rollout's static trees and unshared prefill), `reps` timed calls each after a warm-up, the
    modes' order rotated every repetition. Kept with the results: every call (time, tokens, the
    configurations it ran by concurrency, its per-step trace, graph captures), aware's state after each of
    its calls, and its calibrated cost model (calibrated here first, timed)."""
    from fastgrpo.bench.rollout import STATIC_SWEEP, rotated
    from fastgrpo.engines.embedded.build import build_engine, speculation_policy
    from fastgrpo.speculation.policy import Static
    from fastgrpo.types import Request, SamplingParams

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
    policies = {mode: speculation_policy(engine, cfg, "static" if mode == AA_PAIR[1] else mode) for mode in SWEEP_MODES}
    cost_model = jsonable(getattr(policies["aware"], "costs", None))
    log(f"rollout: engine on {engine.device} ({engine.dtype}) built with aware's cost model in {calibration_s:.1f}s; "
         + (f"{c.stage_left():.0f}s left in the budget" if math.isfinite(c.stage_left()) else "no budget"))
    out: dict[str, Any] = {"modes": list(SWEEP_MODES), "fixed_modes": list(FIXED_MODES), "aa_pair": list(AA_PAIR),
                           "levels": [], "levels_skipped_for_time": [], "tokens_per_sequence": size.sweep_tokens,
                           "repetitions": size.reps, "calibration_s": calibration_s, "grpo_prompts": size.grpo_prompts,
                           "engine": engine_info(engine), "cost_model": cost_model, "calls": [], "aware_states": []}

    def record(workload: str, mode: str, rep: int, order: list[str], r: dict, policy) -> None:
        out["calls"].append({"workload": workload, "mode": mode, "rep": rep, "position": order.index(mode)}
                            | {k: v for k, v in r.items() if k != "lengths"})
        if mode in AWARE_MODES:
            state = policy_state(policy)
            if state.get("costs") == cost_model:  # the calibration, unchanged: saved once, as cost_model
                state["costs"] = "unchanged: rollout.cost_model"
            out["aware_states"].append({"workload": workload, "mode": mode, "rep": rep, "configs": r["configs"],
                                        "probes": state.get("probes"), "state": state})

    def run_reps(workload: str, contenders: dict, requests, sampling, seed, unshared: str | None = None) -> dict:
        runs: dict[str, list[dict]] = {m: [] for m in contenders}
        for rep in range(size.reps + 1):  # rep 0 warms up (and teaches the learning policies, as in training)
            order = rotated(list(contenders), rep)
            for mode in order:
                r = generate_call(engine, contenders[mode], requests, sampling, seed(rep), share_prefill=mode != unshared)
                record(workload, mode, rep, order, r, contenders[mode])
                if rep:
                    runs[mode].append(r)
        engine.share_prefill = True
        return runs

    # the GRPO batch's generate calls: every mode, the static sweep and unshared prefill, each reps + 1 times
    calls = (len(SWEEP_MODES) + len(STATIC_SWEEP) + 1) * (size.reps + 1)
    sweep: list[dict] = []
    t = time.perf_counter()
    level_s = 0.0
    sampling = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                              max_new_tokens=size.sweep_tokens, ignore_eos=True)
    for B in size.levels:
        # within the budget: a level costs at most about twice the one before (the engine's steps cost much
        # the same at 4x the sequences until the GPU is busy), and the GRPO batch needs its least (64 tokens)
        step_s = sweep[-1]["concurrency"] / sweep[-1]["off_tok_s"] if sweep else 0.0
        if sweep and c.stage_left() < 2 * level_s + calls * 64 * step_s:
            out["levels_skipped_for_time"].append(B)
            continue
        t1 = time.perf_counter()
        requests = [Request(prompts[i % len(prompts)], max_new_tokens=size.sweep_tokens) for i in range(B)]
        runs = run_reps(f"sweep_{B}", policies, requests, sampling, lambda rep, B=B: 1000 * rep + B)
        level_s = time.perf_counter() - t1
        row = level_row(B, runs) | {"seconds": level_s}
        sweep.append(row)
        out["levels"].append(B)
        log(f"concurrency {B:3d}: " + ", ".join(f"{m} {row[f'{m}_tok_s']:.0f}±{row[f'{m}_tok_s_se']:.0f}"
                                                for m in SWEEP_MODES)
            + f" tok/s | A/A {row['aa_ratio']:.3f}, aware / best fixed ({row['best_fixed']}) {row['aware_vs_best']:.2f}")
        c.partial("rollout", out | {"sweep": sweep})
    out["sweep"], out["sweep_s"] = sweep, time.perf_counter() - t
    # the GRPO batch's length cap, lowered (to 32 at least) if its calls would not fit in what is left, priced
    # at plain decoding's step at the nearest concurrency measured, with half again for the other modes
    max_new = size.grpo_max_new
    if sweep and math.isfinite(c.stage_left()):
        near = min(sweep, key=lambda r: abs(r["concurrency"] - 8 * size.grpo_prompts))
        step_s = near["concurrency"] / near["off_tok_s"]
        max_new = min(max_new, max(32, int(c.stage_left() / (1.5 * calls * step_s))))
    out["grpo_max_new"] = max_new
    t = time.perf_counter()
    contenders = dict(policies) | {f"static_{s.depth}_{s.topk}_{s.num_verify}": Static(s) for s in STATIC_SWEEP}
    contenders[UNSHARED] = policies["off"]  # plain decoding with every sample prefilling its own prompt
    requests = [Request(p) for p in prompts[: size.grpo_prompts] for _ in range(8)]
    grpo_sampling = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, max_new_tokens=max_new)
    runs = run_reps("grpo", contenders, requests, grpo_sampling, lambda rep: 77 + rep, unshared=UNSHARED)
    fixed = (*FIXED_MODES, *(m for m in contenders if m.startswith("static_") and m != AA_PAIR[1]))
    g = grpo_summary(runs, fixed)
    # the shares of each mode's median-time repetition (medians of each part would not add up to 1)
    g["time_shares"] = {m: _shares(sorted(runs[m], key=lambda r: r["seconds"])[len(runs[m]) // 2])
                        for m in ("off", "aware")}
    out["grpo_batch"], out["grpo_batch_s"] = g, time.perf_counter() - t
    log("GRPO batch: " + ", ".join(f"{m} {s:.2f}s" for m, s in g["all_s"].items())
        + f" | A/A {g['aa_ratio']:.3f}, aware / best fixed ({g['best_fixed']}) {g['aware_vs_best']:.2f}, "
          f"aware / off {g['aware_vs_off']:.2f}")
    out["engine"] = engine_info(engine)
    out["cost_model_after"] = jsonable(getattr(policies["aware"], "costs", None))
    if out["levels_skipped_for_time"] or max_new < size.grpo_max_new:
        log(f"rollout: to stay within the budget, skipped levels {out['levels_skipped_for_time']} and capped the "
             f"GRPO batch at {max_new} new tokens (planned {size.grpo_max_new})")
    return out


# -- step_bench ------------------------------------------------------------------------------------------
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
                counted.append(len(_device_events(events)) if cuda else launched_ops(events))
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


# -- decode_8b -------------------------------------------------------------------------------------------
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
                    row["forward_device_ops"], row["forward_device_busy_ms"] = _kernels_per_call(forward, 5)
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


STAGE_FUNCTIONS = {"environment": environment, "sft": sft, "draft": draft, "train_step": train_step,
                   "weight_push": weight_push, "decode_bound": decode_bound, "step_bench": step_bench,
                   "simulator_fit": simulator_fit, "decode_8b": decode_8b, "rollout": rollout}
