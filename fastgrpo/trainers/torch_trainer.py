"""The embedded policy trainer: a Hugging Face model trained with plain PyTorch on one process.

On its device (`fastgrpo.device`), in fp32, or in bf16 as megatron-core and DeepSpeed train: the
model's weights and activations in bf16, each micro-batch's bf16 gradients added into fp32 gradients
of fp32 master weights, which the optimizer clips and steps and the bf16 weights are copied from.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor
from transformers import PreTrainedModel

from fastgrpo.config import GRPOConfig, OptimConfig
from fastgrpo.device import Compute
from fastgrpo.models.sampling import sampling_logprobs
from fastgrpo.paths import checkpoint_policy
from fastgrpo.types import Placement, RolloutBatch, SamplingParams
from fastgrpo.grpo.step import STATS, LossFn, grpo_step, minibatch_loss


def token_logprobs(model: PreTrainedModel, batch: RolloutBatch, sampling: SamplingParams) -> tuple[Tensor, Tensor]:
    """Position-aligned log-probabilities of each token under the engine's sampling distribution
    (temperature, top-k, top-p: the one definition in `sampling_logprobs`, in the sets the engine
    sampled from when the batch carries them) and that distribution's entropy, [N, L]."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    tokens = batch.input_ids[:, 1:]
    sets = None if batch.sample_sets is None else batch.sample_sets[:, 1:]
    logp_all = sampling_logprobs(logits, sampling, sampled=tokens, sets=sets)
    logp = logp_all.gather(-1, tokens[..., None])[..., 0]
    entropy = -(logp_all.exp() * logp_all.masked_fill(torch.isinf(logp_all), 0.0)).sum(-1)
    pad = torch.zeros_like(logp[:, :1])
    return torch.cat([pad, logp], 1), torch.cat([pad, entropy], 1)


