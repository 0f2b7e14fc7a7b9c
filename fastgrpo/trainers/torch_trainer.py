"""The embedded policy trainer: a Hugging Face model trained with plain PyTorch on one process.

On its device (`fastgrpo.device`), in fp32, or in bf16 as megatron-core and DeepSpeed train: the
model's weights and activations in bf16, each micro-batch's bf16 gradients added into fp32 gradients
of fp32 master weights, which the optimizer clips and steps and the bf16 weights are copied from.

A mixture-of-experts policy (Qwen3-MoE, `models.families.MOE_BLOCKS`) is the Hugging Face model's own
MoE forward. Each training forward also returns the router's logits, from which the step reports
its expert load (`expert_load`: the tokens each expert got, summed over every training forward of
the step and every data-parallel rank) and, only when `trainer.router_aux_loss` > 0, adds that
coefficient times Hugging Face's load-balancing loss (`load_balancing_loss_func`, over the micro-
batch's real tokens) to the GRPO loss, weighted by the micro-batch's share of the minibatch's
sequences so that micro-batches and data-parallel shares add up as the GRPO loss does. The default
(0) leaves the pretrained routing to the policy gradient alone, whatever the checkpoint's own
`output_router_logits` / `router_aux_loss_coef` say: those act only when Hugging Face is given
labels, which the trainer never passes.

A micro-batch of more than `trainer.logits_chunk_tokens` scored tokens never holds its whole logits:
for that forward the LM head's forward is `chunked_logprobs.chunked_scores` (its weight, each chunk's
logits scored and dropped, recomputed in the backward), and the model's `logits` output carries the
per-token log-probability and entropy instead ([n, width - 1, 2]); the families served pass the LM
head's output through untouched. The head is still called as a module, once per forward, so hooks on
it see its weight in use (DeepSpeed ZeRO-3 gathers it before the forward and again before the backward).
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, PreTrainedModel

from fastgrpo.config import ConfigError, GRPOConfig, OptimConfig, TrainerConfig
from fastgrpo.device import Compute
from fastgrpo.models.families import MOE_BLOCKS
from fastgrpo.models.routing import Mismatch, impose, replay_routing
from fastgrpo.trainers.chunked_logprobs import chunked_scores, token_scores
from fastgrpo.paths import checkpoint_policy
from fastgrpo.types import Placement, RolloutBatch, SamplingParams
from fastgrpo.grpo.step import STATS, LossFn, grpo_step, minibatch_loss


def token_logprobs(model: PreTrainedModel, batch: RolloutBatch, sampling: SamplingParams) -> tuple[Tensor, Tensor]:
    """Position-aligned log-probabilities of each token under the engine's sampling distribution
    (temperature, top-k, top-p: the one definition in `sampling_logprobs`, in the sets the engine
    sampled from when the batch carries them) and that distribution's entropy, [N, L]."""
    logp, entropy, _ = _score(model, batch, sampling, router=False)
    return logp, entropy


def _score(model: PreTrainedModel, batch: RolloutBatch, sampling: SamplingParams, router: bool,
           chunk_tokens: int = 0, replay: bool = False, mismatch: Mismatch | None = None
           ) -> tuple[Tensor, Tensor, tuple[Tensor, ...] | None]:
    """`token_logprobs`, and with `router` each sparse layer's router logits [N x L, E]. More than
    `chunk_tokens` scored tokens (> 0): scored in chunks of that many from the LM head's input
    (`scores_from_head`), never holding the whole logits. `replay`: a mixture of experts routes each
    token to the experts the batch recorded in rollout (models/routing.py); `mismatch`: adds the
    recorded picks its router would have changed. `model`: a Hugging Face model, or a DeepSpeed engine
    around one."""
    tokens = batch.input_ids[:, 1:]
    sets = None if batch.sample_sets is None else batch.sample_sets[:, 1:]
    kwargs = {"output_router_logits": True} if router else {}
    record = batch.routing if replay or mismatch is not None else None
    with replay_routing(model, record, replay) as found:
        if 0 < chunk_tokens < tokens.numel():
            head = getattr(model, "module", model).get_output_embeddings()  # (a DeepSpeed engine's model)
            with scores_from_head(head, tokens, sets, sampling, chunk_tokens):
                out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, **kwargs)
            logp, entropy = out.logits.unbind(-1)
        else:
            out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, **kwargs)
            logp, entropy = token_scores(out.logits[:, :-1], tokens, sampling, sets)
    if mismatch is not None:
        mismatch.picks += found.picks
        mismatch.differ += found.differ
    pad = torch.zeros_like(logp[:, :1])
    return torch.cat([pad, logp], 1), torch.cat([pad, entropy], 1), (tuple(out.router_logits) if router else None)


