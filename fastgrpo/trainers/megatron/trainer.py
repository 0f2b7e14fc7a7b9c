"""The GRPO policy trainer on megatron-core: tensor, pipeline and data parallelism.

The GRPO step is every trainer's (`grpo.step.grpo_step`: minibatches, loss, statistics, NaN skip);
this backend scores on the engine's sampling distribution from vocab-parallel logits
(`logprobs.py`) and runs megatron's schedules and optimizer. A minibatch is split across
data-parallel ranks and normalised over the whole minibatch (its tokens, or its sequences: every
rank holds the whole batch, so every rank knows the normaliser without a collective), so the
ranks' gradients add up to the minibatch's: megatron's DistributedDataParallel sums them
(`calculate_per_token_loss`, and our `finalize_model_grads_func` does not divide by a token
count), and megatron's optimizer clips by the global norm (over TP and PP; DP gradients are already
summed) and steps.

Every forward and backward, with or without pipeline stages, goes through megatron's
`get_forward_backward_func` (1F1B when PP > 1; a plain loop over micro-batches when PP = 1), one
schedule call per minibatch (training) or per batch (`logprobs`). Only the last stage sees logits:
it computes the log-probabilities, the loss and the statistics; they reach the other stages by a
sum over the pipeline group (every other stage contributes zeros, so the sum is exact), and every
rank returns the same metrics and takes the same skip-on-NaN verdict.

Precision and the optimizer (`compute`, `distributed_optimizer`) are megatron-core's own: in bf16 its
Float16Module, fp32 gradient buffers and an optimizer of fp32 main weights; with the distributed
optimizer, gradients reduce-scattered and the optimizer state sharded over the data-parallel ranks.
On a CPU build of torch both run over gloo with `megatron_patches` (what they need is named there).
On CUDA (one GPU per rank, LOCAL_RANK's) every batch moves to the device micro-batch by micro-batch,
and the step's statistics and skip decision cross to the host once per minibatch (grpo.step), on
purpose.

Variable sequence lengths: each micro-batch keeps its own shape (its rows, trimmed to its longest
sequence, as the torch trainer does) and the schedules run with `config.variable_seq_lengths`, so
megatron's point-to-point layer sends each activation's shape (3 integers) before the activation.
Padding every micro-batch of a minibatch to one length and one row count (what a fixed
`seq_length` / `micro_batch_size` needs) would spend compute on padding in proportion to the
spread of response lengths, which in GRPO is wide (a few tokens to the full budget), to save one
tiny message per transfer; length-bucketed micro-batches would also change which rows are summed
together, so the loss would no longer be the torch trainer's to rounding. We keep the torch
trainer's micro-batches (contiguous rows) and pay the shape message.

A mixture of experts (Qwen3-MoE, `model.moe_config`) with `parallel.expert` = EP > 1: the experts
of each layer are split over EP ranks that are data-parallel ranks of each other (with
`parallel.expert_tensor=1`, each expert whole on one rank, they span the TP ranks too), and every MoE
layer's forward and backward exchange tokens between them (all-to-all). So every rank of the data-
parallel group runs the same number of micro-batches (a rank with fewer rows pads with micro-
batches that train nothing). With TP > 1 the model is sequence-parallel, so each micro-batch is
padded on the right to a multiple of TP tokens (causal attention: the real positions never see the
padding, and its logits are cut off before scoring). The router's load-balancing loss and z-loss
(`router_aux_loss`, `router_z_loss`; 0 by default) are megatron's, computed per micro-batch over its
real tokens (megatron's padding mask: `_padding_mask`) and weighted so that a minibatch's gradient
gets the coefficient times their mean over its micro-batches on every data-parallel rank. A step reports its expert load as the
torch trainer does (`torch_trainer.expert_load`: the real tokens each expert was routed in the
step's training forwards, over every rank), counted from each router's routing map. Routing replay
(`routing_replay`, `trainer.routing_replay=rollout`) gives each router of the policy the experts the
engine recorded, micro-batch by micro-batch through megatron-core's `router_replay` hook, and a step
whose batch carries a record reports routing_mismatch (`routing.py`).

Logits in chunks (`trainer.logits_chunk_tokens`): a micro-batch of more scored tokens than that
never holds its whole vocab-parallel logits. For its forward the last stage's output layer returns
its input as the layer itself would take it (under sequence parallelism gathered over the TP ranks,
the gradient reduce-scattered back; otherwise with the gradient all-reduced over them, as the
ColumnParallelLinear does) instead of projecting it, and the loss function scores those hidden
states a chunk of tokens at a time (`chunked_logprobs.chunked_scores`) on this rank's shard of the
output weight, each chunk through `vocab_parallel_logprobs` (its max, sum of exp and target logit
reduced over the TP ranks: the whole vocabulary's log-sum-exp, never gathered). In bf16 the hidden
states stay bf16 (`Float16Module`'s `fp32_output=False`), as the output layer would have taken them.
"""

from __future__ import annotations

import functools
import gc
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from fastgrpo.config import ConfigError, GRPOConfig, OptimConfig, TrainerConfig
from fastgrpo.device import Compute
from fastgrpo.grpo.step import LossFn, grpo_step
from fastgrpo.models.policy import save_policy_tensors
from fastgrpo.paths import checkpoint_policy, is_policy
from fastgrpo.trainers.chunked_logprobs import chunked_scores
from fastgrpo.trainers.megatron.checkpoint import checkpoint_identity, saved_at, start_write_results_queue
from fastgrpo.trainers.megatron.layout import Layout, LayoutError
from fastgrpo.trainers.megatron.logprobs import vocab_parallel_logprobs
from fastgrpo.trainers.megatron.model import build_model, export_hf, initialize, load_hf_checkpoint
from fastgrpo.trainers.megatron.routing import QueuedRecord, RecordedRouting, routed_order
from fastgrpo.types import Placement, RolloutBatch, SamplingParams

Micro = tuple[list[int], RolloutBatch]  # batch rows (empty: a placeholder that trains nothing) and their data
# (rows, micro-batch, the last stage's output [n, width, ...], the output weight it is to be scored with or None:
# `MegatronPolicyTrainer._score`) -> its loss (training) or None (scoring)
OnOutput = Callable[[list[int], RolloutBatch, Tensor, "Tensor | None"], "Tensor | None"]


