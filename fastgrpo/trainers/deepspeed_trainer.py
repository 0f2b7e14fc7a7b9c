"""The DeepSpeed policy trainer: ZeRO (stage 1, 2 or 3) data parallelism of the Hugging Face policy
itself, for policies megatron-core's GPT model does not cover.

It is the torch trainer (the same GRPO step, `grpo.step`, micro-batching, clipping, warm-up and
NaN-skip semantics) with DeepSpeed's engine as the model and optimizer:
- each data-parallel rank scores and trains its share of every minibatch; ranks pad their shares to
  the same number of micro-batches, because ZeRO's collectives run inside forward (stage 3 gathers
  parameters) and backward (stages 2 and 3 reduce gradients);
- the loss of a share is normalised over the whole minibatch and multiplied by the data-parallel
  size, since DeepSpeed averages the ranks' gradients: their sum is the whole minibatch's gradient;
- DeepSpeed's unmanaged gradient accumulation (`managed_gradient_accumulation: false`): backward
  only accumulates, `step()` is the boundary, whatever the number of micro-batches;
- a non-finite gradient norm makes ZeRO skip the update and the warm-up schedule (its overflow
  check, on for fp32), which is the torch trainer's NaN-skip.
A mixture-of-experts policy trains as the torch trainer trains it (its expert load, the optional
load-balancing loss); under ZeRO-3 each sparse block (`models.families.MOE_BLOCKS`) is a leaf of
ZeRO's module hooks (`deepspeed.utils.set_z3_leaf_modules`): all its parameters are gathered when the
block is entered, whichever experts this rank's tokens reach. Without that ZeRO-3 gathers an expert's
weights only when its own module runs, so with per-expert modules (transformers 4's Qwen3-MoE) a rank
whose tokens skip an expert leaves the others waiting in that gather; transformers 5's stacked
experts run as one module, and the leaf costs nothing there but keeps the block's prefetch whole.
On a CPU DeepSpeed runs with its CPU accelerator over gloo (`DS_ACCELERATOR=cpu`, set here when
there is no GPU); its first start compiles a small communication extension (about 30 s, cached in
torch's extension directory afterwards).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from fastgrpo.config import DeepSpeedConfig, GRPOConfig, OptimConfig, TrainerConfig
from fastgrpo.device import Compute
from fastgrpo.models.families import MOE_BLOCKS, checkpoint_tensors
from fastgrpo.models.policy import save_policy_tensors
from fastgrpo.paths import checkpoint_policy
from fastgrpo.trainers.torch_trainer import TorchPolicyTrainer
from fastgrpo.types import Placement, RolloutBatch, SamplingParams

CHECKPOINT_TAG = "state"  # DeepSpeed's tag inside a checkpoint's `deepspeed/` directory
LAYER = re.compile(r"^(.*?layers\.\d+)\.")


def _start_deepspeed():
    """DeepSpeed, imported for this machine's accelerator, and a process group (a world of one when
    the process was started alone)."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    if not dist.is_initialized():  # torchrun's world is made by the loop; a process started alone is one
        from fastgrpo.distributed import COLLECTIVE_TIMEOUT, close_world, free_port

        for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("RANK", "0"),
                           ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
            os.environ.setdefault(key, value)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=COLLECTIVE_TIMEOUT)
        atexit.register(close_world)  # destroyed before the interpreter's finalization, as `init_world`'s are
    deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
    return deepspeed


def ds_config(ds: DeepSpeedConfig, grpo: GRPOConfig, optim: OptimConfig, bf16: bool = False) -> dict:
    """DeepSpeed's config; `bf16`: DeepSpeed's own mixed precision (bf16 weights and activations, fp32
    master weights and optimizer state in its optimizer)."""
    zero: dict = {"stage": ds.zero_stage}
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": grpo.micro_batch_size, "gradient_accumulation_steps": 1,
            "managed_gradient_accumulation": False, "gradient_clipping": optim.grad_clip,
            "zero_optimization": zero, "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
            "steps_per_print": 2**31 - 1, "bf16": {"enabled": bf16}}