@contextlib.contextmanager
def scores_from_head(head: torch.nn.Module, tokens: Tensor, sets: Tensor | None, sampling: SamplingParams,
                     chunk_tokens: int) -> Iterator[None]:
    """For the forwards inside: the LM head's forward turns the final hidden states [n, width, H]
    into the scores of `tokens` [n, width - 1] (the next token at each position but the last), stacked
    as [n, width - 1, 2] (log-probability, entropy), by `chunked_scores` on the head's own weight in
    chunks of `chunk_tokens`. Only this instance's forward is replaced, and restored on exit; the head
    is still called through its module call (its hooks run)."""
    if not isinstance(head, torch.nn.Linear):
        raise TypeError(f"trainer.logits_chunk_tokens: the LM head is a {type(head).__name__}, not a Linear "
                        f"layer; set trainer.logits_chunk_tokens=0")

    def scores(hidden: Tensor) -> Tensor:
        logp, entropy = chunked_scores(hidden[:, :-1], head.weight, tokens,
                                       lambda logits, t, s: token_scores(logits, t, sampling, s),
                                       chunk_tokens, sets, head.bias)
        return torch.stack([logp, entropy], -1)

    own = head.__dict__.get("forward")  # an instance's own forward (a wrapper's), if it has one
    head.forward = scores
    try:
        yield
    finally:
        if own is None:
            del head.forward  # the class's forward again
        else:
            head.forward = own


def routed_tokens(router_logits: tuple[Tensor, ...], attention_mask: Tensor, top_k: int,
                  replayed: Tensor | None = None) -> Tensor:
    """The tokens each expert of each sparse layer was routed (the top-k of the router's softmax, as
    the model routes them; under replay the recorded experts, `replayed` [N, L, layers, k], where a
    position has a record), counting the real tokens of `attention_mask` only: [layers, E]."""
    mask = attention_mask.reshape(-1, 1).to(torch.float64)
    counts = []
    for layer, logits in enumerate(router_logits):
        chosen = torch.softmax(logits.detach().float(), -1).topk(top_k, dim=-1).indices  # [tokens, k]
        if replayed is not None:
            chosen = impose(chosen, replayed[:, :, layer].reshape(-1, top_k)).chosen
        hits = torch.zeros(logits.shape[0], logits.shape[1], dtype=torch.float64, device=logits.device)
        counts.append((hits.scatter_(1, chosen, 1.0) * mask).sum(0))
    return torch.stack(counts)


def expert_load(counts: Tensor) -> dict[str, float]:
    """The step's expert load from its routed-token counts [layers, E]: `expert_load_max_over_mean`,
    the busiest expert's count over the mean count, averaged over the sparse layers (1 when every
    expert gets as many tokens; at most E / k, when k experts get every token); and
    `expert_idle_fraction`, the share of (layer, expert) pairs that got no token."""
    mean = counts.mean(1).clamp(min=1e-12)
    return {"expert_load_max_over_mean": float((counts.max(1).values / mean).mean()),
            "expert_idle_fraction": float((counts == 0).double().mean())}


def sparse_blocks(model: torch.nn.Module) -> int:
    """How many sparse (mixture-of-experts) blocks the policy has: 0 for a dense family, and for a
    Qwen3-MoE whose config leaves every layer dense (`mlp_only_layers`, num_experts 0)."""
    block = MOE_BLOCKS.get(model.config.model_type)
    return sum(type(m).__name__ == block for m in model.modules()) if block else 0


def check_router_losses(trainer: TrainerConfig, moe: bool) -> None:
    """The router losses this trainer can add: the load-balancing loss on a mixture of experts only
    (on a dense policy there is no router, and a configured loss silently ignored would mislead);
    never the z-loss, which Hugging Face's models do not compute (the Megatron trainer's is
    megatron-core's)."""
    if trainer.router_z_loss > 0:
        raise ConfigError(f"trainer.router_z_loss={trainer.router_z_loss}: the torch and DeepSpeed trainers have no "
                          f"router z-loss (Hugging Face's MoE models compute none); set it to 0")
    if trainer.router_aux_loss > 0 and not moe:
        raise ConfigError(f"trainer.router_aux_loss={trainer.router_aux_loss}: the policy is not a mixture of "
                          f"experts (no router to balance); set it to 0")


