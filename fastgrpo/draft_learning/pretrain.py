"""Offline warm start of the draft on the target's hidden states over a text corpus of the task's
domain (the SFT corpus), the way static speculative systems get their drafts.

On the configured device (`fastgrpo.device.resolve`): the target computes its states there in the run's
dtype (bf16 on a GPU: the states a bf16 engine hands its draft), and the draft trains there in fp32, as
the online learner trains it."""

from __future__ import annotations

import time
import warnings

import torch
from tqdm import tqdm

from fastgrpo.config import Config
from fastgrpo.device import on_device, resolve, thread_count
from fastgrpo.draft_learning.trainer import DraftTrainer
from fastgrpo.models.families import check_checkpoint
from fastgrpo.models.policy import load_policy
from fastgrpo.models.tokenizer import load_text_format
from fastgrpo.models.draft import DraftHead, draft_loss
from fastgrpo.paths import draft_dir
from fastgrpo.tasks.source import load_task


def target_states(policy, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's final (post-norm) hidden states over right-padded sequences: [B, T, H], tokens, mask
    (on the policy's device)."""
    width = max(map(len, sequences))
    ids = torch.zeros(len(sequences), width, dtype=torch.long, device="cpu")  # assembled on the host, then moved
    mask = torch.zeros(len(sequences), width, dtype=torch.bool, device="cpu")
    for i, s in enumerate(sequences):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s, device="cpu"), True
    device = policy.model.embed_tokens.weight.device
    ids, mask = ids.to(device), mask.to(device)  # on a CPU: the same tensors
    with torch.no_grad():
        hidden = policy.model(input_ids=ids, attention_mask=mask.long()).last_hidden_state.float()
    return hidden, ids, mask


def fill_buffer(trainer: DraftTrainer, policy, corpus: list[list[int]], max_tokens: int, batch: int = 32) -> None:
    """Target states over the corpus, computed once (in length-sorted batches, so little is padding)
    and kept in the trainer's buffer: one target forward per sequence instead of one per draft step."""
    chosen, total = [], 0
    for seq in corpus:
        if total + len(seq) > max_tokens:
            break
        chosen.append(seq)
        total += len(seq)
    chosen.sort(key=len)
    for i in tqdm(range(0, len(chosen), batch), desc="target states", mininterval=2.0):
        hidden, tokens, mask = target_states(policy, chosen[i: i + batch])
        for h, t, m in zip(hidden, tokens, mask):
            n = int(m.sum())
            trainer.add(h[:n].clone(), t[:n], m[:n])


def pretrain_draft(cfg: Config) -> dict[str, float]:
    """The draft head of `draft.path`, pretrained on the policy's own hidden states over the task's
    answers, at the config's thread count (restored after)."""
    with thread_count(cfg.threads):
        return _pretrain_draft(cfg)


def _pretrain_draft(cfg: Config) -> dict[str, float]:
    compute = resolve(cfg)
    check_checkpoint(cfg.model.path)  # a family fastgrpo computes, before any work
    policy, fmt = load_policy(cfg.model.path), load_text_format(cfg.model.path, cfg.task)
    policy.requires_grad_(False)
    policy.to(compute.device, compute.dtype)  # fp32 on a CPU: unchanged
    train, evals = load_task(cfg.task)

    def text(p) -> list[int]:
        response = p.solution if p.solution is not None else p.answer
        return (fmt.prompt_ids(p.prompt) + fmt.response_ids(response))[: cfg.model.max_context]

    corpus, held_out = [text(p) for p in train], [text(p) for p in evals]
    draft = DraftHead(policy.config, cfg.model.max_context).to(compute.device)  # initialised on the CPU, then moved
    draft.bind_target(policy.get_input_embeddings().weight, policy.get_output_embeddings().weight)
    d = cfg.draft
    trainer = DraftTrainer(draft, lr=d.lr, max_tokens=d.buffer_tokens, batch_size=d.batch_size, seed=cfg.seed,
                           unroll=d.unroll)
    # the trainer's batches and the draft's positions are made where the states are (a CPU needs no context)
    with on_device(compute.device):
        report = _train(cfg, policy, draft, trainer, corpus, held_out)
    out = draft_dir(cfg)
    draft.to("cpu").save(out, extra={"pretrain": report})
    print("draft-pretrain done: " + ", ".join(f"{k} {v:.4g}" for k, v in report.items()) + f"; saved to {out}", flush=True)
    return report


def _train(cfg: Config, policy, draft: DraftHead, trainer: DraftTrainer, corpus: list[list[int]],
           held_out: list[list[int]]) -> dict[str, float]:
    d = cfg.draft
    t0 = time.perf_counter()
    fill_buffer(trainer, policy, corpus, d.buffer_tokens)
    print(f"draft-pretrain: {trainer.buffered_tokens} target states from {len(trainer.buffer)} sequences "
          f"in {time.perf_counter() - t0:.0f}s", flush=True)
    bar = tqdm(range(d.pretrain_steps), desc="draft-pretrain", mininterval=2.0)
    metrics: dict[str, float] = {}
    for _ in bar:
        # a fixed number of steps, so the draft is the same on any machine; the clock is only a guard
        if d.pretrain_minutes and time.perf_counter() - t0 > 60 * d.pretrain_minutes:
            warnings.warn(f"draft-pretrain stopped by the draft.pretrain_minutes guard after {trainer.steps} of "
                          f"{d.pretrain_steps} steps: this draft is NOT the reference one for this config")
            break
        metrics = trainer.train(max_steps=1)
        if trainer.steps % 20 == 0:
            bar.set_postfix(loss=f"{metrics['draft_loss']:.3f}", top1=f"{metrics['draft_top1']:.3f}")
    bar.close()
    draft.eval()
    with torch.no_grad():
        states = target_states(policy, held_out[:64])
        _, held = draft_loss(draft, *states)
        deep = draft_loss(draft, *states, unroll=4)[1]["draft_top1_4"]  # fed its own predictions, as at depth 4
    return {"steps": float(trainer.steps), "complete": float(trainer.steps == d.pretrain_steps),
            "minutes": (time.perf_counter() - t0) / 60, "eval_top1": held["draft_top1"], "eval_loss": held["draft_loss"],
            "eval_top1_depth4": deep}
