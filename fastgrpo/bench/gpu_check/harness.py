"""The gpu check's harness: the sizes, the run (`Check`: its config, what stages hand on, each stage timed
and recorded ok or failed, the results on disk after every stage) and the timing helpers the stages share."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import math
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from fastgrpo.bench.gpu_check.report import dumps, finite, markdown

# spec-sheet HBM bandwidth, bytes/s, by device name (first match; "H100" alone: the SXM part)
PEAK_BANDWIDTH = (("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12))
STAGES = ("environment", "sft", "draft", "train_step", "weight_push", "decode_bound", "step_bench", "simulator_fit",
          "decode_8b", "rollout")
# Seconds each stage is planned to take at gpu size on an H100 or H200, within one 600-second command of
# tools/gpu_check.sh: the run's own budget (Size.budget_s, 540 s) leaves ~60 s for installing the wheels,
# starting Python and writing the report. sft and draft are held to theirs by sft.max_minutes and
# draft.pretrain_minutes (their evaluation and saving come on top); step_bench skips a level that would
# overrun its plan by a quarter; rollout, the last, fits itself into what is left of the run's budget. A
# stage whose work can be cut (step_bench's levels and fused compile, decode_8b's batches) also stops
# where going on would take the stages after it below their plans (`Check.stage_left`), so one stage's
# overrun (a slow compile, say) is paid by itself, not by the rollout sweep that comes last. The report
# sets each stage's time beside its plan.
PLANNED_S = {"environment": 10, "sft": 100, "draft": 50, "train_step": 30, "weight_push": 5, "decode_bound": 25,
             "step_bench": 90, "simulator_fit": 2, "decode_8b": 60, "rollout": 150}


@dataclasses.dataclass(frozen=True)
class Size:
    overrides: tuple[str, ...]  # on top of the schema's defaults
    levels: tuple[int, ...]  # running sequences of the rollout sweep
    sweep_tokens: int  # tokens per sequence at fixed concurrency
    reps: int  # timed repetitions after a warm-up (rollout: each mode, in an order rotated per repetition)
    grpo_prompts: int  # the GRPO batch: prompts x 8 samples
    grpo_max_new: int
    decode_tokens: int  # decode_bound: tokens per timed generate call
    train_sequences: int  # train_step's batch
    push_reps: int
    step_levels: tuple[int, ...] = (1, 4, 16, 64, 256)  # step_bench: running rows
    step_tokens: int = 24  # step_bench: tokens per sequence of each timed call (~5 steps of a tree)
    step_reps: int = 3  # step_bench: calls per (level, shape, engine), in rotated order
    big_batches: tuple[int, ...] = (1, 16, 64)  # decode_8b: batches
    big_tokens: int = 64  # decode_8b: tokens per generate call
    big_full: bool = True  # decode_8b: the real 8B shape (False: a scaled-down one of the same structure)
    budget_s: float = 0.0  # the whole run's; the rollout stage (the last) fits itself into what is left; 0: none
    # rollout: repetitions more, at most, while aware against the best fixed choice is within noise (targets.py),
    # each workload spending on them no more than EXTRA_SHARE of the stage's time left when it started
    extra_reps: int = 6


SIZES = {
    "gpu": Size(
        overrides=("model.size=gpu", "model.max_context=512", "task.train_size=20000", "task.eval_size=32",
                   "rollout.max_batch=256", "rollout.max_new_tokens=256",
                   # 450 steps of 64 (~63 s at the 7.1 steps/s measured on an H100); the guard ends it at 66 s
                   # if this GPU is slower. The policy matters here for the draft's acceptance, not accuracy
                   "sft.examples=28800", "sft.batch_size=64", "sft.lr=6e-4", "sft.warmup_steps=50",
                   "sft.max_minutes=1.1", "draft.pretrain_steps=1500", "draft.batch_size=32",
                   "draft.pretrain_minutes=0.6", "eval.samples=2", "grpo.minibatches=2",
                   "grpo.micro_batch_size=16"),
        levels=(1, 4, 16, 64, 256), sweep_tokens=64, reps=3, grpo_prompts=8, grpo_max_new=256, decode_tokens=64,
        train_sequences=32, push_reps=3, budget_s=540.0),
    "test": Size(
        overrides=("model.size=test", "model.max_context=160", "task.train_size=400", "task.eval_size=8",
                   "task.max_steps=6", "rollout.max_batch=16", "rollout.max_new_tokens=48", "sft.examples=1600",
                   "sft.batch_size=32", "sft.lr=3e-3", "sft.warmup_steps=5", "draft.pretrain_steps=40",
                   "draft.lr=3e-3", "draft.buffer_tokens=20000", "eval.samples=2", "grpo.minibatches=2",
                   "grpo.micro_batch_size=8", "optim.lr=1e-3"),
        levels=(1, 4), sweep_tokens=8, reps=3, grpo_prompts=2, grpo_max_new=12, decode_tokens=8,
        train_sequences=8, push_reps=2, step_levels=(1, 4), step_tokens=8, step_reps=3, big_tokens=6,
        big_full=False, extra_reps=2),
}


def spread(values: list[float]) -> dict[str, float]:
    """n, median, mean and the standard error of the mean (sample standard deviation / sqrt(n); 0 for one
    value) of repeated measurements: the median is what the tables compare (one slow repetition moves it
    least), the standard error how far the repetitions disagree (a ratio between two modes inside a few of
    them is noise, as the A/A pair shows)."""
    n = len(values)
    if not n:
        return {"n": 0, "median": math.nan, "mean": math.nan, "se": math.nan}
    mean = sum(values) / n
    se = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n) if n > 1 else 0.0
    return {"n": n, "median": statistics.median(values), "mean": mean, "se": se}


def log(msg: str) -> None:
    print(f"[gpu-check] {msg}", flush=True)


def sync() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(fn) -> tuple[Any, float]:
    sync()
    t = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t


def release() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class Check:
    """The run: its config, what stages hand on to later ones, the results on disk after each stage."""

    def __init__(self, out: Path, work: Path, size: str, device: str, overrides: list[str],
                 budget_s: float | None = None, stages: tuple[str, ...] = STAGES):
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
        self.stages = tuple(stages)  # the ones this run runs, in order
        self.current: str | None = None  # the stage running
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

    def stage_left(self) -> float:
        """Seconds the running stage may still take with every stage after it in this run left its plan
        (PLANNED_S): `left()` less their plans; infinite without a budget. A stage that can cut its work
        stops where this runs out, so an overrun is paid by the stage that overran."""
        later = self.stages[self.stages.index(self.current) + 1:] if self.current in self.stages else ()
        return self.left() - sum(PLANNED_S[s] for s in later)

    def partial(self, name: str, data: dict) -> None:
        """What a long stage has so far, on disk: a run cut short keeps it."""
        self.result["stages"][name] = {"status": "running", "data": data, "seconds": 0.0}
        self.write()

    def stage(self, name: str, fn) -> bool:
        import torch

        log(f"{self.seconds():6.1f}s  {name}: starting")
        self.current = name
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
            sync()
        record["seconds"] = time.perf_counter() - t
        if self.size_name == "gpu":
            record["planned_s"] = PLANNED_S[name]
        if cuda:
            with contextlib.suppress(Exception):
                record["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
        self.result["stages"][name] = record
        with contextlib.suppress(Exception):  # a broken device must not cost the report
            release()
        log(f"{self.seconds():6.1f}s  {name}: {record['status']} in {record['seconds']:.1f}s"
             + (f" ({record['error'].splitlines()[0][:300]})" if record["status"] != "ok" else ""))
        self.write()
        return record["status"] == "ok"

    def write(self) -> None:
        self.result["meta"]["seconds"] = self.seconds()
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_check.json").write_text(dumps(finite(self.result)))
        try:
            text = markdown(finite(self.result))
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
        _, s = timed(lambda: dst.copy_(src))
        times.append(s)
    return 2 * n * 4 / statistics.median(times[1:]) / 1e9