class TorchPolicyTrainer:
    def __init__(self, model: PreTrainedModel, grpo: GRPOConfig, optim: OptimConfig, sampling: SamplingParams,
                 reference: PreTrainedModel | None = None, compute: Compute | None = None,
                 trainer: TrainerConfig | None = None):
        trainer = trainer or TrainerConfig()
        self.logits_chunk_tokens = trainer.logits_chunk_tokens
        self.sparse_layers = sparse_blocks(model)
        self.moe = self.sparse_layers > 0
        check_router_losses(trainer, self.moe)
        self.router_aux_loss = trainer.router_aux_loss
        # trainer.routing_replay=rollout: every forward of the policy (not the reference's) runs the
        # experts the engine recorded; a step whose batch carries a record counts routing_mismatch
        self.replay = trainer.routing_replay == "rollout"
        if self.replay and not self.moe:
            raise ConfigError(f"trainer.routing_replay=rollout: the policy ({model.config.model_type}) has no "
                              f"mixture-of-experts layer to replay")
        self._mismatch: Mismatch | None = None  # during a step whose batch carries routing
        self.top_k = int(getattr(model.config, "num_experts_per_tok", 0))
        self.num_experts = int(getattr(model.config, "num_experts", 0))
        self._routed: Tensor | None = None  # the step's routed-token counts [sparse layers, E], during a step
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
        replay = self.replay and model is self.model  # the reference routes by its own router
        for rows, mb in self._micro_batches(batch, list(range(batch.size))):
            lp, _, _ = _score(model, mb, self.sampling, router=False, chunk_tokens=self.logits_chunk_tokens,
                              replay=replay)
            if rows:
                out[rows, : lp.shape[1]] = lp
        return out

    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        """All optimiser steps for one rollout batch: the GRPO step (`grpo.step.grpo_step`); a mixture
        of experts adds its expert load over the step's training forwards (`expert_load`)."""
        if not self.moe:
            return grpo_step(self, batch, self.cfg)
        self._routed = torch.zeros(self.sparse_layers, self.num_experts, device=self.device, dtype=torch.float64)
        self._mismatch = Mismatch() if batch.routing is not None else None
        try:
            metrics = grpo_step(self, batch, self.cfg) | expert_load(self.all_sum(self._routed))
            if self._mismatch is not None:  # over the training forwards, as kl_engine_trainer
                counts = torch.stack([torch.as_tensor(n, dtype=torch.float64, device=self.device)
                                      for n in (self._mismatch.picks, self._mismatch.differ)])
                picks, differ = self.all_sum(counts).tolist()
                metrics["routing_mismatch"] = differ / picks if picks else 0.0
            return metrics
        finally:
            self._routed = self._mismatch = None

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
            logp, entropy, router = _score(self.model, micro, self.sampling, router=self.moe,
                                           chunk_tokens=self.logits_chunk_tokens, replay=self.replay,
                                           mismatch=self._mismatch if micro_rows else None)
            loss = loss_of(micro_rows, micro, logp, entropy)
            if router is not None:
                if micro_rows and self._routed is not None:  # a padding micro-batch (no rows) routes nothing
                    self._routed += routed_tokens(router, micro.attention_mask, self.top_k,
                                                  micro.routing if self.replay else None)
                if self.router_aux_loss > 0:
                    loss = loss + self._aux_loss(router, micro, len(micro_rows) / len(rows))
            self._backprop(loss)

    def _aux_loss(self, router: tuple[Tensor, ...], micro: RolloutBatch, share: float) -> Tensor:
        """trainer.router_aux_loss times Hugging Face's load-balancing loss of the micro-batch's real
        tokens, times the micro-batch's share of the minibatch's sequences (0 for a padding one)."""
        from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

        aux = load_balancing_loss_func(router, self.num_experts, self.top_k, micro.attention_mask)
        return self.router_aux_loss * share * aux

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
        """The checkpoint's policy as Hugging Face loads it (whichever expert layout its file holds:
        `save` writes one tensor per expert, as `save_pretrained` does), its optimizer and schedule."""
        saved, info = AutoModelForCausalLM.from_pretrained(str(checkpoint_policy(directory)), dtype=torch.float32,
                                                           output_loading_info=True)
        wrong = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
        if wrong:
            raise ValueError(f"checkpoint {directory} does not match the policy: {wrong}")
        self.model.load_state_dict(saved.state_dict())
        del saved
        extra = torch.load(directory / "trainer.pt", weights_only=False, map_location=self.device)
        if self.master is not self.trainable:
            with torch.no_grad():
                for p, m, saved in zip(self.trainable, self.master,
                                       extra.get("master") or [p.detach().float() for p in self.trainable]):
                    m.copy_(saved)
                    p.copy_(m)
        self.optimizer.load_state_dict(extra["optimizer"])
        self.scheduler.load_state_dict(extra["scheduler"])