class MegatronPolicyTrainer:
    def __init__(self, policy_dir: str | Path, grpo: GRPOConfig, optim: OptimConfig, sampling: SamplingParams,
                 tensor: int = 1, pipeline: int = 1, seed: int = 0, layer_spec: str = "auto",
                 recompute: bool = False, compute: Compute | None = None, distributed_optimizer: bool = False,
                 expert: int = 1, router_aux_loss: float = 0.0, router_z_loss: float = 0.0,
                 logits_chunk_tokens: int = TrainerConfig.logits_chunk_tokens, routing_replay: bool = False,
                 optimizer_offload: bool = False, expert_tensor: int = 0):
        """`compute`: the device and dtype (`fastgrpo.device.resolve`; fp32 on this machine's device by
        default). bf16 is megatron-core's: bf16 weights and activations (`Float16Module`), gradients
        accumulated and reduced in fp32 (`grad_reduce_in_fp32`), an optimizer stepping fp32 main
        copies of the weights and copying them back to bf16. `distributed_optimizer`: megatron-core's
        DistributedOptimizer, the fp32 main weights and Adam's moments sharded over the data-parallel
        ranks (gradients reduce-scattered, updated weights all-gathered). `expert`: the expert-parallel
        size of a mixture of experts (`parallel.expert`), `expert_tensor` its experts' tensor-parallel
        size (`parallel.expert_tensor`: 0, the same as `tensor`, or 1: each expert whole on one rank,
        megatron-core's DDP then summing each expert's gradient over its expert-data-parallel ranks, which
        span the TP ranks); `router_aux_loss`, `router_z_loss`: the
        coefficients of its router's load-balancing loss and z-loss (`trainer.router_aux_loss`,
        `trainer.router_z_loss`; 0: none). `logits_chunk_tokens`: the most tokens whose logits are
        held at once (`trainer.logits_chunk_tokens`; 0: a micro-batch's whole logits). `routing_replay`:
        the policy's forwards route each token to the experts the batch recorded in rollout
        (`trainer.routing_replay=rollout`; `routing.py`).
        `optimizer_offload`: megatron-core's optimizer CPU offload (`trainer.optimizer_offload`): the
        distributed optimizer's fp32 main weights and Adam moments in host memory, stepped there
        (`_offload_fields` has its rules, refused here before any process group exists)."""
        if optim.trainable:
            raise ValueError("optim.trainable: the Megatron trainer trains every parameter")
        from transformers import AutoConfig

        here = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        compute = compute or Compute(here, torch.float32)
        if compute.device.type != here.type:  # megatron_patches (the CPU path) apply only without CUDA
            raise ValueError(f"the Megatron trainer runs on this machine's {here.type.upper()}, not on "
                             f"{compute.device.type} (device={compute.device.type})")
        if compute.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the Megatron trainer trains in fp32 or bf16, not {compute.dtype}")
        offload = _offload_fields(optimizer_offload, here, compute.dtype, distributed_optimizer)
        self.compute = compute
        if not is_policy(policy_dir):
            raise FileNotFoundError(f"no Hugging Face policy at {policy_dir} (config.json missing)")
        # the layout is checked on the config alone, before any group or weight exists
        hf_config = AutoConfig.from_pretrained(policy_dir)
        self.layout = Layout.of(hf_config, tensor, pipeline, expert, expert_tensor=expert_tensor)
        if routing_replay and not self.layout.experts:
            raise ConfigError(f"trainer.routing_replay=rollout: the policy ({hf_config.model_type}) has no "
                              f"mixture-of-experts layer to replay")
        initialize(tensor, pipeline, seed, expert, self.layout.expert_tp)  # on CUDA: this rank's GPU (LOCAL_RANK) made current
        self.device = torch.device("cuda", torch.cuda.current_device()) if here.type == "cuda" else here
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        import megatron_patches

        self.hf_config = hf_config
        dtype = compute.dtype
        # `gpt`: this rank's GPTModel (its parameters' names are the layout's); `module`: what the
        # schedules run (bf16: wrapped in megatron's Float16Module, which casts the first stage's
        # inputs to bf16 and the last stage's logits back to fp32)
        self.gpt = build_model(hf_config, self.layout, layer_spec, recompute, dtype, router_aux_loss, router_z_loss)
        self.router_losses = (router_aux_loss, router_z_loss) if self.layout.experts else (0.0, 0.0)
        self._routed: Tensor | None = None  # during a train step: routed real tokens [layers, E] of this rank
        self._real_tokens: Tensor | None = None  # during a training forward: its real tokens, [tokens] as routed
        load_hf_checkpoint(self.gpt, Path(policy_dir), self.layout)  # this rank's pieces, a tensor at a time
        self.logits_chunk_tokens = logits_chunk_tokens
        self._defer_logits = False  # during a forward whose logits are scored in chunks (module docstring)
        self._defer_output_layer(self.gpt)
        _send_contiguous(self.gpt)
        module = _precision_wrapper(self.gpt)
        # the k3 KL's reference: the initial policy, frozen, in the same layout and precision (each rank
        # holds its own shard of it, as of the policy), scored through the same schedule
        self.reference = self._reference_gpt = None
        if grpo.kl_coef > 0:
            reference = build_model(hf_config, self.layout, layer_spec, dtype=dtype)
            load_hf_checkpoint(reference, Path(policy_dir), self.layout)
            reference.requires_grad_(False).eval()
            reference.config.variable_seq_lengths = True
            self._defer_output_layer(reference)
            _send_contiguous(reference)
            self.reference, self._reference_gpt = _precision_wrapper(reference), reference
        config = self.gpt.config
        config.calculate_per_token_loss = True  # DDP sums the ranks' gradients: the loss is normalised globally
        config.variable_seq_lengths = True  # each micro-batch its own shape (module docstring)
        self.cfg, self.sampling = grpo, sampling
        self.base_lr, self.warmup, self.updates = optim.lr, optim.warmup_steps, 0
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp_rank, self.dp_size = dist.get_rank(self.dp_group), dist.get_world_size(self.dp_group)
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.last_stage = parallel_state.is_pipeline_last_stage()
        self.replay = routing_replay
        self._recorded: list[RecordedRouting] = []  # the stage's routers' replay (a mixture of experts)
        if self.layout.experts:
            self._count_routes()
            self._recorded = [RecordedRouting(recompute) for _ in self.gpt.decoder.layers]
            for block, recorded in zip(self.gpt.decoder.layers, self._recorded, strict=True):
                block.mlp.router.router_replay = recorded
        self.distributed_optimizer = distributed_optimizer
        self._cpu = megatron_patches.cpu_device_literals
        with self._cpu():
            self.model = DistributedDataParallel(config, DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer), module)
            self.optimizer = get_megatron_optimizer(OptimizerConfig(
                optimizer="adam", lr=optim.lr, weight_decay=optim.weight_decay, adam_beta1=optim.betas[0],
                adam_beta2=optim.betas[1], adam_eps=1e-8, clip_grad=optim.grad_clip, params_dtype=dtype,
                bf16=dtype == torch.bfloat16, use_distributed_optimizer=distributed_optimizer,
                **offload), [self.model])
        if offload:
            # megatron-core first builds an offloading optimizer over this rank's whole weights (fp32 host copies,
            # 4 B a parameter) and the distributed optimizer replaces it with one over its own shards
            # (distrib_optimizer.py:602-605); the first one's step hooks hold it in a reference cycle
            # (cpu_offloading/hybrid_optimizer.py:117-148), which only the cycle collector frees: now, not later
            gc.collect()
        config.no_sync_func = self.model.no_sync
        config.finalize_model_grads_func = _finalize_model_grads
        self.model.eval()
        start_write_results_queue()

    # -- the schedule ------------------------------------------------------------------------
    def _micro_batches(self, batch: RolloutBatch, rows: list[int]) -> list[Micro]:
        """This data-parallel rank's micro-batches of `rows` (the whole set; its share is taken here);
        at least one (a rank with no rows still takes part in the pipeline's and the data-parallel
        group's collectives, with a row that trains nothing), and with expert parallelism as many as
        the data-parallel rank with the most (`_micro_count`): the experts' all-to-all needs every
        rank of the EP group in every MoE layer's forward and backward."""
        m = self.cfg.micro_batch_size
        mine = self._my_rows(rows)
        micros = [(mine[i: i + m], batch.select(mine[i: i + m]).to(self.device)) for i in range(0, len(mine), m)]
        count = self._micro_count(rows) if self.layout.expert > 1 else max(len(micros), 1)
        if len(micros) < count:
            empty = batch.select([0]).to(self.device)
            empty.response_mask = torch.zeros_like(empty.response_mask)
            micros += [([], empty)] * (count - len(micros))
        return micros

    def _micro_count(self, rows: list[int]) -> int:
        """The most micro-batches any data-parallel rank makes of its share of `rows` (at least 1):
        known to every rank without a collective, since every rank holds the whole batch."""
        m, k = self.cfg.micro_batch_size, len(rows)
        shares = [(r + 1) * k // self.dp_size - r * k // self.dp_size for r in range(self.dp_size)]
        return max(1, max(math.ceil(n / m) for n in shares))

    def _my_rows(self, rows: list[int]) -> list[int]:
        """This data-parallel rank's contiguous share of `rows`."""
        k = len(rows)
        return rows[self.dp_rank * k // self.dp_size: (self.dp_rank + 1) * k // self.dp_size]

    def _run(self, micros: list[Micro], on_output: OnOutput, forward_only: bool,
             model: torch.nn.Module | None = None) -> None:
        """One schedule call of `model` (the policy by default) over `micros`; on the last stage,
        `on_output(rows, micro, output, weight)` sees each micro-batch's vocab-parallel logits (`weight`
        None), or for a micro-batch scored in chunks the output layer's input and this rank's shard of
        the output weight (`_score` turns either into log-probabilities and entropy), and returns its
        loss (training) or None."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        # sequence parallelism (a mixture of experts at TP > 1) splits each sequence over the TP ranks
        multiple = self.layout.tensor if self.gpt.config.sequence_parallel else 1
        gpt = self.gpt if model is None or model is self.model else self._reference_gpt

        def forward_step(data_iterator, model):
            rows, micro = next(data_iterator)
            ids = micro.input_ids
            n, width = ids.shape
            if width % multiple:  # padded on the right: causal attention keeps it from the real positions
                ids = torch.nn.functional.pad(ids, (0, multiple - width % multiple))
            padded, device = ids.shape[1], ids.device
            if self._routed is not None and not forward_only:  # a training forward of a MoE: count its routes
                self._real_tokens = self._routed_order(micro.attention_mask.bool() if rows else
                                                       torch.zeros_like(micro.attention_mask, dtype=torch.bool), padded)
            if gpt is self.gpt and micro.routing is not None:
                self._queue_routing(micro, padded, count=bool(rows) and not forward_only, forward_only=forward_only)
            # more tokens than a chunk: the last stage returns the output layer's input, scored in chunks
            self._defer_logits = 0 < self.logits_chunk_tokens < n * (width - 1)
            # (bf16: the hidden states as the output layer takes them, not cast to fp32 by Float16Module)
            precision = {"fp32_output": False} if self._defer_logits and gpt.config.bf16 else {}
            if any(self.router_losses) and not forward_only and gpt is self.gpt:
                precision["padding_mask"] = self._padding_mask(micro, padded)
            try:
                out = model(ids, torch.arange(padded, device=device).expand(n, -1),
                            attention_mask=torch.triu(torch.ones(padded, padded, dtype=torch.bool, device=device), 1)[None, None],
                            **precision)
            finally:
                self._real_tokens = None  # (a recompute in the backward is the same forward: not counted again)
            weight = _output_weight(gpt) if self._defer_logits else None
            self._defer_logits = False
            return out, functools.partial(_loss_func, on_output, rows, micro, weight)

        self._weigh_router_losses(len(micros) * self.dp_size)
        for recorded in self._recorded:
            recorded.drop_queued()
        with self._cpu():
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(micros), model=model or self.model,
                num_microbatches=len(micros),
                seq_length=max(-(-m.input_ids.shape[1] // multiple) * multiple for _, m in micros),
                micro_batch_size=max(m.size for _, m in micros), forward_only=forward_only)

    def _padding_mask(self, micro: RolloutBatch, padded: int) -> Tensor:
        """The router losses' padding mask of a micro-batch, [n, positions] (True: padding, megatron's
        convention): its padding and the positions added to make its width `padded`. megatron's MoE
        layers leave padding out of the load-balancing loss and the z-loss with it, as Hugging Face's
        load_balancing_loss_func does with the attention mask. GPTModel takes it whole on the first
        stage and scatters it over the TP ranks itself under sequence parallelism
        (models/gpt/gpt_model.py, `_preprocess`); a later stage passes it on as given, so there it is
        this TP rank's shard of the positions already."""
        pad = torch.nn.functional.pad(~micro.attention_mask.bool(), (0, padded - micro.attention_mask.shape[1]),
                                      value=True)
        if self.gpt.config.sequence_parallel and not self.gpt.pre_process:
            from megatron.core import parallel_state

            pad = pad.chunk(self.layout.tensor, dim=1)[parallel_state.get_tensor_model_parallel_rank()]
        return pad.contiguous()

    def _weigh_router_losses(self, micro_batches: int) -> None:
        """The router's auxiliary losses enter each micro-batch's backward with megatron's coefficient
        (with `calculate_per_token_loss` the schedule scales them by 1, and the trainer's gradient sums
        over micro-batches and data-parallel ranks): set to the trainer's coefficients over the
        minibatch's micro-batch count (over every data-parallel rank), so that the minibatch's gradient
        gets the coefficients times their mean. The routers read the coefficients at each forward."""
        aux, z = self.router_losses
        if aux > 0:
            self.gpt.config.moe_aux_loss_coeff = aux / micro_batches
        if z > 0:
            self.gpt.config.moe_z_loss_coeff = z / micro_batches

    def _sum_over_stages_and_replicas(self, t: Tensor) -> Tensor:
        """Sum over the pipeline group (only the last stage holds values) and the data-parallel group."""
        if self.layout.pipeline > 1:
            dist.all_reduce(t, group=self.pp_group)
        if self.dp_size > 1:
            dist.all_reduce(t, group=self.dp_group)
        return t

    # -- scoring ---------------------------------------------------------------------------
    @torch.no_grad()
    def logprobs_and_entropy(self, batch: RolloutBatch, model: torch.nn.Module | None = None) -> tuple[Tensor, Tensor]:
        """As the torch trainer's `token_logprobs` over the whole batch, of `model` (the policy by
        default): [N, L] each, position-aligned, column 0 padding; on every rank (each data-parallel
        rank scores its share of the rows)."""
        out = torch.zeros(2, *batch.input_ids.shape, device=self.device)

        def score(rows: list[int], micro: RolloutBatch, output: Tensor, weight: Tensor | None) -> None:
            logp, entropy = self._score(micro, output, weight)
            if rows:
                out[0, rows, 1: logp.shape[1] + 1] = logp
                out[1, rows, 1: entropy.shape[1] + 1] = entropy

        self._run(self._micro_batches(batch, list(range(batch.size))), score, forward_only=True,
                  model=model)
        logp, entropy = self._sum_over_stages_and_replicas(out)
        return logp, entropy

    def logprobs(self, batch: RolloutBatch) -> Tensor:
        return self.logprobs_and_entropy(batch)[0]

    def _score(self, micro: RolloutBatch, output: Tensor, weight: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Log-probability and entropy of tokens 1.. of `micro`, [n, width - 1] each, from the last
        stage's `output` [n, width, ...]: this TP rank's vocab-parallel logits, or (`weight` given:
        this rank's shard of the output weight) the output layer's input, scored in chunks of
        `logits_chunk_tokens` tokens."""
        sets = None if micro.sample_sets is None else micro.sample_sets[:, 1:]
        tokens = micro.input_ids[:, 1:]
        if weight is None:
            return vocab_parallel_logprobs(output[:, :-1], tokens, self.sampling, self.layout.vocab, sets)

        def score(logits: Tensor, chunk_tokens: Tensor, chunk_sets: Tensor | None) -> tuple[Tensor, Tensor]:
            return vocab_parallel_logprobs(logits, chunk_tokens, self.sampling, self.layout.vocab, chunk_sets)

        return chunked_scores(output[:, :-1], weight, tokens, score, self.logits_chunk_tokens, sets)

    def _defer_output_layer(self, gpt) -> None:
        """`gpt`'s output layer (the last stage's; none elsewhere), during a forward whose logits are
        scored in chunks (`_defer_logits`), returns its input as its matmul would take it: under
        sequence parallelism gathered over the TP ranks (the gradient reduce-scattered back), else
        with the gradient all-reduced over them (what ColumnParallelLinear does around its matmul);
        otherwise it is the layer itself. Only the instance's forward is replaced: its parameters,
        names and checkpoints are the layer's."""
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                            gather_from_sequence_parallel_region)

        layer = getattr(gpt, "output_layer", None)
        if layer is None:
            return
        project = layer.forward

        def forward(input_: Tensor, weight: Tensor | None = None, runtime_gather_output: bool | None = None):
            if not self._defer_logits:
                return project(input_, weight=weight, runtime_gather_output=runtime_gather_output)
            if layer.sequence_parallel:
                return gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True,
                                                            group=layer.tp_group), None
            if layer.allreduce_dgrad:
                return _ContiguousGradient.apply(copy_to_tensor_model_parallel_region(input_, group=layer.tp_group)), None
            return input_, None

        layer.forward = forward

    # -- training: what the GRPO step (`grpo.step.grpo_step`) asks of a backend --------------------
    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        """All optimiser steps for one rollout batch: the GRPO step (`grpo.step.grpo_step`); a mixture
        of experts adds its expert load over the step's training forwards (`torch_trainer.expert_load`)."""
        if not self.layout.experts:
            return grpo_step(self, batch, self.cfg)
        from fastgrpo.trainers.torch_trainer import expert_load

        self._routed = torch.zeros(self.layout.layers, self.layout.experts, dtype=torch.float64, device=self.device)
        try:
            metrics = grpo_step(self, batch, self.cfg)
            counts = self._routed
            if self.layout.tensor > 1:  # sequence parallel: each TP rank routed its own shard of the tokens
                from megatron.core import parallel_state

                dist.all_reduce(counts, group=parallel_state.get_tensor_model_parallel_group())
            metrics |= expert_load(self._sum_over_stages_and_replicas(counts).cpu())
            if batch.routing is not None:  # over the training forwards, as kl_engine_trainer
                metrics["routing_mismatch"] = self._routing_mismatch()
            return metrics
        finally:
            self._routed = None
            for recorded in self._recorded:
                recorded.clear()

    def _routing_mismatch(self) -> float:
        """The share of the step's recorded picks the routers would have changed, over every router of
        every stage, TP shard (sequence parallel) and data-parallel rank."""
        counts = torch.zeros(2, dtype=torch.float64, device=self.device)
        for recorded in self._recorded:
            counts += torch.stack([torch.as_tensor(n, dtype=torch.float64, device=self.device)
                                   for n in (recorded.picks, recorded.differ)])
        if self.gpt.config.sequence_parallel:
            from megatron.core import parallel_state

            dist.all_reduce(counts, group=parallel_state.get_tensor_model_parallel_group())
        picks, differ = self._sum_over_stages_and_replicas(counts).tolist()
        return differ / picks if picks else 0.0

    def _count_routes(self) -> None:
        """A hook on each of this stage's routers adds, during a training forward, the real tokens it
        routed to each expert (its routing map: [tokens, E], this TP rank's shard of the sequence under
        sequence parallelism, sequence-major) to the step's counts, under the layer's global index."""
        first = self.layout.stage_layers(self.pp_rank).start

        def count(router, inputs, output, layer: int):
            if self._routed is not None and self._real_tokens is not None:
                routing_map = output[1]
                self._routed[layer] += (routing_map & self._real_tokens[:, None]).sum(0, dtype=torch.float64)

        for i, block in enumerate(self.gpt.decoder.layers):
            block.mlp.router.register_forward_hook(functools.partial(count, layer=first + i))

    def _routed_order(self, per_position: Tensor, padded: int) -> Tensor:
        """`per_position` [n, width, ...] of a micro-batch in the order this rank's routers see its tokens
        (`routing.routed_order`)."""
        from megatron.core import parallel_state

        shard = ((parallel_state.get_tensor_model_parallel_rank(), self.layout.tensor)
                 if self.gpt.config.sequence_parallel else None)
        return routed_order(per_position, padded, shard)

    def _queue_routing(self, micro: RolloutBatch, padded: int, count: bool, forward_only: bool) -> None:
        """Queue `micro`'s routing record on each of this stage's routers (`routing.py`): imposed when
        replaying, its picks counted toward routing_mismatch in a training forward of real rows."""
        if not (self.replay or count):
            return
        first = self.layout.stage_layers(self.pp_rank).start
        recomputed = self.gpt.config.recompute_granularity == "full" and not forward_only
        for i, recorded in enumerate(self._recorded):
            experts = self._routed_order(micro.routing[:, :, first + i], padded)
            recorded.queue(QueuedRecord(experts, count, self.replay, recomputed))

    def reference_logprobs(self, batch: RolloutBatch) -> Tensor:
        if self.reference is None:
            raise ValueError("grpo.kl_coef > 0 needs a reference policy")
        return self.logprobs_and_entropy(batch, self.reference)[0]

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def accumulate(self, batch: RolloutBatch, rows: list[int], loss_of: LossFn) -> None:
        """This data-parallel rank's share of `rows` through the pipeline schedule; the last stage
        scores each micro-batch's logits and the loss is backpropagated through every stage."""
        def on_output(micro_rows: list[int], micro: RolloutBatch, output: Tensor, weight: Tensor | None) -> Tensor:
            logp, entropy = self._score(micro, output, weight)
            pad = torch.zeros_like(logp[:, :1])
            return loss_of(micro_rows, micro, torch.cat([pad, logp], 1), torch.cat([pad, entropy], 1))

        self._run(self._micro_batches(batch, rows), on_output, forward_only=False)

    def update(self, loss_finite: bool) -> float | None:
        """megatron's optimizer.step() is prepare, norm, clip, update, unconditionally; a NaN/inf
        update must be skipped, so the four are called here with the check between the norm and the
        update (the same verdict on every rank: the loss and the norm are global)."""
        with self._cpu():
            self.optimizer.prepare_grads()  # the gradient buffers' sums become the parameters' .grad
            norm = float(self.optimizer.get_grad_norm())  # over TP and PP (and every DP rank has the sum)
        if not (loss_finite and math.isfinite(norm)):
            return None
        from megatron.core.optimizer import optimizer as megatron_optimizer

        for group in self.optimizer.param_groups:
            group["lr"] = self.base_lr * (min(1.0, (self.updates + 1) / self.warmup) if self.warmup else 1.0)
        with self._cpu():
            for opt in self.optimizer.chained_optimizers:
                if opt.config.clip_grad > 0 and opt.get_parameters():
                    # the precision-aware optimizer (trainer.optimizer_offload) keeps gradients in .decoupled_grad,
                    # not .grad: read there, as megatron's own clip_grad_norm does (optimizer.py:203-220)
                    megatron_optimizer.clip_grad_by_total_norm_fp32(
                        opt.get_parameters(), max_norm=opt.config.clip_grad, total_norm=norm,
                        use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
            self.optimizer.step_with_ready_grads()
        self.updates += 1
        return norm

    def optimizer_bytes(self) -> int:
        """What this rank's optimizer holds beyond the model's weights and gradient buffer: Adam's two
        moments and, in bf16, the fp32 main weights (in fp32 the optimizer steps the weights
        themselves: no copy). 8 B per parameter of this rank's shard in fp32, 12 B in bf16, and with
        the distributed optimizer a 1/DP share of it (plus its bucket padding). Adam's state exists from
        the first step on."""
        weights = {p.untyped_storage().data_ptr() for p in self.gpt.parameters()}
        total = 0
        for opt in self.optimizer.chained_optimizers:
            for group in opt.optimizer.param_groups:
                for p in group["params"]:
                    if p.untyped_storage().data_ptr() not in weights:  # a main copy, not a view of the weights
                        total += p.numel() * p.element_size()
                    total += sum(t.numel() * t.element_size() for k, t in opt.optimizer.state.get(p, {}).items()
                                 if k != "step" and isinstance(t, Tensor))
        return total

    def all_sum(self, t: Tensor) -> Tensor:
        # the step's statistics are host tensors; NCCL sums device tensors (on CPU, `to` is `t` itself)
        return self._sum_over_stages_and_replicas(t.to(self.device)).to(t.device)

    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def placement(self) -> Placement:
        from megatron.core import parallel_state

        leads = parallel_state.get_tensor_model_parallel_rank() == 0 and parallel_state.is_pipeline_first_stage()
        return Placement(self.dp_rank, self.dp_size, leads)

    def export_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Full tensors under Hugging Face names, on every rank of the model-parallel group, on the
        trainer's device, in its dtype: fp32, or in bf16 the bf16 weights the forward uses (each the
        bf16 rounding of its fp32 main weight, as megatron's optimizer copies them after a step), which
        is what engines on CUDA serve; the embedded engine on a CPU holds them in the dtype it gets."""
        return export_hf(self.gpt, self.layout)

    # -- checkpoints -------------------------------------------------------------------------
    # A checkpoint directory holds two things:
    # - `policy/`: the policy as a Hugging Face directory (full tensors gathered layer by layer and
    #   written by rank 0, in the training dtype): what the rollout engine, `fastgrpo eval` and any
    #   Hugging Face tool read.
    # - `megatron/`: megatron's distributed checkpoint (`dist_checkpointing`, torch_dist format) of
    #   the model (in the training dtype) and the optimizer state (Adam's moments and step; in bf16
    #   the fp32 main weights too), each rank writing its shards of the global tensors, plus
    #   `fastgrpo.json` (the model's shape, the layout it was saved at, the update count for the
    #   warm-up, the precision and the optimizer kind). With the replicated optimizer it loads at any
    #   TP x PP x DP layout of the same model: each rank reads the slices of the global tensors its
    #   own layout needs. The vocabulary padding differs between TP sizes; its rows are zero (never
    #   sampled, zero gradient, zero moments), and megatron loads padded tensors of another length as
    #   their common prefix. The distributed optimizer's state is in megatron's `dp_reshardable`
    #   buckets: it loads at any DP size of the saved TP x PP. Optimizer state loads into an optimizer
    #   of the same kind and precision (`_check_optimizer_state`); a model-only checkpoint into any.
    #   A checkpoint saved before the optimizer's first step (every group dropped so far) is model-only
    #   (`_optimizer_has_state`): there is no Adam state to save, and a fresh optimizer is what resumes it.
    def _identity(self) -> dict:
        return checkpoint_identity(self.hf_config, self.layout)

    def _sharded_state_dict(self, loading: bool, with_optimizer: bool = True) -> dict:
        model = self.gpt.sharded_state_dict()
        if not with_optimizer:
            return {"model": model}
        # the distributed optimizer's state in megatron's `dp_reshardable` format (what Megatron-LM saves
        # by default): each rank writes and reads its own shard, no gather; it reloads at another data-
        # parallel size, not at another TP x PP (`load` says so before reading)
        metadata = {"distrib_optim_sharding_type": "dp_reshardable"} if self.distributed_optimizer else None
        if loading:
            self._init_adam_state()
        return {"model": model, "optimizer": self.optimizer.sharded_state_dict(model, is_loading=loading,
                                                                               metadata=metadata)}

    def _optimizer_has_state(self) -> bool:
        """Whether the optimizer has stepped: Adam's state (moments, step) exists from its first step on.
        Before it (a run whose every group was dropped so far) a checkpoint holds the model alone: the
        replicated optimizer would save no moments, which its load then asks for (torch DCP's planner
        raises KeyError), and the distributed one cannot build its state dict without them; a fresh
        optimizer is exactly the one that never stepped. Agreed over every rank (a distributed
        optimizer's rank may hold no shard), as the save's request must be."""
        has = torch.tensor([float(any(opt.optimizer.state for opt in self.optimizer.chained_optimizers))],
                           device=self.device)
        dist.all_reduce(has, op=dist.ReduceOp.MAX)
        return bool(has.item())

    def _distributed_optimizers(self) -> list:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        return [o for o in self.optimizer.chained_optimizers if isinstance(o, DistributedOptimizer)]

    def _init_adam_state(self) -> None:
        """Before building the request that loads a distributed optimizer's state: a fresh optimizer has
        no Adam state yet, and megatron's distributed optimizer (with torch's Adam, where neither Apex nor
        Transformer Engine is installed) asserts on building its state dict without one. Its own remedy:
        one step of zero gradients (what is loaded overwrites every value it sets)."""
        for opt in self._distributed_optimizers():
            if not opt.optimizer.state:
                opt._init_optimizer_states_with_dummy_values()

    def _restore_adam_steps(self) -> None:
        """After a distributed optimizer's state is loaded, with torch's Adam (no Apex or Transformer
        Engine), megatron-core 0.16.1 leaves Adam's step count wrong in two ways: one step tensor is
        shared by every parameter (`DistributedOptimizer.load_state_dict`; torch's Adam adds 1 to it
        per parameter at each step), and its shard loader then copies the step of the state that was
        there before the load over it. The saved count is in the inner optimizer's parameter groups
        (where megatron puts it); each parameter gets its own tensor of it."""
        from megatron.core.optimizer import distrib_optimizer

        if distrib_optimizer.HAVE_APEX_OR_TE:
            return
        for opt in self._distributed_optimizers():
            inner = opt.optimizer
            for group in inner.param_groups:
                for p in group["params"]:
                    if "step" in inner.state.get(p, {}):
                        inner.state[p]["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)

    def save(self, directory: Path) -> None:
        from megatron.core import dist_checkpointing

        directory = Path(directory)
        writer = dist.get_rank() == 0
        # every rank takes part in the export's collectives; only the writer keeps the full tensors (a copy
        # on every rank would hold the whole policy once per rank in host memory)
        tensors = {name: t.to("cpu", copy=True).contiguous() for name, t in self.export_weights() if writer}
        megatron_dir = directory / "megatron"
        if writer:
            save_policy_tensors(checkpoint_policy(directory), tensors, self.hf_config, self.layout.tied)
            megatron_dir.mkdir(parents=True, exist_ok=True)
        del tensors
        dist.barrier()
        start_write_results_queue()
        with_optimizer = self._optimizer_has_state()
        with self._cpu():
            dist_checkpointing.save(self._sharded_state_dict(loading=False, with_optimizer=with_optimizer),
                                    str(megatron_dir))
        dist.barrier()  # every rank's shards are written
        if dist.get_rank() == 0:  # last: its presence says the checkpoint is complete
            l = self.layout
            (megatron_dir / "fastgrpo.json").write_text(json.dumps(
                {"model": self._identity(),
                 "saved_at": saved_at(l, self.dp_size),
                 "updates": self.updates, "precision": self._precision(),
                 "distributed_optimizer": self.distributed_optimizer, "optimizer": with_optimizer}, indent=1))
        dist.barrier()

    def load(self, directory: Path) -> None:
        from megatron.core import dist_checkpointing

        megatron_dir = Path(directory) / "megatron"
        info = megatron_dir / "fastgrpo.json"
        if not info.is_file():
            raise FileNotFoundError(f"{directory} holds no Megatron checkpoint ({info} missing): the Megatron trainer "
                                    f"resumes from checkpoints it saved")
        saved = json.loads(info.read_text())
        if saved["model"] != self._identity():
            diff = {k: (v, self._identity().get(k)) for k, v in saved["model"].items() if self._identity().get(k) != v}
            raise LayoutError(f"the checkpoint {directory} is of another model (saved, this policy): {diff}")
        # a model-only checkpoint (`tools/convert_checkpoint.py hf-to-megatron`, `reshard`, or the trainer's
        # own before its first step) starts a fresh optimizer; the trainer's own checkpoints resume it
        with_optimizer = saved.get("optimizer", True)
        if with_optimizer:
            self._check_optimizer_state(directory, saved)
        with self._cpu():
            # (the optimizer's sharded state dict for loading initialises its state: not asked for here)
            request = (self._sharded_state_dict(loading=True) if with_optimizer
                       else {"model": self.gpt.sharded_state_dict()})
            state = dist_checkpointing.load(request, str(megatron_dir))
            with torch.no_grad():  # (the shard loader copies into views of parameters)
                self.gpt.load_state_dict(state["model"])
                if with_optimizer:
                    self.optimizer.load_state_dict(state["optimizer"])
            if with_optimizer:
                self._restore_adam_steps()
            elif self.compute.dtype != torch.float32:  # fresh main weights: the loaded ones, not the built ones
                self.optimizer.reload_model_params()
        self.updates = saved["updates"]

    def _precision(self) -> str:
        return "bf16" if self.compute.dtype == torch.bfloat16 else "fp32"

    def _check_optimizer_state(self, directory: Path, saved: dict) -> None:
        """A training checkpoint's optimizer state loads into an optimizer of the same kind and precision
        (their state dicts differ: the bf16 optimizer keeps fp32 main weights, the distributed one keeps
        its shards in buckets), and a distributed optimizer's only at the saved TP x PP. Refused before
        anything is read, naming what differs."""
        was = {"precision": saved.get("precision", "fp32"),
               "distributed_optimizer": saved.get("distributed_optimizer", False)}
        now = {"precision": self._precision(), "distributed_optimizer": self.distributed_optimizer}
        differs = {k: (v, now[k]) for k, v in was.items() if now[k] != v}
        hint = (" (its weights alone load through a model-only checkpoint: `python tools/convert_checkpoint.py "
                "reshard`, which starts a fresh optimizer)")
        if differs:
            raise LayoutError(f"the checkpoint {directory} holds the optimizer state of another trainer setting "
                              f"(saved, now: {differs}){hint}")
        at = saved["saved_at"]
        l = self.layout
        # (checkpoints from before parallel.expert_tensor were saved with the experts split over TP)
        now = (l.tensor, l.pipeline, l.expert, l.expert_tp)
        was = (at["tensor"], at["pipeline"], at.get("expert", 1), at.get("expert_tensor", at["tensor"]))
        if self.distributed_optimizer and was != now:
            raise LayoutError(f"the checkpoint {directory} holds a distributed optimizer's state saved at tensor "
                              f"{was[0]} x pipeline {was[1]} x expert {was[2]} x expert tensor {was[3]}: it reloads "
                              f"at another data-parallel size, not at tensor {l.tensor} x pipeline {l.pipeline} x "
                              f"expert {l.expert} x expert tensor {l.expert_tp}{hint}")


def _send_contiguous(gpt) -> None:
    """A stage before the last sends its output to the next stage as it is, and point-to-point sends
    take contiguous tensors only (gloo and NCCL alike). Under sequence parallelism (a mixture of experts
    at TP > 1) on the CPU path the embedding's output [s / TP, b, h] comes back with batch-major
    strides, every layer's residual sum keeps them, and at TP2 x PP2 the send refused it. The output is
    made contiguous (a no-op when it is)."""
    if not gpt.post_process:
        gpt.register_forward_hook(lambda module, inputs, output: output.contiguous())


def _offload_fields(offload: bool, device: torch.device, dtype: torch.dtype, distributed_optimizer: bool) -> dict:
    """megatron-core's `OptimizerConfig` fields of `trainer.optimizer_offload` (none without it), or a
    ValueError saying which of its conditions this trainer does not meet. Read in megatron-core 0.16.1,
    paths under megatron/core/optimizer/:

    - The fields (optimizer_config.py:304-326) as slime and megatron's cpu_offloading/README.md set them:
      `optimizer_cpu_offload`, all of the optimizer state (`optimizer_offload_fraction=1.0`), the
      device-to-host and host-to-device copies overlapped with the host step
      (`overlap_cpu_optimizer_d2h_h2d`), and `use_precision_aware_optimizer`. With offload the latter
      makes the distributed optimizer hand the offloading optimizer its bf16 weight shards instead of
      allocating fp32 main-weight shards on the GPU (optimizer_config.py:355-362; distrib_optimizer.py:
      399, 406-408: "main params are held by FusedAdam"), so main weights and moments both leave the GPU;
      without it a 4 B fp32 main weight per parameter would stay there.
    - `get_megatron_optimizer` builds a `HybridDeviceOptimizer` (__init__.py:306-347): torch's AdamW
      (fused) on the host for the offloaded part, fp32 updates, AdamW mode (decoupled weight decay,
      asserted at __init__.py:312-314; `OptimizerConfig`'s default, as without offload).
    - The distributed optimizer: the precision-aware optimizer asserts it (optimizer_config.py:379-381),
      and only `DistributedOptimizer` rebuilds the offloading optimizer around its own shards
      (distrib_optimizer.py:602-605); `trainer.distributed_optimizer` (config validation refuses first).
    - bf16: in fp32 the distributed optimizer's shards are views of the weights that keep their autograd
      history (distrib_optimizer.py:421, no `detach()`), and the rebuilt offloading optimizer passes them
      through torch's `Optimizer.add_param_group`, which raises "can't optimize a non-leaf Tensor" (run
      here, on CPU; the same views on any device).
    - CUDA: `HybridDeviceOptimizer` offloads by `param.is_cuda` (cpu_offloading/hybrid_optimizer.py:
      256-258, 273): on a CPU nothing is offloaded and every parameter lands in its host group (285-288),
      whose gradient copy then looks each up among the offloaded copies and raises KeyError (99-101; run
      here, in bf16, without the two settings below); the overlapped copies run on `torch.cuda.Stream()`s
      (219-221: "torch.cuda.Stream requires CUDA support" on a CPU build); and the precision-aware
      optimizer compares Transformer Engine's version (optimizer_config.py:383), which a CPU build cannot
      have. On a CPU the optimizer is in host memory already.
    - Transformer Engine, on CUDA too: `is_te_min_version` compares None with a version without it
      (optimizer_config.py:383 -> utils.py:348: TypeError)."""
    if not offload:
        return {}
    if not distributed_optimizer:
        raise ValueError("trainer.optimizer_offload needs the distributed optimizer (trainer.distributed_optimizer="
                         "true): megatron-core offloads its shards (distrib_optimizer.py:602-605), and the precision-"
                         "aware optimizer that keeps the fp32 main weights off the GPU asserts it "
                         "(optimizer_config.py:379-381)")
    if device.type != "cuda":
        raise ValueError(
            "trainer.optimizer_offload cannot run on a CPU build of torch: megatron-core 0.16.1's "
            "HybridDeviceOptimizer chooses what to offload by param.is_cuda (optimizer/cpu_offloading/"
            "hybrid_optimizer.py:256-258, 273), so on a CPU it offloads nothing and puts every parameter in its "
            "host group, whose gradient copy then looks each one up among the offloaded copies and raises KeyError "
            "(hybrid_optimizer.py:99-101); its overlapped copies make torch.cuda.Stream()s (hybrid_optimizer.py:"
            "219-221), and the precision-aware optimizer it needs asks for Transformer Engine (optimizer_config.py:"
            "383). On a CPU the optimizer is in host memory already: trainer.optimizer_offload=false")
    if dtype != torch.bfloat16:
        raise ValueError(f"trainer.optimizer_offload offloads bf16 training's optimizer (trainer.precision=bf16), not "
                         f"{dtype}'s: in fp32 megatron-core 0.16.1's distributed optimizer hands the offloading "
                         f"optimizer views of the weights (distrib_optimizer.py:421), which torch's optimizer refuses "
                         f"(\"can't optimize a non-leaf Tensor\")")
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is None:
        raise ValueError("trainer.optimizer_offload needs Transformer Engine installed: the precision-aware optimizer "
                         "that keeps the fp32 main weights off the GPU checks its version (megatron-core 0.16.1 "
                         "optimizer_config.py:383, a TypeError without it)")
    return dict(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0, overlap_cpu_optimizer_d2h_h2d=True,
                use_precision_aware_optimizer=True)


def _precision_wrapper(gpt):
    """What the schedules run: the GPTModel itself in fp32; in bf16 megatron's Float16Module around it
    (inputs of the first stage cast to bf16, the last stage's logits returned in fp32)."""
    if not gpt.config.bf16:
        return gpt
    from megatron.core.transformer.module import Float16Module

    return Float16Module(gpt.config, gpt)


class _ContiguousGradient(torch.autograd.Function):
    """The identity, whose backward makes the gradient contiguous. megatron's
    `copy_to_tensor_model_parallel_region` all-reduces `grad.contiguous()` in its backward and returns
    `grad` itself: a non-contiguous gradient (the hidden states' comes back through GPTModel's
    transpose) would leave it unreduced, each TP rank with its own vocabulary shard's part alone."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()


def _output_weight(gpt) -> Tensor:
    """The weight the last stage's output layer projects with (this TP rank's vocabulary shard): the
    word embeddings' when they are tied (on the last stage of a pipeline, its copy of them), as
    GPTModel passes it to the layer, else the layer's own."""
    return gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else gpt.output_layer.weight


def _loss_func(on_output: OnOutput, rows: list[int], micro: RolloutBatch, weight: Tensor | None, output: Tensor):
    """megatron's loss function contract (last stage only): (loss, token count, reduced dict). With
    `calculate_per_token_loss` the schedule neither divides the loss by the token count nor by the
    micro-batch count; our loss is already normalised over the whole minibatch. The last stage's
    output (logits, or the hidden states scored in chunks with `weight`) beyond the micro-batch's width
    (sequence-parallel padding) is cut off first."""
    loss = on_output(rows, micro, output[:, : micro.input_ids.shape[1]], weight)
    zero = torch.zeros((), device=output.device)
    return (loss if loss is not None else zero), torch.zeros((), dtype=torch.int, device=output.device), {}


def _finalize_model_grads(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
    """megatron's `finalize_model_grads` (the data-parallel gradient sum, the tied embedding's
    gradient summed over its first and last stage copies) without its division by the token count:
    the loss was normalised before the backward."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
