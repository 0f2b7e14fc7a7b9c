"""Writing a source as a Hugging Face directory or a Megatron checkpoint at any TP x PP, and the dry run of
a conversion."""

from __future__ import annotations

import io
import json
import math
import shutil
import sys
from pathlib import Path

import torch
from torch import Tensor

from fastgrpo.trainers.megatron.layout import Layout
from fastgrpo.safetensors_dir import CheckpointError, checksum
from fastgrpo.conversion.files import DTYPES, HF_NON_WEIGHT, SafetensorsWriter, _dtype_name, atomic_dir, write_manifest
from fastgrpo.conversion.sources import keys_map, layout_of


def _copy_non_weights(src: Path, dst: Path) -> None:
    for name in HF_NON_WEIGHT:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def _cast(t: Tensor, dtype: torch.dtype | None) -> Tensor:
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


# -- sinks --------------------------------------------------------------------------------------
def write_hf(source, out: Path, max_shard: int, dtype: torch.dtype | None = None,
             tokenizer: Path | None = None) -> dict:
    """A Hugging Face directory from any source, one Megatron parameter at a time."""
    plan = []
    for name in source.names():
        plan += [(hf, tuple(t.shape), dtype or t.dtype) for hf, t in source.hf_meta(name).items()]
    with atomic_dir(out) as tmp:
        writer = SafetensorsWriter(tmp, plan, max_shard)
        for name in source.names():
            for hf, t in source.hf_group(name).items():
                writer.write(hf, _cast(t, dtype))
        writer.close()
        _copy_non_weights(source.non_weight_dir(), tmp)
        if tokenizer:
            _copy_non_weights(Path(tokenizer), tmp)
            shutil.copy2(source.non_weight_dir() / "config.json", tmp / "config.json")
    return {"tensors": len(plan), "bytes": writer.total, "files": len(writer.files)}


def megatron_plan(source, layout: Layout, dtype: torch.dtype | None = None) -> list[dict]:
    """Every tensor a Megatron checkpoint at `layout` stores: its key, its index in the stack the key
    holds (`Layout.dist_key`: its layer, and an expert's index), stored shape (one slice), dtype and
    the TP pieces, from the source's shapes on the meta device (no weight read)."""
    km = keys_map()
    plan = []
    for name in layout.megatron_names():
        full = layout.to_dist(name, layout.megatron_tensor(name, source.hf_meta(name)))
        key, index = layout.dist_key(name, km)
        plan.append({"name": name, "key": key, "index": index, "shape": tuple(full.shape),
                     "dtype": dtype or full.dtype, "chunks": layout.dist_chunks(name, tuple(full.shape))})
    return plan


def write_megatron(source, out: Path, layout: Layout, dtype: torch.dtype | None = None) -> dict:
    """A model-only Megatron distributed checkpoint (torch_dist) at `layout`, that the Megatron trainer
    loads (`MegatronPolicyTrainer.load`), at this layout or any other: `out/megatron/` and the model's
    config and tokenizer in `out/hf/`. One Megatron parameter (of a mixture of experts: one expert's
    matrix) is held at a time."""
    from torch.distributed.checkpoint import FileSystemWriter, save
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    from fastgrpo.trainers.megatron.checkpoint import checkpoint_identity, saved_at

    plan = megatron_plan(source, layout, dtype)
    items, owner = [], {}
    for p in plan:
        lead = p["index"]
        size = torch.Size((*layout.dist_stack(lead), *p["shape"]))
        for offsets, sizes in p["chunks"]:
            off = torch.Size((*lead, *offsets))
            sz = torch.Size((*[1] * len(lead), *sizes))
            index = MetadataIndex(p["key"], off)
            items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(off, sz), properties=TensorProperties(dtype=p["dtype"]), size=size)))
            owner[(p["key"], tuple(off))] = (p, offsets, sizes)
    for key in layout.extra_state_keys():  # the linear layers' (empty) extra state, as megatron saves it
        items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
    manifest: dict[str, dict] = {}
    current: dict = {"name": None, "full": None}
    failed: list[CheckpointError] = []

    class Lazy(DefaultSavePlanner):
        """Hands the writer each piece when it asks for it: one full tensor is held at a time."""

        def create_local_plan(self):
            self.plan = SavePlan(items)
            return self.plan

        def resolve_data(self, write_item):
            try:
                return self._resolve(write_item)
            except CheckpointError as e:  # torch.distributed.checkpoint wraps what it catches: keep ours
                failed.append(e)
                raise

        def _resolve(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                buf = io.BytesIO()
                torch.save([None], buf)
                buf.seek(0)
                return buf
            p, offsets, sizes = owner[(write_item.index.fqn, tuple(write_item.index.offset))]
            if current["name"] != p["name"]:
                current["full"] = None
                group = {k: _cast(v, dtype) for k, v in source.hf_group(p["name"]).items()}
                for hf, t in group.items():
                    manifest[hf] = {"shape": list(t.shape), "dtype": _dtype_name(t.dtype), "sha256": checksum(t)}
                current["name"], current["full"] = p["name"], layout.to_dist(p["name"], layout.megatron_tensor(p["name"], group))
            piece = current["full"]
            for d, (o, s) in enumerate(zip(offsets, sizes)):
                piece = piece.narrow(d, o, s)
            return piece.reshape(*[1] * len(p["index"]), *piece.shape)

    with atomic_dir(out) as tmp:
        mdir = tmp / "megatron"
        mdir.mkdir()
        class Writer(FileSystemWriter):
            def storage_meta(self):  # not the temporary directory's absolute path, which the rename makes stale
                return None

        try:
            save({}, storage_writer=Writer(str(mdir), single_file_per_rank=True, thread_count=1),
                 planner=Lazy(flatten_state_dict=False, flatten_sharded_tensors=False), no_dist=True)
        except BaseException:  # CheckpointException is one
            if failed:
                raise failed[0] from None
            raise
        current["full"] = None
        (mdir / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                        "common_backend": "torch", "common_backend_version": 1}))
        torch.save({}, mdir / "common.pt")
        write_manifest(mdir, "megatron", manifest)
        (mdir / "fastgrpo.json").write_text(json.dumps(
            {"model": checkpoint_identity(source.config, layout),
             "saved_at": saved_at(layout, data=1),
             "updates": 0, "optimizer": False,
             "written_by": "tools/convert_checkpoint.py"}, indent=1))
        hf = tmp / "hf"
        hf.mkdir()
        _copy_non_weights(source.non_weight_dir(), hf)
        total = sum(f.stat().st_size for f in mdir.iterdir())
    return {"tensors": len(plan), "pieces": len(items), "bytes": total}


