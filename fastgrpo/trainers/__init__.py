"""The policy trainers (torch, DeepSpeed ZeRO, Megatron-core), and the one place a run's trainer is
built from its config (`trainer.backend`).

The loop asks for a `PolicyTrainer` (`fastgrpo.protocols`) and uses nothing else of it; a trainer's
module is imported only when chosen, so an uninstalled one costs nothing until asked for, and then
fails with the install command.
"""

from __future__ import annotations

from fastgrpo.config import Config, ConfigError
from fastgrpo.device import resolve
from fastgrpo.protocols import PolicyTrainer, import_backend
from fastgrpo.types import SamplingParams


def build_trainer(cfg: Config) -> PolicyTrainer:
    """The configured policy trainer holding the policy of `model.path` (a resume then loads its
    checkpoint over it), with the reference policy when the KL term needs one."""
    name = cfg.trainer.backend
    grpo = cfg.grpo.for_rollout(cfg.rollout.max_new_tokens)  # Dr. GRPO's constant: the rollout's token budget
    if name == "torch":
        torch_trainer = import_backend("fastgrpo.trainers.torch_trainer", "trainer.backend", name)
        from fastgrpo.models.policy import load_policy

        reference = load_policy(cfg.model.path) if cfg.grpo.kl_coef > 0 else None
        return torch_trainer.TorchPolicyTrainer(load_policy(cfg.model.path), grpo, cfg.optim,
                                                SamplingParams.of(cfg.rollout), reference, resolve(cfg), cfg.trainer)
    if name == "megatron":
        megatron = import_backend("fastgrpo.trainers.megatron.trainer", "trainer.backend", name, extra="megatron")
        return megatron.MegatronPolicyTrainer(cfg.model.path, grpo, cfg.optim, SamplingParams.of(cfg.rollout),
                                              tensor=cfg.parallel.tensor, pipeline=cfg.parallel.pipeline,
                                              seed=cfg.seed, layer_spec=cfg.trainer.layer_spec,
                                              recompute=cfg.trainer.recompute, compute=resolve(cfg),
                                              distributed_optimizer=cfg.trainer.distributed_optimizer,
                                              expert=cfg.parallel.expert, router_aux_loss=cfg.trainer.router_aux_loss,
                                              router_z_loss=cfg.trainer.router_z_loss,
                                              logits_chunk_tokens=cfg.trainer.logits_chunk_tokens,
                                              routing_replay=cfg.trainer.routing_replay == "rollout",
                                              optimizer_offload=cfg.trainer.optimizer_offload,
                                              expert_tensor=cfg.parallel.expert_tensor)
    if name == "deepspeed":
        import_backend("deepspeed", "trainer.backend", name, extra="deepspeed")  # not installed: say how to install it
        from fastgrpo.trainers.deepspeed_trainer import DeepSpeedPolicyTrainer

        return DeepSpeedPolicyTrainer(cfg.model.path, grpo, cfg.optim, SamplingParams.of(cfg.rollout), cfg.deepspeed,
                                      reference_dir=cfg.model.path if cfg.grpo.kl_coef > 0 else None,
                                      compute=resolve(cfg), trainer=cfg.trainer)
    raise ConfigError(f"trainer.backend {name!r} has no builder")
