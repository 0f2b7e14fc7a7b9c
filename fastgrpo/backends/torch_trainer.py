"""The embedded policy trainer: a Hugging Face model trained with plain PyTorch on one process."""

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
from fastgrpo.engine.sampling import sampling_logprobs
from fastgrpo.types import Placement, RolloutBatch, SamplingParams
from fastgrpo.grpo.loss import policy_loss


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
                 reference: PreTrainedModel | None = None):
        self.model = model
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
        self.optimizer = torch.optim.AdamW(trainable, lr=optim.lr, betas=tuple(optim.betas),
                                           weight_decay=optim.weight_decay)
        warmup = optim.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup > 0 else 1.0)

    def _micro_batches(self, batch: RolloutBatch, rows: list[int]) -> Iterator[tuple[list[int], RolloutBatch]]:
        m = self.cfg.micro_batch_size
        for i in range(0, len(rows), m):
            chunk = rows[i : i + m]
            yield chunk, batch.select(chunk)

    @torch.no_grad()
    def logprobs(self, batch: RolloutBatch, model: PreTrainedModel | None = None) -> Tensor:
        model = model or self.model
        out = torch.zeros(batch.input_ids.shape)
        for rows, mb in self._micro_batches(batch, list(range(batch.size))):
            lp, _ = token_logprobs(model, mb, self.sampling)
            if rows:
                out[rows, : lp.shape[1]] = lp
        return out

    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        """All optimiser steps for one rollout batch: `epochs` passes of `minibatches` steps each."""
        c = self.cfg
        self.model.train()
        multi_update = c.epochs * c.minibatches > 1
        old = self.logprobs(batch) if multi_update else None  # else old = current, from the same forward
        ref = self.logprobs(batch, self.reference) if c.kl_coef > 0 else None
        rows = list(range(batch.size))
        per_mb = math.ceil(batch.size / c.minibatches)
        totals = dict(loss=0.0, clip=0.0, kl_ref=0.0, kl_engine=0.0, entropy=0.0, tokens=0.0, grad_norm=0.0)
        updates = skipped = 0
        for _ in range(c.epochs):
            for start in range(0, batch.size, per_mb):
                mb_rows = rows[start : start + per_mb]
                self.optimizer.zero_grad(set_to_none=True)
                mb_loss = self._backward(batch, mb_rows, old, ref, totals)
                max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
                grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
                if math.isfinite(mb_loss) and math.isfinite(grad_norm):
                    self.optimizer.step()
                    self.scheduler.step()
                    updates += 1
                    totals["loss"] += mb_loss
                    totals["grad_norm"] += grad_norm
                else:  # a NaN/inf update would corrupt the policy: skip it, keep the weights
                    skipped += 1
                self.optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        return self._report(totals, updates, skipped)

    def _report(self, totals: dict[str, float], updates: int, skipped: int) -> dict[str, float]:
        tokens = max(totals["tokens"], 1.0)
        return {
            "loss": totals["loss"] / max(updates, 1),
            "grad_norm": totals["grad_norm"] / max(updates, 1),
            "clip_fraction": totals["clip"] / tokens,
            "entropy": totals["entropy"] / tokens,
            "kl_ref": totals["kl_ref"] / tokens,
            "kl_engine_trainer": totals["kl_engine"] / tokens,
            "updates": float(updates),
            "skipped_updates": float(skipped),
            "lr": self.scheduler.get_last_lr()[0],
        }

    def _backward(self, batch: RolloutBatch, rows: list[int], old: Tensor | None, ref: Tensor | None,
                  totals: dict[str, float]) -> float:
        """Accumulate the gradient of the minibatch `rows`' loss (normalised over the whole minibatch,
        micro-batch by micro-batch); returns the loss and adds the step's statistics to `totals`."""
        c = self.cfg
        mask = batch.response_mask[rows]
        normaliser = float(mask.sum()) if c.loss_aggregation == "token_mean" else float(len(rows))
        loss = 0.0
        for micro_rows, micro in self._micro_batches(batch, rows):
            logp, entropy = token_logprobs(self.model, micro, self.sampling)
            width = logp.shape[1]
            # (a micro-batch without rows pads a data-parallel rank's share: it trains nothing)
            old_logp = old[micro_rows, :width] if old is not None and micro_rows else logp.detach()
            tis = None
            if c.tis_cap > 0:
                tis = torch.exp(old_logp - micro.engine_logprobs).clamp(max=c.tis_cap)
            terms = policy_loss(
                logp, old_logp, micro.advantages, micro.response_mask,
                eps_low=c.eps_low, eps_high=c.eps_high, aggregation=c.loss_aggregation,
                normaliser=max(normaliser, 1.0), tis_weight=tis,
                ref_logp=None if ref is None else ref[micro_rows, :width] if micro_rows else logp.detach(),
                kl_coef=c.kl_coef,
            )
            self._backprop(terms.loss)
            m = micro.response_mask.float()
            loss += terms.loss.item()
            totals["clip"] += terms.clipped_tokens.item()
            totals["kl_ref"] += terms.kl_ref_sum.item()
            totals["entropy"] += (entropy.detach() * m).sum().item()
            totals["kl_engine"] += ((micro.engine_logprobs - logp.detach()) * m).sum().item()
            totals["tokens"] += m.sum().item()
        return loss

    def _backprop(self, loss: Tensor) -> None:
        loss.backward()

    def loss_gradient(self, batch: RolloutBatch) -> Tensor:
        """The gradient of the GRPO loss on the whole batch at the current weights (on-policy: ratio 1),
        flattened, without an update: what `bench noise` compares across independent batches."""
        self.model.zero_grad(set_to_none=True)
        ref = self.logprobs(batch, self.reference) if self.cfg.kl_coef > 0 else None
        self._backward(batch, list(range(batch.size)), None, ref, dict.fromkeys(
            ("clip", "kl_ref", "entropy", "kl_engine", "tokens"), 0.0))
        grad = torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel())
                          for p in self.model.parameters()])
        self.model.zero_grad(set_to_none=True)
        return grad

    def placement(self) -> Placement:
        return Placement()  # one process: the only replica

    def export_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Hugging Face names and full tensors: the weight bridge's source."""
        for name, t in self.model.state_dict().items():
            yield name, t.detach()

    def save(self, directory: Path) -> None:
        self.model.save_pretrained(directory / "policy")
        torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
                   directory / "trainer.pt")

    def load(self, directory: Path) -> None:
        state = load_file(str(directory / "policy" / "model.safetensors"))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not (k == "lm_head.weight" and self.model.config.tie_word_embeddings)]
        if missing or unexpected:
            raise ValueError(f"checkpoint {directory} does not match the policy: missing {missing}, unexpected {unexpected}")
        extra = torch.load(directory / "trainer.pt", weights_only=False)
        self.optimizer.load_state_dict(extra["optimizer"])
        self.scheduler.load_state_dict(extra["scheduler"])