# -- dry run on the meta device ------------------------------------------------------------------
class MetaSource:
    """A model's Hugging Face tensors on the meta device, from its config alone (dry runs)."""

    kind = "meta"

    def __init__(self, config):
        from transformers import AutoModelForCausalLM

        self.config = config
        self.layout = layout_of(config)
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
        from fastgrpo.models.families import checkpoint_tensors

        with torch.device("meta"):  # under a checkpoint's names (a mixture of experts: each expert's own)
            self.state = {k: v.to(dtype) for k, v in
                          checkpoint_tensors(AutoModelForCausalLM.from_config(config).state_dict().items())}

    def names(self) -> list[str]:
        return self.layout.megatron_names()

    def hf_meta(self, name: str) -> dict[str, Tensor]:
        return {k: self.state[k] for k in self.layout.hf_sources(name)}


def dry_run(config, tensor: int = 1, pipeline: int = 1, dtype: torch.dtype | None = None, out=None,
            expert: int = 1, expert_tensor: int = 0) -> dict:
    """Every tensor a conversion to `tensor` x `pipeline` writes (shape, each rank's piece) and the bytes
    each rank holds (`per_rank`, keyed tp{rank}_pp{stage}), computed by the conversion's own code on the
    meta device. A mixture of experts at expert-parallel size `expert`: each rank holds E / expert of
    each layer's experts (counted for EP rank 0; every EP rank holds as many), each split over TP or, at
    `expert_tensor` 1, whole (the per-TP-rank column shows the expert-tensor rank's piece)."""
    out = out or sys.stdout
    source = MetaSource(config)
    layout = layout_of(config, tensor, pipeline, expert, expert_tensor)
    per_rank = {(t, p): 0 for p in range(pipeline) for t in range(tensor)}
    print(f"{'tensor':<52} {'dtype':<9} {'full shape':<14} {'per-TP-rank':<14} stage", file=out)
    for name in layout.megatron_names():
        full = layout.megatron_tensor(name, source.hf_meta(name))
        if dtype is not None:
            full = full.to(dtype)
        stages = [s for s in range(pipeline) if any(layout.stage_name(name, s, e) is not None for e in range(expert))]
        if layout.tied and pipeline > 1 and name == "embedding.word_embeddings.weight":
            stages.append(pipeline - 1)  # the last stage's copy for the LM head
        piece = layout.shard(name, full, 0)
        for s in stages:
            if layout.stage_name(name, s, 0) is None and not (layout.tied and name.startswith("embedding.")):
                continue  # an expert of another EP rank
            for t in range(tensor):
                per_rank[(t, s)] += piece.numel() * piece.element_size()
        print(f"{name:<52} {_dtype_name(full.dtype):<9} {'x'.join(map(str, full.shape)):<14} "
              f"{'x'.join(map(str, piece.shape)):<14} {','.join(map(str, stages))}", file=out)
    total = sum(math.prod(t.shape) * t.element_size() for t in source.state.values()
                if not (layout.tied and t is source.state.get("lm_head.weight")))
    ep_label = (f" x EP{expert}" if expert > 1 else "") + (" (experts whole: ETP1)" if layout.expert_tp != tensor else "")
    print(f"\nbytes per rank at TP{tensor} x PP{pipeline}{ep_label} (vocabulary padded to {layout.padded_vocab}; every "
          f"TP{' and EP' if expert > 1 else ''} rank of a stage holds the same):", file=out)
    for s in range(pipeline):
        b = {per_rank[(t, s)] for t in range(tensor)}
        print(f"  stage {s} (layers {layout.stage_layers(s).start}-{layout.stage_layers(s).stop - 1}): "
              f"{max(b):,} bytes = {max(b) / 2**30:.2f} GiB on each of its {tensor} TP ranks", file=out)
    print(f"model: {sum(v.numel() for v in source.state.values()) / 1e9:.2f}B parameters "
          f"({total / 2**30:.1f} GiB as {_dtype_name(next(iter(source.state.values())).dtype)}); "
          f"largest rank {max(per_rank.values()) / 2**30:.2f} GiB", file=out)
    return {"per_rank": {f"tp{t}_pp{s}": b for (t, s), b in per_rank.items()}, "model_bytes": total}


# -- verify, inspect ---------------------------------------------------------------------------
