"""Checkpoints as sources of Hugging Face tensors: a Hugging Face directory or a Megatron torch_dist
checkpoint, read one parameter at a time."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import torch
from torch import Tensor

from fastgrpo.models.families import UnsupportedModel, check_family
from fastgrpo.paths import DRAFT_CONFIG, checkpoint_policy, has_draft, hf_config, is_policy
from fastgrpo.trainers.megatron.layout import Layout, LayoutError
from fastgrpo.safetensors_dir import Checker, CheckpointError, SafetensorsDir, read_manifest


def load_config(path: Path):
    """A Hugging Face config from a directory or a config.json file, never with remote code."""
    from transformers import AutoConfig

    path = Path(path)
    file = hf_config(path)
    if not file.is_file():
        raise CheckpointError(f"no Hugging Face config at {path} (config.json missing)")
    raw = json.loads(file.read_text())
    try:  # the one rule of which checkpoints fastgrpo runs (custom code and unknown families refused)
        check_family(raw, file)
    except UnsupportedModel as e:
        raise CheckpointError(str(e)) from e
    return AutoConfig.for_model(**raw)


def layout_of(config, tensor: int = 1, pipeline: int = 1, expert: int = 1, expert_tensor: int = 0) -> Layout:
    """The Megatron layout a conversion writes or reads at (`expert_tensor`: the experts' tensor-parallel
    size, 0 meaning `tensor`), its refusal a CheckpointError."""
    try:
        return Layout.of(config, tensor, pipeline, expert, expert_tensor=expert_tensor)
    except LayoutError as e:
        raise CheckpointError(str(e)) from e


def keys_map() -> dict[str, str]:
    """megatron's local-spec norm names -> the fused names its distributed checkpoints use (megatron's
    own map, as the trainer's checkpoints are written with it)."""
    from megatron.core.models.gpt import gpt_layer_specs

    return dict(gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm").submodules.sharded_state_dict_keys_map)



class _MetadataUnpickler(pickle.Unpickler):
    """Only what a torch_dist `.metadata` holds: torch.distributed.checkpoint's metadata classes,
    torch.Size and dtypes. Anything else (code a checkpoint from elsewhere could carry) is refused."""

    def find_class(self, module: str, name: str):
        if module.startswith("torch.distributed.checkpoint.") or (module, name) in (
                ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise CheckpointError(f"the checkpoint's .metadata refers to {module}.{name}: not a torch_dist metadata "
                              f"class, refused")


def dcp_reader(directory: Path):
    from torch.distributed.checkpoint import FileSystemReader

    class Reader(FileSystemReader):
        _metadata = None

        def read_metadata(self, *args, **kwargs):
            if self._metadata is None:
                with open(Path(self.path) / ".metadata", "rb") as f:
                    self._metadata = _MetadataUnpickler(f).load()
            return self._metadata

    return Reader(str(directory))


# -- sources: anything tensors are read from, one Megatron parameter at a time -------------------
class HFSource:
    """A Hugging Face directory: config.json and model.safetensors or sharded safetensors + index."""

    kind = "hf"

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{path} is not a directory")
        self.config = load_config(self.path)
        self.layout = layout_of(self.config)
        self.tensors = SafetensorsDir(self.path)
        self.check, self.files = self.tensors.check, self.tensors.files

    def names(self) -> list[str]:
        return self.layout.megatron_names()

    def hf_meta(self, name: str) -> dict[str, Tensor]:
        return {hf: self.tensors.meta(hf) for hf in self.layout.hf_sources(name)}

    def hf_group(self, name: str) -> dict[str, Tensor]:
        return {hf: self.tensors[hf] for hf in self.layout.hf_sources(name)}

    def non_weight_dir(self) -> Path:
        return self.path


class MegatronSource:
    """A Megatron distributed checkpoint: a training checkpoint (`step_N/` with `megatron/` and
    `policy/`) or a converted one (`megatron/` and `hf/`), or its `megatron/` directory itself."""

    kind = "megatron"

    def __init__(self, path: Path):
        path = Path(path)
        root = path.parent if (path / "fastgrpo.json").is_file() and not (path / "megatron").is_dir() else path
        self.root, self.dir = root, root / "megatron"
        info = self.dir / "fastgrpo.json"
        if not info.is_file():
            raise CheckpointError(f"{path} is not a Megatron checkpoint of this project ({info} missing)")
        self.info = json.loads(info.read_text())
        hf = next((d for d in (root / "hf", checkpoint_policy(root)) if is_policy(d)), None)
        if hf is None:
            raise CheckpointError(f"{root}: no Hugging Face config next to the Megatron checkpoint (hf/ or policy/)")
        self.hf_dir = hf
        self.config = load_config(hf)
        saved = self.info["saved_at"]
        self.layout = layout_of(self.config, saved["tensor"], saved["pipeline"], saved.get("expert", 1),
                                saved.get("expert_tensor", 0))  # (0, the experts split over TP: older checkpoints)
        from fastgrpo.trainers.megatron.checkpoint import checkpoint_identity

        identity = checkpoint_identity(self.config, self.layout)
        if self.info["model"] != identity:
            diff = {k: (v, identity.get(k)) for k, v in self.info["model"].items() if identity.get(k) != v}
            raise CheckpointError(f"{root}: the Megatron checkpoint is of another model than {hf}/config.json "
                                  f"(checkpoint, config): {diff}")
        if not (self.dir / ".metadata").is_file():
            raise CheckpointError(f"{self.dir}: .metadata missing (not a torch_dist checkpoint, or incomplete)")
        self.reader = dcp_reader(self.dir)
        self.metadata = self.reader.read_metadata()
        files = sorted({s.relative_path for s in self.metadata.storage_data.values()})
        missing = [f for f in files if not (self.dir / f).is_file()]
        if missing:
            raise CheckpointError(f"{self.dir}: missing shard file(s) {', '.join(missing)}")
        self.files = [self.dir / f for f in files]
        self.keys_map = keys_map()
        self.check = Checker(self.dir, read_manifest(self.dir))

    def names(self) -> list[str]:
        return self.layout.megatron_names()

    def _stored(self, name: str):
        """The stored tensor's key, `name`'s index in its stack (`Layout.dist_key`) and its metadata."""
        key, index = self.layout.dist_key(name, self.keys_map)
        md = self.metadata.state_dict_metadata.get(key)
        if md is None or not hasattr(md, "chunks"):
            raise CheckpointError(f"{self.dir}: tensor {key} (of {name}) is missing from the checkpoint")
        return key, index, md

    def _stored_meta(self, name: str) -> Tensor:
        key, index, md = self._stored(name)
        return torch.empty(tuple(md.size)[len(index):], dtype=md.properties.dtype, device="meta")

    def hf_meta(self, name: str) -> dict[str, Tensor]:
        return self._to_hf(name, self.layout.from_dist(name, self._stored_meta(name)))

    def _to_hf(self, name: str, full: Tensor) -> dict[str, Tensor]:
        out = dict(self.layout.to_hf(name, full))
        if self.layout.tied:
            out.pop("lm_head.weight", None)  # the embedding: Hugging Face ties it
        return out

    def hf_group(self, name: str) -> dict[str, Tensor]:
        from torch.distributed.checkpoint import load
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
        from torch.distributed._shard._utils import narrow_tensor_by_index

        key, index, md = self._stored(name)
        sizes = (*[1] * len(index), *tuple(md.size)[len(index):])
        offsets = (*index, *[0] * (len(md.size) - len(index)))
        if tuple(md.size)[:len(index)] != self.layout.dist_stack(index):
            raise CheckpointError(f"{self.dir}: {key} is stacked as {tuple(md.size)[:len(index)]} (layers"
                                  f"{', experts' if len(index) > 1 else ''}), the config as "
                                  f"{self.layout.dist_stack(index)}")
        dest = torch.empty(sizes, dtype=md.properties.dtype)
        covered = [0]

        class Region(DefaultLoadPlanner):  # one slice of one stored tensor, pieced from its chunks
            def create_local_plan(self):
                items = create_read_items_for_chunk_list(
                    key, md, [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))])
                covered[0] = sum(math.prod(i.lengths) for i in items)
                return LoadPlan(items)

            def resolve_tensor(self, read_item):
                return narrow_tensor_by_index(dest, read_item.dest_offsets, read_item.lengths)

        try:
            load({key: dest}, storage_reader=self.reader, planner=Region(allow_partial_load=True), no_dist=True)
        except (Exception, CheckpointException) as e:  # torch.distributed.checkpoint wraps the reader's errors
            raise CheckpointError(f"{self.dir}: reading {key} failed (a missing or corrupt shard file?): "
                                  f"{str(e).strip().splitlines()[-1]}") from e
        if covered[0] != dest.numel():
            raise CheckpointError(f"{self.dir}: the stored chunks of {key} do not cover {name}: missing shards")
        full = self.layout.from_dist(name, dest.reshape(tuple(md.size)[len(index):]))
        group = self._to_hf(name, full)
        for hf, t in group.items():
            self.check(hf, t)
        return group

    def non_weight_dir(self) -> Path:
        return self.hf_dir


def open_checkpoint(path: Path) -> HFSource | MegatronSource:
    """A source of any kind, told apart by what the directory holds."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if (path / "megatron" / "fastgrpo.json").is_file() or (path / "fastgrpo.json").is_file():
        return MegatronSource(path)
    if is_policy(path):
        return HFSource(path)
    if has_draft(path) or (path / DRAFT_CONFIG).is_file():
        raise CheckpointError(f"{path} is a draft head, not a policy checkpoint (use export-draft)")
    raise CheckpointError(f"{path} is neither a Hugging Face directory (config.json) nor a Megatron checkpoint "
                          f"(megatron/fastgrpo.json)")
