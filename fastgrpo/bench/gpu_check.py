"""`fastgrpo bench gpu-check` (or `python -m fastgrpo.bench.gpu_check`; `tools/gpu_check.sh` wraps it for
an offline GPU machine): the GPU path shown to work and measured, in one run of at most 8 minutes on one
H100 or H200.

Stages, each timed and printed as it goes; a stage that fails is recorded with its error and the run
goes on to the next (the exit status is 1 if any failed). The JSON and the markdown tables are rewritten
after every stage, so a run cut short keeps what it finished.

- environment: versions, the device, its spec-sheet memory bandwidth (by name) and a measured copy's.
- sft: the policy (`model.size=gpu`, ~308M parameters) warm-started on the task (`fastgrpo sft`'s
  code) on the device, bf16 autocast, ~2 minutes (a fixed step count, `sft.max_minutes` as a guard).
- draft: its draft (`fastgrpo draft-pretrain`'s code) on the device, ~1 minute.
- train_step: one GRPO step of the Megatron trainer (world of 1, TP1 PP1, NCCL on a GPU) against the
  torch trainer's, both bf16, on the same batch: log-probabilities, loss, gradient norm, step times.
- weight_push: the trainer's weights into an engine through the weight bridge (buckets, a version,
  the checksummed commit), timed against a device memcpy of the same bytes; a corrupted tensor is
  refused at the commit; the Megatron trainer's export is pushed too when that stage built one.
- decode_bound: the plain decode step at batch 1 and 64 against its memory-bandwidth bound (bytes of
  weights + KV cache read per step / peak bandwidth), and what the rest is (see `decode_bound`).
- rollout: `bench rollout`'s own sweep and GRPO-batch code on this device: modes off, static,
  fastgrpo, tlt, aware, aware_per_sequence at 1, 4, 16, 64 and 256 running sequences, and a GRPO batch
  (with its static-tree sweep and shared-prefill comparison).

`--size test --device cpu` runs every stage at toy sizes in well under a minute (tests/test_gpu_check.py,
inside `make test`), so the script cannot rot before a GPU runs it.

What the GPU machine lacks beyond torch, transformers, safetensors and numpy is `WHEELS` (fetched
by `tools/gpu_wheels.sh`); tests/test_gpu_check.py checks that the modules this path imports come
from nowhere else. No MLflow (`tracking.enabled=false`; nothing here starts a tracker), no plots.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

# Pinned as the project's tested environment has them; --no-deps wheels, so every requirement of each
# is either here or comes with torch / transformers (tests/test_gpu_check.py checks both).
WHEELS = (
    "omegaconf==2.4.0", "antlr4-python3-runtime==4.13.2", "PyYAML==6.0.4",  # the config
    "tqdm==4.70.1",  # progress bars (SFT, draft)
    "math-verify==0.9.0", "latex2sympy2_extended==1.11.0", "sympy==1.14.0", "mpmath==1.3.0",  # rewards (SFT eval)
    "megatron-core==0.16.1", "psutil==7.2.2",  # the Megatron trainer
)
BASE = ("torch", "transformers", "safetensors", "numpy")  # what the GPU machine's Python has
WHEEL_BUDGET_MB = 20.0
# spec-sheet HBM bandwidth, bytes/s, by device name (first match; "H100" alone: the SXM part)
PEAK_BANDWIDTH = (("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12))
STAGES = ("environment", "sft", "draft", "train_step", "weight_push", "decode_bound", "rollout")
# seconds each stage is planned to take at gpu size on an H100 (sft and draft are held to theirs by
# sft.max_minutes and draft.pretrain_minutes; rollout fits itself into what is left of the run's budget);
# the report sets each stage's time beside its plan
PLANNED_S = {"environment": 10, "sft": 140, "draft": 75, "train_step": 45, "weight_push": 15, "decode_bound": 25,
             "rollout": 140}
SWEEP_MODES = ("off", "static", "fastgrpo", "tlt", "aware", "aware_per_sequence")
DECODE_BATCHES = (1, 64)


@dataclasses.dataclass(frozen=True)
class Size:
    overrides: tuple[str, ...]  # on top of the schema's defaults
    levels: tuple[int, ...]  # running sequences of the rollout sweep
    sweep_tokens: int  # tokens per sequence at fixed concurrency
    reps: int  # timed repetitions after a warm-up (rollout)
    grpo_prompts: int  # the GRPO batch: prompts x 8 samples
    grpo_max_new: int
    decode_tokens: int  # decode_bound: tokens per timed generate call
    train_sequences: int  # train_step's batch
    push_reps: int
    budget_s: float = 0.0  # the whole run's; the rollout stage (the last) fits itself into what is left; 0: none


SIZES = {
    "gpu": Size(
        overrides=("model.size=gpu", "model.max_context=512", "task.train_size=20000", "task.eval_size=64",
                   "rollout.max_batch=256", "rollout.max_new_tokens=256",
                   # 1800 steps of 64; the guard ends it at 2 minutes if this GPU is slower than planned
                   "sft.examples=115200", "sft.batch_size=64", "sft.lr=6e-4", "sft.warmup_steps=100",
                   "sft.max_minutes=2.0", "draft.pretrain_steps=6000", "draft.batch_size=32",
                   "draft.pretrain_minutes=1.0", "eval.samples=2", "grpo.minibatches=2",
                   "grpo.micro_batch_size=16"),
        levels=(1, 4, 16, 64, 256), sweep_tokens=64, reps=1, grpo_prompts=8, grpo_max_new=256, decode_tokens=64,
        train_sequences=32, push_reps=3, budget_s=480.0),
    "test": Size(
        overrides=("model.size=test", "model.max_context=160", "task.train_size=400", "task.eval_size=8",
                   "task.max_steps=6", "rollout.max_batch=16", "rollout.max_new_tokens=48", "sft.examples=1600",
                   "sft.batch_size=32", "sft.lr=3e-3", "sft.warmup_steps=5", "draft.pretrain_steps=40",
                   "draft.lr=3e-3", "draft.buffer_tokens=20000", "eval.samples=2", "grpo.minibatches=2",
                   "grpo.micro_batch_size=8", "optim.lr=1e-3"),
        levels=(1, 4, 16), sweep_tokens=8, reps=1, grpo_prompts=2, grpo_max_new=16, decode_tokens=8,
        train_sequences=8, push_reps=2),
}


def _release_key(version: str) -> Any:
    """A version's order: packaging's Version where it is there (it comes with pip), else its release
    numbers."""
    try:
        from packaging.version import Version

        return Version(version)
    except Exception:  # no packaging, or a version it cannot parse
        return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:4])


def wheels_to_install(wheels: list[Path], installed=None) -> list[Path]:
    """The carried wheels this Python lacks, or has only in an older version (an old omegaconf breaks the
    config, an old antlr4 runtime breaks math-verify); a newer installed version stays in charge.
    `installed(name)`: the installed version or None (default: importlib.metadata)."""
    import importlib.metadata as metadata

    def version_here(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    installed = installed or version_here
    chosen = []
    for wheel in sorted(wheels):
        name, version = wheel.name.split("-")[:2]  # a wheel's file name: name-version-...
        have = installed(name)
        if have is None or _release_key(have) < _release_key(version):
            chosen.append(wheel)
        print(f"gpu_check: {name} {version}: " + ("absent, installing" if have is None else
              f"{have} installed, " + ("older: installing" if wheel in chosen else "keeping it")), file=sys.stderr)
    return chosen


def _log(msg: str) -> None:
    print(f"[gpu-check] {msg}", flush=True)


def _finite(x: Any) -> Any:
    """JSON without NaN/inf (they become null)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _sync() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _timed(fn) -> tuple[Any, float]:
    _sync()
    t = time.perf_counter()
    out = fn()
    _sync()
    return out, time.perf_counter() - t


