"""The GRPO policy trainer on megatron-core: tensor and data parallelism (pipeline stages: not yet).

The loss is the torch trainer's (`grpo.loss.policy_loss`, one definition), scored on the engine's
sampling distribution from vocab-parallel logits (`logprobs.py`). A minibatch is split across
data-parallel ranks and normalised over the whole minibatch (its tokens, or its sequences), so the
ranks' gradients add up to the minibatch's: megatron's DistributedDataParallel sums them
(`calculate_per_token_loss`), and megatron's optimizer clips by the global norm and steps. The
warm-up, NaN/inf skipping (every rank together: the loss and the norm are global) and the
reported metrics are the torch trainer's.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import Tensor

from fastgrpo.backends.megatron.layout import Layout, LayoutError
from fastgrpo.backends.megatron.logprobs import vocab_parallel_logprobs
from fastgrpo.backends.megatron.model import build_model, export_hf, initialize, load_hf_state
from fastgrpo.config import GRPOConfig, OptimConfig
from fastgrpo.grpo.loss import policy_loss
from fastgrpo.types import RolloutBatch, SamplingParams


class MegatronPolicyTrainer:
    def __init__(self, policy_dir: str | Path, grpo: GRPOConfig, optim: OptimConfig, sampling: SamplingParams,
                 tensor: int = 1, pipeline: int = 1, seed: int = 0):
        if pipeline != 1:
            raise LayoutError("parallel.pipeline > 1: pipeline stages are not built into the Megatron trainer yet")
        if grpo.kl_coef > 0:
            raise ValueError("grpo.kl_coef > 0: the Megatron trainer has no reference model yet")
        if optim.trainable:
            raise ValueError("optim.trainable: the Megatron trainer trains every parameter")
        initialize(tensor, pipeline, seed)
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        import megatron_patches
        from fastgrpo.models.policy import load_policy

        hf = load_policy(policy_dir)
        self.hf_config = hf.config
        self.layout = Layout.of(hf.config, tensor, pipeline)
        module = build_model(hf.config, self.layout)
        load_hf_state(module, hf.state_dict(), self.layout)
        del hf
        module.config.calculate_per_token_loss = True  # DDP sums the ranks' gradients: the loss is normalised globally
        self.cfg, self.sampling = grpo, sampling
        self.base_lr, self.warmup, self.updates = optim.lr, optim.warmup_steps, 0
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp_rank, self.dp_size = dist.get_rank(self.dp_group), dist.get_world_size(self.dp_group)
        self._cpu = megatron_patches.cpu_device_literals
        with self._cpu():
            self.model = DistributedDataParallel(module.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                                 module)
            self.optimizer = get_megatron_optimizer(OptimizerConfig(
                optimizer="adam", lr=optim.lr, weight_decay=optim.weight_decay, adam_beta1=optim.betas[0],
                adam_beta2=optim.betas[1], adam_eps=1e-8, clip_grad=optim.grad_clip, params_dtype=torch.float32),
                [self.model])

    # -- scoring ---------------------------------------------------------------------------
    def _token_logprobs(self, batch: RolloutBatch) -> tuple[Tensor, Tensor]:
        """As the torch trainer's `token_logprobs`: [N, L], position-aligned, column 0 padding."""
        n, width = batch.input_ids.shape
        logits = self.model(batch.input_ids, torch.arange(width).expand(n, -1),
                            attention_mask=torch.triu(torch.ones(width, width, dtype=torch.bool), 1)[None, None])
        logp, entropy = vocab_parallel_logprobs(logits[:, :-1], batch.input_ids[:, 1:], self.sampling, self.layout.vocab)
        pad = torch.zeros_like(logp[:, :1])
        return torch.cat([pad, logp], 1), torch.cat([pad, entropy], 1)

    def _micro_batches(self, batch: RolloutBatch, rows: list[int]) -> Iterator[tuple[list[int], RolloutBatch]]:
        m = self.cfg.micro_batch_size
        for i in range(0, len(rows), m):
            yield rows[i: i + m], batch.select(rows[i: i + m])

    @torch.no_grad()
    def logprobs(self, batch: RolloutBatch) -> Tensor:
        out = torch.zeros(batch.input_ids.shape)
        for rows, mb in self._micro_batches(batch, list(range(batch.size))):
            lp, _ = self._token_logprobs(mb)
            out[rows, : lp.shape[1]] = lp
        return out

    # -- training --------------------------------------------------------------------------
    def _my_rows(self, rows: list[int]) -> list[int]:
        """This data-parallel rank's contiguous share of a minibatch's rows."""
        k = len(rows)
        return rows[self.dp_rank * k // self.dp_size: (self.dp_rank + 1) * k // self.dp_size]

    def _backward(self, batch: RolloutBatch, rows: list[int], old: Tensor | None, totals: dict[str, float]) -> float:
        """This rank's share of the minibatch `rows`, its loss normalised over the whole minibatch."""
        c = self.cfg
        mask = batch.response_mask[rows]
        normaliser = max(float(mask.sum()) if c.loss_aggregation == "token_mean" else float(len(rows)), 1.0)
        loss = 0.0
        for micro_rows, micro in self._micro_batches(batch, self._my_rows(rows)):
            logp, entropy = self._token_logprobs(micro)
            width = logp.shape[1]
            old_logp = old[micro_rows, :width] if old is not None else logp.detach()
            tis = torch.exp(old_logp - micro.engine_logprobs).clamp(max=c.tis_cap) if c.tis_cap > 0 else None
            terms = policy_loss(logp, old_logp, micro.advantages, micro.response_mask, eps_low=c.eps_low,
                                eps_high=c.eps_high, aggregation=c.loss_aggregation, normaliser=normaliser,
                                tis_weight=tis)
            terms.loss.backward()
            m = micro.response_mask.float()
            loss += terms.loss.item()
            totals["clip"] += terms.clipped_tokens.item()
            totals["entropy"] += (entropy.detach() * m).sum().item()
            totals["kl_engine"] += ((micro.engine_logprobs - logp.detach()) * m).sum().item()
            totals["tokens"] += m.sum().item()
        return loss

    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        c = self.cfg
        self.model.train()
        old = self.logprobs(batch) if c.epochs * c.minibatches > 1 else None
        rows = list(range(batch.size))
        per_mb = math.ceil(batch.size / c.minibatches)
        totals = dict(loss=0.0, clip=0.0, kl_engine=0.0, entropy=0.0, tokens=0.0, grad_norm=0.0)
        updates = skipped = 0
        for _ in range(c.epochs):
            for start in range(0, batch.size, per_mb):
                self.model.zero_grad_buffer()
                self.optimizer.zero_grad()
                local_loss = self._backward(batch, rows[start: start + per_mb], old, totals)
                self.model.finish_grad_sync()
                mb_loss = torch.tensor([local_loss])
                dist.all_reduce(mb_loss, group=self.dp_group)
                grad_norm = self._prepare_and_norm()
                if math.isfinite(mb_loss.item()) and math.isfinite(grad_norm):  # the same verdict on every rank
                    for group in self.optimizer.param_groups:
                        group["lr"] = self.base_lr * (min(1.0, (self.updates + 1) / self.warmup) if self.warmup else 1.0)
                    self._clip_and_step(grad_norm)
                    self.updates += 1
                    updates += 1
                    totals["loss"] += mb_loss.item()
                    totals["grad_norm"] += grad_norm
                else:
                    skipped += 1
        self.model.eval()
        stats = torch.tensor([totals[k] for k in ("clip", "entropy", "kl_engine", "tokens")])
        dist.all_reduce(stats, group=self.dp_group)  # every rank reports the whole batch's statistics
        clip, entropy, kl_engine, tokens = stats.tolist()
        tokens = max(tokens, 1.0)
        return {"loss": totals["loss"] / max(updates, 1), "grad_norm": totals["grad_norm"] / max(updates, 1),
                "clip_fraction": clip / tokens, "entropy": entropy / tokens, "kl_ref": 0.0,
                "kl_engine_trainer": kl_engine / tokens, "updates": float(updates), "skipped_updates": float(skipped),
                "lr": self.optimizer.param_groups[0]["lr"]}

    # megatron's optimizer.step() is prepare, norm, clip, update, unconditionally; a NaN/inf update
    # must be skipped, so the four are called here with the check between the norm and the update
    def _prepare_and_norm(self) -> float:
        with self._cpu():
            self.optimizer.prepare_grads()  # the gradient buffers' sums become the parameters' .grad
            return float(self.optimizer.get_grad_norm())

    def _clip_and_step(self, grad_norm: float) -> None:
        from megatron.core.optimizer import optimizer as megatron_optimizer

        with self._cpu():
            for opt in self.optimizer.chained_optimizers:
                if opt.config.clip_grad > 0 and opt.get_parameters():
                    megatron_optimizer.clip_grad_by_total_norm_fp32(opt.get_parameters(), max_norm=opt.config.clip_grad,
                                                                    total_norm=grad_norm)
            self.optimizer.step_with_ready_grads()

    def export_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Full tensors under Hugging Face names, on every rank of the model-parallel group."""
        return export_hf(self.model.module, self.layout)

    # -- checkpoints -------------------------------------------------------------------------
    # The policy is written as a Hugging Face directory (gathered: it loads at any layout, and in any
    # Hugging Face tool); the optimizer state as one file per rank, which resumes at the same layout
    # only. Resharding optimizer state through megatron's dist_checkpointing is not built yet.
    def _optimizer_file(self, directory: Path) -> Path:
        l, rank = self.layout, dist.get_rank()
        return directory / f"megatron_optimizer_tp{l.tp}_pp{l.pp}_dp{self.dp_size}_rank{rank}.pt"

    def save(self, directory: Path) -> None:
        tensors = {name: t.contiguous().clone() for name, t in self.export_weights()}  # every rank takes part
        if dist.get_rank() == 0:
            policy = directory / "policy"
            policy.mkdir(parents=True, exist_ok=True)
            if self.layout.tied:
                tensors.pop("lm_head.weight", None)
            save_file(tensors, str(policy / "model.safetensors"))
            self.hf_config.save_pretrained(policy)
        dist.barrier()
        torch.save({"optimizer": self.optimizer.state_dict(), "updates": self.updates}, self._optimizer_file(directory))

    def load(self, directory: Path) -> None:
        state = self._optimizer_file(directory)
        if not state.is_file():
            raise FileNotFoundError(f"{directory} holds no optimizer state for this layout ({state.name}): the Megatron "
                                    f"trainer resumes at the layout it saved at")
        load_hf_state(self.model.module, load_file(str(directory / "policy" / "model.safetensors")), self.layout)
        saved = torch.load(state, weights_only=False)
        self.optimizer.load_state_dict(saved["optimizer"])
        self.updates = saved["updates"]
