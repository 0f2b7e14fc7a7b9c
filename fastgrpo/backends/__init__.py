"""The one place a run's backends are built from its config (`trainer.backend`, `engine.backend`).

The loop asks for a `PolicyTrainer` and an `Engine` and uses nothing else of them; a backend's
module is imported only when chosen, so an uninstalled one costs nothing until asked for, and then
fails with the install command.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from transformers import PretrainedConfig, PreTrainedTokenizerBase

from fastgrpo.backends.protocols import Engine, NamedTensors, PolicyTrainer
from fastgrpo.config import Config, ConfigError
from fastgrpo.device import resolve
from fastgrpo.types import SamplingParams


class BackendUnavailable(ImportError):
    """A configured backend whose libraries are not installed."""


def _backend(module: str, key: str, name: str, extra: str | None = None, hint: str | None = None) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        hint = f"; {hint}" if hint else f"; install it with `pip install -e \".[{extra}]\"`" if extra else ""
        raise BackendUnavailable(f"{key}={name} cannot be used here: {e}{hint}") from e


def build_trainer(cfg: Config) -> PolicyTrainer:
    """The configured policy trainer holding the policy of `model.path` (a resume then loads its
    checkpoint over it), with the reference policy when the KL term needs one."""
    name = cfg.trainer.backend
    if name == "torch":
        torch_trainer = _backend("fastgrpo.backends.torch_trainer", "trainer.backend", name)
        from fastgrpo.models.policy import load_policy

        reference = load_policy(cfg.model.path) if cfg.grpo.kl_coef > 0 else None
        return torch_trainer.TorchPolicyTrainer(load_policy(cfg.model.path), cfg.grpo, cfg.optim,
                                                SamplingParams.of(cfg.rollout), reference, resolve(cfg))
    if name == "megatron":
        megatron = _backend("fastgrpo.backends.megatron.trainer", "trainer.backend", name, extra="megatron")
        return megatron.MegatronPolicyTrainer(cfg.model.path, cfg.grpo, cfg.optim, SamplingParams.of(cfg.rollout),
                                              tensor=cfg.parallel.tensor, pipeline=cfg.parallel.pipeline,
                                              seed=cfg.seed, layer_spec=cfg.trainer.layer_spec,
                                              recompute=cfg.trainer.recompute, compute=resolve(cfg),
                                              distributed_optimizer=cfg.trainer.distributed_optimizer)
    if name == "deepspeed":
        _backend("deepspeed", "trainer.backend", name, extra="deepspeed")  # not installed: say how to install it
        from fastgrpo.backends.deepspeed_trainer import DeepSpeedPolicyTrainer

        return DeepSpeedPolicyTrainer(cfg.model.path, cfg.grpo, cfg.optim, SamplingParams.of(cfg.rollout), cfg.deepspeed,
                                      reference_dir=cfg.model.path if cfg.grpo.kl_coef > 0 else None,
                                      compute=resolve(cfg))
    raise ConfigError(f"trainer.backend {name!r} has no builder")


def build_engine(cfg: Config, model_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase,
                 weights: NamedTensors | None = None, speculation: str | None = None) -> Engine:
    """The configured rollout engine for a policy of `model_config`; it holds `weights` if given,
    else it waits for the weight bridge's first push."""
    name = cfg.engine.backend
    if name == "embedded":
        embedded = _backend("fastgrpo.backends.embedded", "engine.backend", name)
        return embedded.build_engine(cfg, model_config, tokenizer, weights, speculation)
    if name == "sglang":
        # not installed: say how (sglang pins its own CUDA torch, which the CPU pin cannot share)
        _backend("sglang", "engine.backend", name, hint="install it on a GPU node with `make install-gpu`")
        from fastgrpo.backends import sglang_engine

        return sglang_engine.build_engine(cfg, model_config, tokenizer, weights, speculation)
    raise ConfigError(f"engine.backend {name!r} has no builder")
