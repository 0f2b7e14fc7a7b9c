"""The gpu check's stages, in run order (STAGE_FUNCTIONS): each takes the run (`Check`) and returns its
numbers (or raises: the harness records the error and goes on). The training side's stages are here (the
environment, SFT, the draft, a GRPO step of each trainer, the weight push); the decode steps against their
bound are `decode`'s, the step microbenchmark and the simulator's fit `steps`', the rollout sweep
`rollout_sweep`'s."""

from __future__ import annotations

import os
import platform
import statistics
from typing import Any

from fastgrpo.bench.gpu_check.decode import decode_8b, decode_bound
from fastgrpo.bench.gpu_check.harness import Check, copy_bandwidth, log, peak_bandwidth, release, sync, timed
from fastgrpo.bench.gpu_check.rollout_sweep import rollout
from fastgrpo.bench.gpu_check.steps import simulator_fit, step_bench


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


STAGE_FUNCTIONS = {"environment": environment, "sft": sft, "draft": draft, "train_step": train_step,
                   "weight_push": weight_push, "decode_bound": decode_bound, "step_bench": step_bench,
                   "simulator_fit": simulator_fit, "decode_8b": decode_8b, "rollout": rollout}
