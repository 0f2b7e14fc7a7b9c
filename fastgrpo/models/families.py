"""Which Hugging Face checkpoints fastgrpo trains and serves, checked once before any work.

fastgrpo computes each supported family itself in every layer (the embedded engine's forward, the
Megatron layer options, conversion's name maps, the planner's parameter count), so a checkpoint is
accepted by its `model_type`, never by running code it ships: a config with `auto_map` (custom modelling
code) is refused, as is any family not listed here. `train`, `sft`, `plan` and `convert` call
`check_family` on the checkpoint's config.json before they build anything, so a wrong checkpoint fails
in the first second with the supported families named, not in the middle of a step.

Qwen3-MoE is served by the embedded engine and SGLang and trained by every trainer (torch and
DeepSpeed: the Hugging Face model computes its experts; Megatron: megatron-core's MoE layer).

Experts: transformers 5 holds each sparse layer's experts stacked (`mlp.experts.gate_up_proj`
[E, 2 x moe_intermediate_size, hidden], gate rows first, and `mlp.experts.down_proj` [E, hidden,
moe_intermediate_size]), which is what a trainer's state dict and so its push carry; checkpoints on
disk (what `save_pretrained` writes) and SGLang's `load_weights` name each expert's own matrices
(`mlp.experts.{j}.gate_proj.weight`, `up_proj`, `down_proj`). `checkpoint_tensors` turns the first
into the second.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastgrpo.paths import hf_config

if TYPE_CHECKING:
    from torch import Tensor

# model_type -> the checkpoints people RL-train that it covers (what the error message lists)
SUPPORTED: dict[str, str] = {
    "llama": "Llama 3.x (rope_scaling llama3 or none)",
    "qwen2": "Qwen2.5 (q/k/v biases)",
    "qwen3": "Qwen3 dense (q/k norms, head_dim)",
    "qwen3_moe": "Qwen3-MoE (top-k experts, no shared expert)",
}

# model_type -> the class name of its sparse (mixture-of-experts) block in transformers' modelling code:
# the module whose router the trainers read and which DeepSpeed ZeRO-3 gathers as one leaf
MOE_BLOCKS: dict[str, str] = {"qwen3_moe": "Qwen3MoeSparseMoeBlock"}

_STACKED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


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


def checkpoint_tensors(named_tensors: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """The tensors under the names a Hugging Face checkpoint on disk holds: transformers 5's stacked
    experts split into each expert's gate, up and down matrices (views, no copy), in expert order;
    every other tensor as it is. The split is transformers' own: expert j's `gate_proj.weight` is
    `gate_up_proj[j]`'s first half of rows, `up_proj.weight` its second, `down_proj.weight` is
    `down_proj[j]` (tests/test_moe_trainers.py checks it against `save_pretrained`)."""
    for name, t in named_tensors:
        match = _STACKED_EXPERTS.match(name)
        if match is None:
            yield name, t
            continue
        prefix, kind = match.groups()
        for j in range(t.shape[0]):
            if kind == "down_proj":
                yield f"{prefix}.{j}.down_proj.weight", t[j]
            else:
                gate, up = t[j].chunk(2, dim=0)
                yield f"{prefix}.{j}.gate_proj.weight", gate
                yield f"{prefix}.{j}.up_proj.weight", up