def _release() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class Check:
    """The run: its config, what stages hand on to later ones, the results on disk after each stage."""

    def __init__(self, out: Path, work: Path, size: str, device: str, overrides: list[str],
                 budget_s: float | None = None):
        from fastgrpo.config import load_config
        from fastgrpo.device import resolve

        self.out, self.work, self.size_name, self.size = out, work, size, SIZES[size]
        # the local layer spec unless asked (trainer.layer_spec=transformer_engine): the path every CPU test runs
        self.cfg = load_config(None, [*self.size.overrides, f"device={device}", "tracking.enabled=false",
                                      "speculation.policy=aware", "trainer.layer_spec=local", f"model.path={work / 'policy'}",
                                      f"run_dir={work / 'run'}", f"speculation.cost_model_dir={work / 'cost_models'}",
                                      *overrides])
        self.compute = resolve(self.cfg)
        self.t0 = time.perf_counter()
        self.budget_s = self.size.budget_s if budget_s is None else budget_s
        self.held: dict[str, Any] = {}  # objects a later stage may reuse (trainers)
        self.result: dict[str, Any] = {
            "meta": {"date": datetime.datetime.now().isoformat(timespec="seconds"), "size": size,
                     "device": str(self.compute.device), "dtype": str(self.compute.dtype).removeprefix("torch."),
                     "command": " ".join(["python -m fastgrpo.bench.gpu_check", "--size", size, "--device", device,
                                          *overrides]),
                     "overrides": list(self.size.overrides) + list(overrides), "budget_s": self.budget_s},
            "stages": {}}

    def seconds(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        """Seconds left in the run's budget (less a margin for the report), infinite without one."""
        return self.budget_s - 15.0 - self.seconds() if self.budget_s else math.inf

    def partial(self, name: str, data: dict) -> None:
        """What a long stage has so far, on disk: a run cut short keeps it."""
        self.result["stages"][name] = {"status": "running", "data": data, "seconds": 0.0}
        self.write()

    def stage(self, name: str, fn) -> bool:
        import torch

        _log(f"{self.seconds():6.1f}s  {name}: starting")
        t = time.perf_counter()
        record: dict[str, Any]
        cuda = self.compute.device.type == "cuda"
        if cuda:  # each stage's own peak, not the process's since the start
            with contextlib.suppress(Exception):
                torch.cuda.reset_peak_memory_stats()
        try:
            data = fn()
            record = {"status": "ok", "data": data}
        except Exception as e:  # recorded; the next stage still runs
            record = {"status": "failed", "error": f"{type(e).__name__}: {e}"[:2000],
                      "traceback": traceback.format_exc()[-4000:]}
            print(record["traceback"], file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            _sync()
        record["seconds"] = time.perf_counter() - t
        if self.size_name == "gpu":
            record["planned_s"] = PLANNED_S[name]
        if cuda:
            with contextlib.suppress(Exception):
                record["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
        self.result["stages"][name] = record
        with contextlib.suppress(Exception):  # a broken device must not cost the report
            _release()
        _log(f"{self.seconds():6.1f}s  {name}: {record['status']} in {record['seconds']:.1f}s"
             + (f" ({record['error'].splitlines()[0][:300]})" if record["status"] != "ok" else ""))
        self.write()
        return record["status"] == "ok"

    def write(self) -> None:
        self.result["meta"]["seconds"] = self.seconds()
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_check.json").write_text(json.dumps(_finite(self.result), indent=2))
        try:
            text = markdown(_finite(self.result))
        except Exception as e:  # the JSON stands; the tables say why they are missing
            text = f"# GPU check\n\nThe tables could not be made ({type(e).__name__}: {e}); see gpu_check.json.\n"
        (self.out / "gpu_check.md").write_text(text)

    # -- shared pieces ------------------------------------------------------------------------------
    def policy(self):
        from fastgrpo.models.policy import load_policy
        from fastgrpo.models.tokenizer import load_text_format

        return load_policy(self.cfg.model.path), load_text_format(self.cfg.model.path, self.cfg.task)

    def prompts(self, text) -> list[list[int]]:
        from fastgrpo.tasks.source import encode_problems, load_task

        _, evals = load_task(self.cfg.task)
        return [e.prompt_ids for e in encode_problems(evals, text, self.cfg.model.max_context, "eval")]

    def with_batch(self, max_batch: int):
        """The config with an engine of `max_batch` rows (a smaller KV cache where the stage needs fewer)."""
        return dataclasses.replace(self.cfg, rollout=dataclasses.replace(self.cfg.rollout, max_batch=max_batch))

    def bandwidth(self) -> tuple[float, str]:
        env = self.result["stages"].get("environment", {}).get("data") or {}
        if env.get("peak_bandwidth_gb_s"):
            return env["peak_bandwidth_gb_s"] * 1e9, "spec sheet"
        if env.get("copy_bandwidth_gb_s"):
            return env["copy_bandwidth_gb_s"] * 1e9, "measured copy (no spec sheet for this device)"
        return copy_bandwidth(self.compute.device) * 1e9, "measured copy (no spec sheet for this device)"


# -- stages ----------------------------------------------------------------------------------------------
def peak_bandwidth(name: str) -> float | None:
    return next((bw for key, bw in PEAK_BANDWIDTH if key in name), None)


def copy_bandwidth(device) -> float:
    """GB/s of a large device-to-device copy (read + write), median of 5 after a warm-up."""
    import torch

    n = (256 if device.type == "cuda" else 32) * 1024 * 1024  # fp32 elements: 1 GiB on a GPU, 128 MiB on a CPU
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        _, s = _timed(lambda: dst.copy_(src))
        times.append(s)
    return 2 * n * 4 / statistics.median(times[1:]) / 1e9


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
    _log(f"{out['device_name']}, torch {out['torch']} (CUDA {out['cuda']}), transformers {out['transformers']}, "
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

    from fastgrpo.engines.embedded.build import draft_dir
    from fastgrpo.device import resolve
    from fastgrpo.draft_learning.online import OnlineDraftLearner
    from fastgrpo.draft_learning.pretrain import target_states
    from fastgrpo.engines.embedded.draft import DraftHead
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
    _sync()
    metrics = learner.train(budget_s)
    _sync()
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
        _release()
    batch.engine_logprobs = torch_lp * batch.response_mask  # the engine sampled with these weights
    out: dict[str, Any] = {"sequences": batch.size, "tokens": int(batch.attention_mask.sum()),
                           "minibatches": cfg.grpo.minibatches, "dtype": str(c.compute.dtype),
                           "layer_spec": cfg.trainer.layer_spec}
    torch_first, out["torch_first_step_s"] = _timed(lambda: tt.train_step(batch))
    torch_second, out["torch_step_s"] = _timed(lambda: tt.train_step(batch))
    out["torch_metrics"] = torch_first
    _log(f"torch trainer: first step {out['torch_first_step_s']:.2f}s, warm step {out['torch_step_s']:.2f}s, "
         f"loss {torch_first['loss']:.4g}, grad norm {torch_first['grad_norm']:.4g}")

    from fastgrpo.trainers.megatron.trainer import MegatronPolicyTrainer

    mt, out["megatron_build_s"] = _timed(lambda: MegatronPolicyTrainer(
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
        _log(f"against the same weights in fp32, log-probabilities mean |diff|: torch "
             f"{out['torch_vs_fp32_logprob_mean_abs_diff']:.3g}, megatron {out['megatron_vs_fp32_logprob_mean_abs_diff']:.3g}")
    meg_first, out["megatron_first_step_s"] = _timed(lambda: mt.train_step(batch))
    meg_second, out["megatron_step_s"] = _timed(lambda: mt.train_step(batch))
    out["megatron_metrics"] = meg_first
    for key in ("loss", "grad_norm", "entropy", "kl_engine_trainer"):
        out[f"{key}_relative_diff"] = _relative(meg_first[key], torch_first[key])
    out["second_step_loss_relative_diff"] = _relative(meg_second["loss"], torch_second["loss"])
    out["megatron_vs_torch_step"] = out["megatron_step_s"] / out["torch_step_s"]
    _log(f"megatron trainer ({out['megatron_backend']}): first step {out['megatron_first_step_s']:.2f}s, warm step "
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
        report, seconds = _timed(lambda: bridge.push(tt.export_weights(), version=v))
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
    report, _ = _timed(lambda: bridge.push(tt.export_weights(), version=version + 2))
    serving = engine.weights_version == version + 2
    # the bound: the same tensors copied once on the device
    sources = [t.clone() for t in held.values()]
    copies = []
    for _ in range(c.size.push_reps + 1):
        _, s = _timed(lambda: [dst.copy_(src) for dst, src in zip(held.values(), sources)])
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
        report, seconds = _timed(lambda: bridge.push(mt.export_weights(), version=bridge.version + 1))
        exported = dict(mt.export_weights())
        out |= {"megatron_push_s": seconds, "megatron_push_bytes": report.bytes,
                "megatron_engine_holds_weights": all(torch.equal(held[n], exported[n]) for n in held if n in exported)}
    if not (same and refused and serving):
        raise RuntimeError(f"weight push check failed: engine holds the trainer's weights {same}, corrupted push "
                           f"refused {bool(refused)}, serving after the refusal {serving}")
    _log(f"weight push: {nbytes / 1e6:.0f} MB in {push_s * 1000:.1f} ms ({out['push_gb_s']:.1f} GB/s; a device copy "
         f"{out['memcpy_gb_s']:.0f} GB/s); a corrupted tensor refused at the commit: {out['corrupted_push_refused']}")
    return out


def _kernels_per_call(fn, calls: int) -> tuple[float, float]:
    """(device operations per call, their summed device time per call in ms), by torch's profiler
    (CUPTI): kernels, memcpys and memsets of `calls` calls."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    _sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        _sync()
    device_events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    us = sum(e.time_range.elapsed_us() for e in device_events)  # each device event's own duration
    return len(device_events) / calls, us / 1000 / calls


def _launch_us(device) -> float:
    """Host time per launched op: a 1-element add_ issued 2000 times, synchronised at the end."""
    import torch

    x = torch.zeros(1, device=device)
    for _ in range(50):
        x.add_(1.0)
    _, s = _timed(lambda: [x.add_(1.0) for _ in range(2000)])
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
        times = [_timed(chain)[1] for _ in range(5)]
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
            row["forward_ms"] = 1000 * statistics.median(_timed(forward)[1] for _ in range(10))
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
        _log(f"decode batch {B}: step {row['step_ms']:.2f} ms against a bound of {row['bound_ms']:.3f} ms "
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
    _sync()
    calibration_s = time.perf_counter() - t
    del policy
    policies = {mode: speculation_policy(engine, cfg, mode) for mode in SWEEP_MODES}
    _log(f"rollout: engine on {engine.device} ({engine.dtype}) built with aware's cost model in {calibration_s:.1f}s; "
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
        row = concurrency_sweep(engine, policies, prompts, cfg, (B,), size.sweep_tokens, size.reps, _log)[0]
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
    out["grpo_batch"] = grpo_batch(engine, policies, prompts, cfg, size.grpo_prompts, 8, max_new, size.reps, _log)
    out["grpo_batch_s"] = time.perf_counter() - t
    if out["levels_skipped_for_time"] or max_new < size.grpo_max_new:
        _log(f"rollout: to stay within the budget, skipped levels {out['levels_skipped_for_time']} and capped the "
             f"GRPO batch at {max_new} new tokens (planned {size.grpo_max_new})")
    return out


STAGE_FUNCTIONS = {"environment": environment, "sft": sft, "draft": draft, "train_step": train_step,
                   "weight_push": weight_push, "decode_bound": decode_bound, "rollout": rollout}


# -- the report ---------------------------------------------------------------------------------------
def _f(x: Any, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, (int, float)):
        return f"{x:.{digits}g}"
    return str(x)


def _summary(name: str, d: dict) -> str:
    if name == "environment":
        return (f"{d.get('device_name')}; torch {d.get('torch')} CUDA {d.get('cuda')}; transformers "
                f"{d.get('transformers')}; copy {_f(d.get('copy_bandwidth_gb_s'), 4)} GB/s, spec "
                f"{_f(d.get('peak_bandwidth_gb_s'), 4)} GB/s")
    if name == "sft":
        return (f"{_f(d['parameters'] / 1e6)}M parameters, {d['steps']} of {d['planned_steps']} steps of "
                f"{d['batch_size']} ({_f(d['steps_per_s'])} steps/s), loss {_f(d['train_loss'])}, greedy pass@1 "
                f"{_f(d.get('pass1_greedy'))}, mean accuracy {_f(d.get('mean_accuracy'))}")
    if name == "draft":
        return (f"{d['steps']:.0f} steps ({_f(d['steps_per_s'])}/s), held-out top-1 {_f(d['eval_top1'])}, "
                f"loss {_f(d['eval_loss'])}; online round on {d.get('online_device')}: {_f(d.get('online_steps'))} "
                f"steps in {_f(d.get('online_train_s'))} s, version {d.get('online_version')}")
    if name == "train_step":
        return (f"torch {_f(d['torch_step_s'])} s, megatron {_f(d['megatron_step_s'])} s "
                f"({d.get('megatron_backend')}, {d.get('layer_spec')} layers); loss diff {_f(d['loss_relative_diff'])}, grad norm diff "
                f"{_f(d['grad_norm_relative_diff'])} (relative), log-prob max diff {_f(d['logprob_max_abs_diff'])}"
                + (f"; against fp32 weights, mean log-prob diff torch {_f(d['torch_vs_fp32_logprob_mean_abs_diff'])}, "
                   f"megatron {_f(d['megatron_vs_fp32_logprob_mean_abs_diff'])}"
                   if "torch_vs_fp32_logprob_mean_abs_diff" in d else ""))
    if name == "weight_push":
        return (f"{d['bytes'] / 1e6:.0f} MB in {d['push_s'] * 1000:.1f} ms ({_f(d['push_gb_s'])} GB/s, "
                f"{_f(d['push_vs_memcpy'])}x a device copy); corrupted tensor refused: "
                f"{_f(d['corrupted_push_refused'])}")
    if name == "decode_bound":
        return "; ".join(f"batch {B}: step {_f(r['step_ms'])} ms, {_f(r['step_vs_bound'])}x the bound"
                         for B, r in d["batches"].items())
    if name == "rollout":
        g = d["grpo_batch"]
        skipped = d.get("levels_skipped_for_time")
        return (f"{len(d['levels'])} levels x {len(d['modes'])} modes"
                + (f" (levels {skipped} skipped for time)" if skipped else "")
                + f"; GRPO batch off {_f(g['off_s'])} s, aware {_f(g['aware_s'])} s ({_f(g['off_s'] / g['aware_s'])}x)")
    return ""


def markdown(result: dict) -> str:
    m, stages = result["meta"], result["stages"]
    env = (stages.get("environment") or {}).get("data") or {}
    failed = [n for n, s in stages.items() if s["status"] == "failed"]
    running = [n for n, s in stages.items() if s["status"] == "running"]
    budget = m.get("budget_s")
    lines = [f"# GPU check ({m['size']} size, {m['device']}, {m['dtype']})", "",
             f"Command: `{m['command']}`  ", f"Date {m['date']}; {env.get('device_name', '?')}; torch "
             f"{env.get('torch', '?')}; whole run {m.get('seconds', 0):.0f} s"
             + (f" of a {budget:.0f} s budget" if budget else "")
             + (f"; FAILED: {', '.join(failed)}" if failed else "")
             + (f"; cut short in: {', '.join(running)} (what it had finished is below)" if running else "")
             + ("" if failed or running else "; every stage ok") + ".", "",
             "| stage | status | seconds | planned s | peak GPU memory GB | result |",
             "| --- | --- | ---: | ---: | ---: | --- |"]
    for name, s in stages.items():
        if s["status"] == "running":
            text = "cut short; partial results below"
        elif s["status"] == "ok":
            try:
                text = _summary(name, s["data"])
            except Exception as e:  # a summary must not cost the report
                text = f"(summary failed: {type(e).__name__})"
        else:
            text = s["error"].splitlines()[0][:200].replace("|", "/")
        lines.append(f"| {name} | {s['status']} | {s['seconds']:.1f} | {_f(s.get('planned_s'))} | "
                     f"{_f(s.get('peak_memory_gb'))} | {text} |")
    r = (stages.get("rollout") or {}).get("data")
    if r:
        modes = r["modes"]
        lines += ["", f"Rollout at fixed concurrency ({r['tokens_per_sequence']} tokens per sequence, EOS ignored; "
                  f"median of {r['repetitions']} after a warm-up), tokens/s (aware's accepted length):", "",
                  "| running | " + " | ".join(modes) + " | best / off |", "| ---: |" + " ---: |" * (len(modes) + 1)]
        for row in r["sweep"]:
            cells = [f"{row[f'{mode}_tok_s']:.0f}" for mode in modes]
            cells[modes.index("aware")] += f" ({row['aware_accept_len']:.2f})"
            lines.append(f"| {row['concurrency']} | " + " | ".join(cells)
                         + f" | {row['best_vs_off']:.2f}x ({row['best']}) |")
        g = r.get("grpo_batch")
        if g:
            lines += ["", f"GRPO batch ({r['grpo_prompts']} prompts x 8 samples, up to {r['grpo_max_new']} new "
                      "tokens), seconds:", "", "| " + " | ".join(g["all_s"]) + " |", "|" + " ---: |" * len(g["all_s"]),
                      "| " + " | ".join(f"{s:.2f}" for s in g["all_s"].values()) + " |"]
    d = (stages.get("decode_bound") or {}).get("data")
    if d:
        lines += ["", f"Plain decode step against its memory-bandwidth bound ({d['bandwidth_gb_s']:.0f} GB/s, "
                  f"{d['bandwidth_source']}; weights {_f(d['weight_bytes'] / 1e6)} MB {d['dtype']}; CUDA graphs "
                  f"{d['graphs']}). Measured: step, forward, device ops and busy time (profiler), matmuls alone; "
                  f"estimated: bound, launch overhead (ops x {_f(d.get('launch_us'))} us measured per launch).", "",
                  "| batch | step ms | bound ms (est.) | step / bound | forward ms | step - forward ms | device ops "
                  "| device busy ms | launch overhead ms (est.) | matmuls alone ms (graph) | matmul GB/s |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for B, row in d["batches"].items():
            lines.append(f"| {B} | {_f(row['step_ms'])} | {_f(row['bound_ms'])} | {_f(row['step_vs_bound'])}x | "
                         f"{_f(row['forward_ms'])} | {_f(row.get('outside_forward_ms'))} | "
                         f"{_f(row.get('forward_device_ops'))} | "
                         f"{_f(row.get('forward_device_busy_ms'))} | {_f(row.get('launch_overhead_est_ms'))} | "
                         f"{_f(row.get('matmul_chain_graph_ms', row['matmul_chain_ms']))} | {_f(row['matmul_gb_s'])} |")
    sim = against_simulator(result)
    if sim:
        lines += ["", f"Against `bench simulate`'s profile of this GPU ({sim['profile']}, the roofline of "
                  "speculation/roofline.py priced for this policy's shape; estimates, set beside the measured):", "",
                  "| batch | measured step ms (eager) | simulated step ms | measured / simulated | measured matmuls in a "
                  "graph ms | simulated weight-bytes term ms | measured / simulated |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for B, row in sim["batches"].items():
            lines.append(f"| {B} | {_f(row['step_ms'])} | {_f(row['simulated_step_ms'])} | {_f(row['step_ratio'])}x | "
                         f"{_f(row['matmuls_graph_ms'])} | {_f(row['simulated_bytes_ms'])} | {_f(row['bytes_ratio'])}x |")
    t = (stages.get("train_step") or {}).get("data")
    if t:
        lines += ["", f"One GRPO step ({t['sequences']} sequences, {t['minibatches']} minibatches, {t['dtype']}), "
                  "the same batch and weights:", "",
                  "| trainer | first step s | warm step s | loss | grad norm |", "| --- | ---: | ---: | ---: | ---: |"]
        for name in ("torch", "megatron"):
            mm = t[f"{name}_metrics"]
            lines.append(f"| {name} | {_f(t[f'{name}_first_step_s'])} | {_f(t[f'{name}_step_s'])} | "
                         f"{_f(mm['loss'], 6)} | {_f(mm['grad_norm'], 6)} |")
    return "\n".join(lines) + "\n"


def against_simulator(result: dict) -> dict | None:
    """How far `bench simulate`'s roofline for this GPU (by its name) is from the decode step measured
    here, for the same policy shape, batch and context: the whole step (the simulator assumes a
    CUDA-graph engine: its fixed overheads stand for launch costs) and its weight-bytes term alone (the
    weights over `bw_eff` x spec bandwidth) against the forward's matmuls replayed as a CUDA graph. None
    without a measured decode step on a GPU."""
    from fastgrpo.speculation.roofline import ModelShape, Roofline, accelerator_named

    d = (result["stages"].get("decode_bound") or {}).get("data") or {}
    env = (result["stages"].get("environment") or {}).get("data") or {}
    if not d.get("model") or "cuda" not in str(env.get("device", "")):
        return None
    hw = accelerator_named(env.get("device_name", ""))
    m = d["model"]
    shape = ModelShape("policy", m["layers"], m["hidden"], m["intermediate"], m["heads"], m["kv_heads"], m["vocab"])
    roof = Roofline(hw, shape)
    out: dict[str, Any] = {"profile": f"{hw.name}, HBM efficiency {hw.bw_eff}", "batches": {}}
    for B, row in d["batches"].items():
        ctx_sum = int(B) * row["context"]
        simulated = roof.decode_step(int(B), int(row["context"]), ctx_sum)
        params = shape.layers * shape.layer_params + shape.lm_head_params  # the weights the matmuls read
        bytes_s = params * shape.bytes_per_param / (hw.hbm_bytes_s * hw.bw_eff)
        graph_ms = row.get("matmul_chain_graph_ms")
        out["batches"][B] = {"step_ms": row["step_ms"], "simulated_step_ms": 1000 * simulated,
                             "step_ratio": row["step_ms"] / (1000 * simulated), "matmuls_graph_ms": graph_ms,
                             "simulated_bytes_ms": 1000 * bytes_s,
                             "bytes_ratio": None if graph_ms is None else graph_ms / (1000 * bytes_s)}
    return out


# -- entry points --------------------------------------------------------------------------------------
def run(out: Path, size: str = "gpu", device: str = "auto", work: Path | None = None,
        stages: tuple[str, ...] = STAGES, overrides: list[str] | None = None, budget_s: float | None = None) -> int:
    """Every stage in order; 0 if all succeeded, else 1. The policy, draft and cost model go to `work`
    (default: a temporary directory, removed at the end). `budget_s`: the whole run's (default: the
    size's, 480 s at gpu size), which the last stage (rollout) fits itself into."""
    own_work = work is None
    work = Path(tempfile.mkdtemp(prefix="fastgrpo-gpu-check-")) if own_work else Path(work)
    try:
        check = Check(Path(out), work, size, device, list(overrides or []), budget_s)
        _log(f"size {size} on {check.compute.device} ({check.compute.dtype}); results in {out}/gpu_check.json and .md")
        for name in stages:
            check.stage(name, lambda name=name: STAGE_FUNCTIONS[name](check))
            if name == "weight_push":  # the trainers are done with: their memory goes back before rollout
                check.held.clear()
                _release()
        check.result["meta"]["imported_modules"] = sorted({n.split(".")[0] for n in list(sys.modules)})
        if sim := against_simulator(check.result):
            check.result["against_simulator"] = sim
        check.result["meta"]["within_budget"] = not check.budget_s or check.seconds() <= check.budget_s
        check.write()
        failed = [n for n, s in check.result["stages"].items() if s["status"] != "ok"]
        print("\n" + (Path(out) / "gpu_check.md").read_text(), flush=True)  # the tables in the log too
        _log(f"done in {check.seconds():.0f}s" + (f"; FAILED: {', '.join(failed)}" if failed else "; every stage ok")
             + f"; wrote {out}/gpu_check.json and {out}/gpu_check.md")
        if not check.result["meta"]["within_budget"]:
            _log(f"over the budget of {check.budget_s:.0f}s ({check.seconds():.0f}s)")
        return 1 if failed else 0
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():  # the Megatron trainer's world of one
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        if own_work:
            shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastgrpo.bench.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/gpu_check", help="directory of gpu_check.json and gpu_check.md")
    p.add_argument("--size", choices=sorted(SIZES), default="gpu", help="gpu (~308M policy, ~8 minutes on an H100) "
                   "or test (toy sizes, seconds, any device)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")  # config.DEVICES
    p.add_argument("--work", help="where the policy, draft and cost model go (default: a temporary directory, removed)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {', '.join(STAGES)}")
    p.add_argument("--budget-s", type=float, help="the whole run's seconds, which rollout (the last stage) fits "
                   "itself into (default: 480 at gpu size, none at test size; 0: none)")
    p.add_argument("--wheel-specs", action="store_true", help="print the wheels the GPU machine needs and exit")
    p.add_argument("--wheels-to-install", metavar="DIR", help="print the wheels in DIR this Python lacks or has "
                   "in an older version, and exit (tools/gpu_check.sh installs those)")
    p.add_argument("--report", metavar="JSON", help="rewrite the tables (gpu_check.md beside it) from a run's "
                   "gpu_check.json, and exit (no device needed)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. sft.max_minutes=1")
    args = p.parse_args(argv)
    if args.wheel_specs:
        print(" ".join(WHEELS))
        return 0
    if args.wheels_to_install:
        print("\n".join(str(w) for w in wheels_to_install(list(Path(args.wheels_to_install).glob("*.whl")))))
        return 0
    if args.report:
        path = Path(args.report)
        result = json.loads(path.read_text())
        if sim := against_simulator(result):
            result["against_simulator"] = sim
            path.write_text(json.dumps(_finite(result), indent=2))
        (path.parent / "gpu_check.md").write_text(markdown(result))
        print((path.parent / "gpu_check.md").read_text())
        return 0
    stages = tuple(s for s in args.stages.split(",") if s)
    if unknown := [s for s in stages if s not in STAGES]:
        p.error(f"unknown stages {unknown}; choose from {', '.join(STAGES)}")
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return run(Path(args.out), args.size, args.device, Path(args.work) if args.work else None, stages, args.overrides,
               args.budget_s)


if __name__ == "__main__":
    sys.exit(main())
