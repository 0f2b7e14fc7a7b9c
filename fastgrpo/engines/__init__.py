"""The rollout engines (embedded on CPU, SGLang on GPU), and the one place a run's engine is built
from its config (`engine.backend`).

The loop asks for an `Engine` (`fastgrpo.protocols`) and uses nothing else of it; an engine's
module is imported only when chosen, so an uninstalled one costs nothing until asked for, and then
fails with the install command.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from fastgrpo.config import Config, ConfigError
from fastgrpo.models.tokenizer import TextFormat
from fastgrpo.protocols import Engine, NamedTensors, import_backend


def build_engine(cfg: Config, model_config: PretrainedConfig, text: TextFormat,
                 weights: NamedTensors | None = None, speculation: str | None = None) -> Engine:
    """The configured rollout engine for a policy of `model_config`; it holds `weights` if given,
    else it waits for the weight bridge's first push; it stops a sequence at any of `text.stop_ids`."""
    name = cfg.engine.backend
    if name == "embedded":
        embedded = import_backend("fastgrpo.engines.embedded.build", "engine.backend", name)
        return embedded.build_engine(cfg, model_config, text, weights, speculation)
    if name == "sglang":
        # not installed: say how (sglang pins its own CUDA torch, which the CPU pin cannot share)
        import_backend("sglang", "engine.backend", name, hint="install it on a GPU node with `make install-gpu`")
        from fastgrpo.engines.sglang import adapter

        return adapter.build_engine(cfg, model_config, text.tokenizer, weights, speculation, stop_ids=text.stop_ids)
    raise ConfigError(f"engine.backend {name!r} has no builder")
