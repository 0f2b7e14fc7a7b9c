"""Which Hugging Face checkpoints fastgrpo trains and serves, checked once before any work.

fastgrpo computes each supported family itself in every layer (the embedded engine's forward, the
Megatron layer options, conversion's name maps, the planner's parameter count), so a checkpoint is
accepted by its `model_type`, never by running code it ships: a config with `auto_map` (custom modelling
code) is refused, as is any family not listed here. `train`, `sft`, `plan` and `convert` call
`check_family` on the checkpoint's config.json before they build anything, so a wrong checkpoint fails
in the first second with the supported families named, not in the middle of a step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastgrpo.paths import hf_config

# model_type -> the checkpoints people RL-train that it covers (what the error message lists)
SUPPORTED: dict[str, str] = {
    "llama": "Llama 3.x (rope_scaling llama3 or none)",
    "qwen2": "Qwen2.5 (q/k/v biases)",
    "qwen3": "Qwen3 dense (q/k norms, head_dim)",
}


class UnsupportedModel(ValueError):
    """A checkpoint fastgrpo does not compute; the message names the file and the supported families."""


def supported_list() -> str:
    return "; ".join(f"{k}: {v}" for k, v in SUPPORTED.items())


def check_family(config: dict[str, Any], where: str | Path = "config.json") -> str:
    """The checkpoint's family (its model_type), or UnsupportedModel naming the supported ones."""
    if "auto_map" in config:
        raise UnsupportedModel(f"{where} asks for custom modelling code (auto_map {sorted(config['auto_map'])}); "
                               f"fastgrpo runs only the families it implements: {supported_list()}")
    family = config.get("model_type")
    if family not in SUPPORTED:
        raise UnsupportedModel(f"{where}: model_type {family!r} is not supported; fastgrpo runs {supported_list()}")
    return family


def read_config(path: str | Path) -> tuple[dict[str, Any], Path]:
    """config.json of a checkpoint directory (or the file itself) as a dict, unchecked."""
    path = Path(path)
    file = hf_config(path)
    if not file.is_file():
        raise FileNotFoundError(f"no Hugging Face config at {path} (config.json missing)")
    return json.loads(file.read_text()), file


def check_checkpoint(path: str | Path) -> str:
    """The family of the checkpoint at `path` (a directory or its config.json), checked."""
    config, file = read_config(path)
    return check_family(config, file)
