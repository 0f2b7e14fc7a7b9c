"""The tiny-policy recipe: a policy warm-started on the task's worked solutions (a new Llama policy with a
tokenizer trained on the task, or, with `sft.init`, a checkpoint of any served family with its own tokens).

RL needs a policy that already answers in the right format and is sometimes right; supervised
training on worked solutions gets it there in minutes on a CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
import shutil
import time
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

from fastgrpo.config import Config
from fastgrpo.device import resolve, thread_count
from fastgrpo.engines import build_engine
from fastgrpo.types import SamplingParams
from fastgrpo.grpo.evaluate import evaluate
from fastgrpo.models.policy import load_policy, new_policy, num_parameters, policy_config
from fastgrpo.models.tokenizer import TextFormat, load_text_format, train_tokenizer
from fastgrpo.paths import is_policy
from fastgrpo.tasks.rewards import load_reward
from fastgrpo.tasks.source import encode_problems, load_task

EVAL_BATCH = 64  # sequences the evaluation engine decodes together


def _batches(examples: list[tuple[list[int], list[int]]], batch_size: int, rng: random.Random):
    """Endless batches of similar length (less padding on a long-tailed length distribution)."""
    pool = batch_size * 16
    while True:
        order = list(range(len(examples)))
        rng.shuffle(order)
        for i in range(0, len(order), pool):
            chunk = sorted(order[i : i + pool], key=lambda j: sum(map(len, examples[j])))
            groups = [chunk[k : k + batch_size] for k in range(0, len(chunk), batch_size)]
            rng.shuffle(groups)
            yield from ([examples[j] for j in g] for g in groups)


def _collate(batch: list[tuple[list[int], list[int]]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(p) + len(r) for p, r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long, device="cpu")  # on the host; the loop moves it
    labels = torch.full((len(batch), width), -100, dtype=torch.long, device="cpu")
    attn = torch.zeros((len(batch), width), dtype=torch.long, device="cpu")
    for i, (p, r) in enumerate(batch):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r, device="cpu")
        labels[i, len(p) : len(p) + len(r)] = torch.tensor(r, device="cpu")  # loss on the answer only
        attn[i, : len(p) + len(r)] = 1
    return ids, labels, attn


def _ema(average: float, losses: list[torch.Tensor]) -> float:
    """The running loss with `losses` (each step's, in order) folded in, emptying the list: read from
    the device only where it is shown, so a GPU's steps are not each made to wait for the host."""
    for loss in losses:
        average = loss.item() if math.isnan(average) else 0.95 * average + 0.05 * loss.item()
    losses.clear()
    return average


def build_policy(cfg: Config, out_dir: str | Path | None = None) -> dict[str, float]:
    """Train the policy on the task's worked solutions and save it with its tokenizer in HF format:
    a new `model.size` Llama policy with a tokenizer trained on the task, or, with `sft.init`, that
    checkpoint (any family the engine serves) with its own tokenizer, chat template and stop ids.

    On the configured device (`fastgrpo.device.resolve`): fp32 weights and optimizer, and with bf16
    (`trainer.precision`) the forward and backward under bf16 autocast; the saved policy is fp32."""
    with thread_count(cfg.threads):
        return _build_policy(cfg, Path(out_dir or cfg.model.path))


def _build_policy(cfg: Config, out: Path) -> dict[str, float]:
    if cfg.sft.init and not is_policy(Path(cfg.sft.init)):
        raise FileNotFoundError(f"sft.init: no Hugging Face checkpoint at {cfg.sft.init} (config.json missing)")
    compute = resolve(cfg)
    train, evals = load_task(cfg.task, cfg.eval.split)
    if any(p.solution is None for p in train):
        raise ValueError(f"task.source {cfg.task.source!r} has no worked solutions; SFT needs the synthetic task")
    if cfg.sft.init:  # a checkpoint's own tokens: its chat template renders the prompts, its stop ids end answers
        text = load_text_format(cfg.sft.init, cfg.task)
        tokenizer = text.tokenizer
        model = load_policy(cfg.sft.init).to(compute.device)
        config = model.config
        source = f"{config.model_type} policy from {cfg.sft.init}"
    else:
        tokenizer = train_tokenizer(p.prompt + "\n" + p.solution for p in train)  # type: ignore[operator]
        text = TextFormat.of(tokenizer, None, cfg.task.prompt_format, cfg.task.system_prompt)  # plain: no template
        config = policy_config(cfg.model.size, len(tokenizer), cfg.model.max_context,
                               tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
        model = new_policy(config, cfg.seed).to(compute.device)  # on a CPU: the model itself, unchanged
        source = f"{cfg.model.size} policy"
    short = [p for p in train if p.solution.count("\n") <= cfg.sft.max_problem_steps]  # type: ignore[union-attr]
    examples = [(text.prompt_ids(p.prompt), text.response_ids(p.solution)) for p in short]  # type: ignore[arg-type]
    examples = [e for e in examples if len(e[0]) + len(e[1]) <= cfg.model.max_context]
    if not examples:
        raise ValueError(f"no training example fits in model.max_context={cfg.model.max_context}")
    s = cfg.sft
    steps = max(1, s.examples // s.batch_size)
    print(f"SFT: {source}, {num_parameters(model) / 1e6:.1f}M parameters, vocab {len(tokenizer)}, "
          f"{steps} steps of {s.batch_size}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.01, betas=(0.9, 0.95),
                            **({"fused": True} if compute.device.type == "cuda" else {}))
    autocast = (torch.autocast(compute.device.type, dtype=torch.bfloat16) if compute.bf16
                else contextlib.nullcontext())
    batches = _batches(examples, s.batch_size, random.Random(cfg.seed))
    t0 = time.perf_counter()
    model.train()
    bar = tqdm(range(steps), desc="sft", mininterval=2.0)
    loss_avg = float("nan")
    losses: list[torch.Tensor] = []
    done = 0
    for step in bar:
        # a fixed number of steps, so the policy is the same at the same thread count (a CPU matmul's
        # reduction order can follow it: `threads` in the report); the clock is only a guard
        if s.max_minutes and time.perf_counter() - t0 > 60 * s.max_minutes:
            warnings.warn(f"SFT stopped by the sft.max_minutes guard after {step} of {steps} steps: this policy "
                          f"is NOT the reference one for this config (results will differ from a full run)")
            break
        warm = min(1.0, (step + 1) / max(s.warmup_steps, 1))
        for group in opt.param_groups:
            group["lr"] = s.lr * warm * 0.5 * (1 + math.cos(math.pi * step / steps))
        # non-blocking: a blocking copy would wait for the previous step's queued kernels
        batch = _collate(next(batches))  # padding is masked out: any id serves
        ids, labels, attn = (t.to(compute.device, non_blocking=True) for t in batch)
        with autocast:
            loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.detach())
        if step % s.log_every == 0:
            loss_avg = _ema(loss_avg, losses)
            bar.set_postfix(loss=f"{loss_avg:.3f}")
        done = step + 1
    bar.close()
    loss_avg = _ema(loss_avg, losses)
    model.eval()
    minutes = (time.perf_counter() - t0) / 60

    # the policy is not saved yet: an embedded engine (which takes it from memory) on this process's device,
    # batches of EVAL_BATCH, whatever the run's engine.backend and rollout.max_batch
    engine = build_engine(dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, backend="embedded"),
                                              rollout=dataclasses.replace(cfg.rollout, max_batch=EVAL_BATCH)),
                          config, text, model.state_dict().items(), speculation="off")
    accuracy = evaluate(engine, text, encode_problems(evals, text, cfg.model.max_context, "eval"),
                        cfg.eval.samples, SamplingParams.of(cfg.rollout), load_reward(cfg.task), seed=cfg.seed)
    report = {"train_loss": loss_avg, "minutes": minutes, "parameters": num_parameters(model), "steps": done,
              "complete": float(done == steps), "threads": torch.get_num_threads()} | accuracy
    print("SFT done: " + ", ".join(f"{k} {v:.4g}" for k, v in report.items()), flush=True)

    tmp = out.with_name(out.name + ".tmp")  # write whole, then rename: never a half-written policy
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "sft_report.json").write_text(json.dumps(report, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"saved policy to {out}", flush=True)
    return report