class TorchPolicyTrainer:
    def __init__(self, model: PreTrainedModel, grpo: GRPOConfig, optim: OptimConfig, sampling: SamplingParams,
                 reference: PreTrainedModel | None = None, compute: Compute | None = None):
        compute = compute or Compute(torch.device("cpu"), torch.float32)
        self.device, self.dtype = compute.device, compute.dtype
        self.model = model.to(self.device, self.dtype)
        if reference is not None:
            reference = reference.to(self.device, self.dtype)
        self.cfg = grpo
        self.grad_clip = optim.grad_clip
        self.sampling = sampling  # trainer and engine score the same distribution
        self.reference = reference
        if grpo.kl_coef > 0 and reference is None:
            raise ValueError("grpo.kl_coef > 0 needs a reference policy")
        trainable = [p for name, p in model.named_parameters() if re.search(optim.trainable, name)]
        if not trainable:
            raise ValueError(f"optim.trainable={optim.trainable!r} matches no parameter of the policy")
        for name, p in model.named_parameters():
            p.requires_grad_(bool(re.search(optim.trainable, name)))
        self.trainable = trainable
        # what the optimizer steps: the weights themselves in fp32; fp32 master copies of them in bf16
        self.master = trainable if self.dtype == torch.float32 else [
            p.detach().float().clone().requires_grad_(True) for p in trainable]
        self.optimizer = torch.optim.AdamW(self.master, lr=optim.lr, betas=tuple(optim.betas),
                                           weight_decay=optim.weight_decay)
        warmup = optim.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup > 0 else 1.0)

    def _micro_batches(self, batch: RolloutBatch, rows: list[int]) -> Iterator[tuple[list[int], RolloutBatch]]:
        m = self.cfg.micro_batch_size
        for i in range(0, len(rows), m):
            chunk = rows[i : i + m]
            yield chunk, batch.select(chunk).to(self.device)

    @torch.no_grad()
    def logprobs(self, batch: RolloutBatch, model: PreTrainedModel | None = None) -> Tensor:
        model = model or self.model
        out = torch.zeros(batch.input_ids.shape, device=self.device)
        for rows, mb in self._micro_batches(batch, list(range(batch.size))):
            lp, _ = token_logprobs(model, mb, self.sampling)
            if rows:
                out[rows, : lp.shape[1]] = lp
        return out

    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        """All optimiser steps for one rollout batch: the GRPO step (`grpo.step.grpo_step`)."""
        return grpo_step(self, batch, self.cfg)

    # -- what the GRPO step asks of a backend (`grpo.step.StepBackend`) -------------------------------
    def reference_logprobs(self, batch: RolloutBatch) -> Tensor:
        if self.reference is None:
            raise ValueError("grpo.kl_coef > 0 needs a reference policy")
        return self.logprobs(batch, self.reference)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)

    def accumulate(self, batch: RolloutBatch, rows: list[int], loss_of: LossFn) -> None:
        for micro_rows, micro in self._micro_batches(batch, rows):
            logp, entropy = token_logprobs(self.model, micro, self.sampling)
            self._backprop(loss_of(micro_rows, micro, logp, entropy))

    def _backprop(self, loss: Tensor) -> None:
        loss.backward()
        if self.master is not self.trainable:  # bf16: the gradient accumulates in fp32
            for p, m in zip(self.trainable, self.master):
                if p.grad is not None:
                    m.grad = p.grad.float() if m.grad is None else m.grad.add_(p.grad)
                    p.grad = None

    def update(self, loss_finite: bool) -> float | None:
        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        # the norm is needed on the host for the skip decision (on purpose: one sync per minibatch)
        norm = float(torch.nn.utils.clip_grad_norm_(self.master, max_norm))
        applied = loss_finite and math.isfinite(norm)
        if applied:  # a NaN/inf update would corrupt the policy: skipped, the weights kept
            self.optimizer.step()
            self.scheduler.step()
            if self.master is not self.trainable:
                with torch.no_grad():
                    for p, m in zip(self.trainable, self.master):
                        p.copy_(m)
        self.zero_grad()
        return norm if applied else None

    def all_sum(self, t: Tensor) -> Tensor:
        return t

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def loss_gradient(self, batch: RolloutBatch) -> Tensor:
        """The gradient of the GRPO loss on the whole batch at the current weights (on-policy: ratio 1),
        flattened, without an update: what `bench noise` compares across independent batches."""
        self.model.zero_grad(set_to_none=True)
        ref = self.reference_logprobs(batch) if self.cfg.kl_coef > 0 else None
        rows = list(range(batch.size))
        self.accumulate(batch, rows, minibatch_loss(self.cfg, batch, rows, None, ref,
                                                    torch.zeros(len(STATS), dtype=torch.float64, device=self.device)))
        grads = {id(p): m.grad for p, m in zip(self.trainable, self.master)}
        grad = torch.cat([grads[id(p)].reshape(-1).float() if grads.get(id(p)) is not None
                          else torch.zeros(p.numel(), device=self.device) for p in self.model.parameters()])
        self.zero_grad()
        return grad

    def placement(self) -> Placement:
        return Placement()  # one process: the only replica

    def export_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Hugging Face names and full tensors: the weight bridge's source."""
        for name, t in self.model.state_dict().items():
            yield name, t.detach()

    def save(self, directory: Path) -> None:
        self.model.save_pretrained(checkpoint_policy(directory))
        extra = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        if self.master is not self.trainable:  # bf16: the policy/ weights are rounded; resume needs these
            extra["master"] = [m.detach() for m in self.master]
        torch.save(extra, directory / "trainer.pt")

    def load(self, directory: Path) -> None:
        state = load_file(str(checkpoint_policy(directory) / "model.safetensors"))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not (k == "lm_head.weight" and self.model.config.tie_word_embeddings)]
        if missing or unexpected:
            raise ValueError(f"checkpoint {directory} does not match the policy: missing {missing}, unexpected {unexpected}")
        extra = torch.load(directory / "trainer.pt", weights_only=False, map_location=self.device)
        if self.master is not self.trainable:
            with torch.no_grad():
                for p, m, saved in zip(self.trainable, self.master,
                                       extra.get("master") or [p.detach().float() for p in self.trainable]):
                    m.copy_(saved)
                    p.copy_(m)
        self.optimizer.load_state_dict(extra["optimizer"])
        self.scheduler.load_state_dict(extra["scheduler"])