class DeepSpeedPolicyTrainer(TorchPolicyTrainer):
    def __init__(self, policy_dir: str | Path, grpo: GRPOConfig, optim: OptimConfig, sampling: SamplingParams,
                 ds: DeepSpeedConfig, reference_dir: str | Path | None = None, compute: Compute | None = None,
                 trainer: TrainerConfig | None = None):
        from fastgrpo.models.policy import load_policy

        deepspeed = _start_deepspeed()
        self.zero_stage = ds.zero_stage
        self.hf_config = None
        model = load_policy(policy_dir)
        self.hf_config = model.config
        reference = load_policy(reference_dir).eval() if reference_dir is not None else None
        compute = compute or Compute(torch.device("cpu"), torch.float32)
        # AdamW and the warm-up schedule over the fp32 model: DeepSpeed casts it for bf16 itself
        super().__init__(model, grpo, optim, sampling, reference, Compute(compute.device, torch.float32), trainer)
        if self.moe and ds.zero_stage == 3:  # before initialize, which registers the hooks
            deepspeed.utils.set_z3_leaf_modules(model, [MOE_BLOCKS[model.config.model_type]])
        # the policy ranks' group is the data-parallel world; torchrun's WORLD_SIZE also counts the draft
        # slice, which ZeRO-3 would take for a misconfigured launch when the policy has one rank
        launched = os.environ.get("WORLD_SIZE")
        os.environ["WORLD_SIZE"] = str(dist.get_world_size())
        try:
            self.model, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=model, optimizer=self.optimizer, lr_scheduler=self.scheduler,
                config=ds_config(ds, grpo, optim, bf16=compute.bf16))
        finally:
            if launched is not None:
                os.environ["WORLD_SIZE"] = launched
        self.model.eval()
        self.dp_rank, self.dp_size = dist.get_rank(), dist.get_world_size()
        self._deepspeed = deepspeed

    # -- this rank's share, in as many micro-batches as every other rank's ----------------------
    def _micro_batches(self, batch: RolloutBatch, rows: list[int]) -> Iterator[tuple[list[int], RolloutBatch]]:
        k, m = len(rows), self.cfg.micro_batch_size
        mine = rows[self.dp_rank * k // self.dp_size: (self.dp_rank + 1) * k // self.dp_size]
        count = torch.tensor([-(-len(mine) // m)], device=self.device)  # NCCL reduces device tensors only
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        yield from super()._micro_batches(batch, mine)
        for _ in range(int(count) - -(-len(mine) // m)):
            empty = batch.select([0])
            empty.response_mask = torch.zeros_like(empty.response_mask)
            yield [], empty

    def _sum(self, t: Tensor) -> Tensor:
        if self.dp_size > 1:
            dist.all_reduce(t)
        return t

    @torch.no_grad()
    def logprobs(self, batch: RolloutBatch, model=None) -> Tensor:
        """The whole batch's log-probabilities on every rank (each rank scores its share)."""
        return self._sum(super().logprobs(batch, model))

    def _backprop(self, loss: Tensor) -> None:
        self.model.backward(loss * self.dp_size, scale_wrt_gas=False)

    def zero_grad(self) -> None:
        """Nothing to do: DeepSpeed's step() zeroes the gradients it applied or skipped."""

    def update(self, loss_finite: bool) -> float | None:
        self.model.step()  # ZeRO skips a non-finite update (and the schedule with it): its overflow check
        return float(self.model.get_global_grad_norm()) if self.model.was_step_applied() else None

    def all_sum(self, t: Tensor) -> Tensor:
        return self._sum(t)

    def placement(self) -> Placement:
        return Placement(self.dp_rank, self.dp_size, leads_replica=True)  # every rank holds the whole policy

    def export_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Hugging Face names and full tensors on every rank (collective); under ZeRO-3 gathered one
        layer at a time, so no rank ever holds the whole model twice."""
        named = self.model.module.state_dict(keep_vars=True)
        groups: dict[str, list[str]] = {}
        for name in named:
            match = LAYER.match(name)
            groups.setdefault(match.group(1) if match else name, []).append(name)
        for names in groups.values():
            params = [named[n] for n in names]
            if self.zero_stage < 3:
                yield from ((n, p.detach()) for n, p in zip(names, params))
                continue
            with self._deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                tensors = [(n, p.detach().clone()) for n, p in zip(names, params)]
            yield from tensors

    # -- checkpoints -------------------------------------------------------------------------
    # A checkpoint directory holds `policy/` (the policy as a Hugging Face directory, written by rank 0
    # from the gathered tensors) and `deepspeed/` (DeepSpeed's own checkpoint: every rank's partition of
    # the model, optimizer and schedule, plus `fastgrpo.json` with the layout it was saved at).
    def save(self, directory: Path) -> None:
        directory = Path(directory)
        # every rank takes part; a mixture of experts' experts one tensor each, the names `save_pretrained`
        # writes (the torch trainer's and Megatron's policy/ hold the same)
        tensors = {name: t.contiguous().clone() for name, t in checkpoint_tensors(self.export_weights())}
        if self.dp_rank == 0:
            save_policy_tensors(checkpoint_policy(directory), tensors, self.hf_config, self.hf_config.tie_word_embeddings)
        del tensors
        self.model.save_checkpoint(str(directory / "deepspeed"), tag=CHECKPOINT_TAG, save_latest=False)
        dist.barrier()
        if self.dp_rank == 0:  # last: its presence says the checkpoint is complete
            (directory / "deepspeed" / "fastgrpo.json").write_text(json.dumps(
                {"zero_stage": self.zero_stage, "data": self.dp_size}, indent=1))
        dist.barrier()

    def load(self, directory: Path) -> None:
        info = Path(directory) / "deepspeed" / "fastgrpo.json"
        if not info.is_file():
            raise FileNotFoundError(f"{directory} holds no DeepSpeed checkpoint ({info} missing): the DeepSpeed "
                                    f"trainer resumes from checkpoints it saved")
        saved = json.loads(info.read_text())
        if (saved["zero_stage"], saved["data"]) != (self.zero_stage, self.dp_size):
            raise ValueError(f"{directory} was saved at ZeRO stage {saved['zero_stage']} with {saved['data']} data-"
                             f"parallel ranks; this run has stage {self.zero_stage} with {self.dp_size} (resume at "
                             f"the same layout, or convert it: tools/convert_checkpoint.py deepspeed-to-hf)")
        path, _ = self.model.load_checkpoint(str(Path(directory) / "deepspeed"), tag=CHECKPOINT_TAG,
                                             load_optimizer_states=True, load_lr_scheduler_states=True)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint in {directory}")
