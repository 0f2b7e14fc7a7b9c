"""Checkpoint conversion: Hugging Face <-> Megatron distributed checkpoints at any TP x PP, reshard,
verify, inspect, and the draft head exported for SGLang.

    python tools/convert_checkpoint.py SUBCOMMAND --help

Why it looks the way it does:
- One name/layout mapping: every tensor goes through `fastgrpo.backends.megatron.layout.Layout`, the
  one the Megatron trainer loads and exports with; nothing here knows a parameter name of its own.
- Streaming: a 70B model never fits a login node's memory, so tensors are read and written one
  Megatron parameter at a time (the Hugging Face tensors it is made of, the full tensor, one rank's
  piece). Safetensors are read with plain file reads (no mmap that would keep every page touched
  resident) and written by a streaming writer (the shard's header is known from the plan before any
  data), Megatron's torch_dist checkpoints through torch.distributed.checkpoint with a planner that
  materialises each piece only when the writer asks for it and reads one layer's slice at a time.
- Safety: safetensors only (a `.bin` is refused, never unpickled); a Megatron checkpoint's
  `.metadata` is read by an unpickler that admits only torch.distributed.checkpoint's metadata
  classes, and its tensors with `weights_only`; no `trust_remote_code`. Every output is written to a
  temporary directory next to it and renamed at the end, with a manifest of per-tensor sha256
  checksums (`fastgrpo-manifest.json`, keyed by Hugging Face names whatever the kind) that every
  command checks when it reads the checkpoint back.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import math
import os
import pickle
import re
import shutil
import struct
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import Tensor

if __package__ in (None, ""):  # run as `python tools/convert_checkpoint.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastgrpo.backends.megatron.layout import LAYER, Layout, LayoutError  # noqa: E402

MANIFEST = "fastgrpo-manifest.json"
INDEX = "model.safetensors.index.json"
HF_NON_WEIGHT = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")
ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LINEAR_EXTRA_STATE = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")


class ConversionError(Exception):
    """Bad input or a checkpoint that is not what it says: the message names the problem."""


# -- small helpers ----------------------------------------------------------------------------
def _bytes_of(t: Tensor) -> memoryview:
    """A tensor's bytes without a copy (contiguous tensors; any dtype)."""
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def checksum(t: Tensor) -> str:
    return hashlib.sha256(_bytes_of(t)).hexdigest()


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a byte count."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?i?B?)?\s*", text, re.I)
    if not m:
        raise ConversionError(f"not a size: {text!r} (e.g. 5GB, 500MB)")
    unit = (m.group(2) or "").upper().rstrip("B")
    base = 1024 if unit.endswith("I") else 1000
    return int(float(m.group(1)) * base ** " KMGT".index((unit.rstrip("I") or " ")))


def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


@contextlib.contextmanager
def atomic_dir(out: Path) -> Iterator[Path]:
    """A temporary directory next to `out`, renamed to `out` if the block succeeds and removed if it
    does not: an output directory either is complete or does not exist."""
    out = Path(out)
    if out.exists():
        raise ConversionError(f"{out} already exists: remove it or choose another output directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        yield tmp
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_config(path: Path):
    """A Hugging Face config from a directory or a config.json file, never with remote code."""
    from transformers import AutoConfig

    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ConversionError(f"no Hugging Face config at {path} (config.json missing)")
    raw = json.loads(file.read_text())
    if "auto_map" in raw:
        raise ConversionError(f"{file} asks for remote code (auto_map); only built-in architectures are converted")
    if raw.get("model_type") not in ("llama", "qwen2"):
        raise ConversionError(f"{file}: architecture {raw.get('model_type')!r} is not supported (llama, qwen2)")
    return AutoConfig.for_model(**raw)


def layout_of(config, tp: int = 1, pp: int = 1) -> Layout:
    try:
        return Layout.of(config, tp, pp)
    except LayoutError as e:
        raise ConversionError(str(e)) from e


def keys_map() -> dict[str, str]:
    """megatron's local-spec norm names -> the fused names its distributed checkpoints use (megatron's
    own map, as the trainer's checkpoints are written with it)."""
    from megatron.core.models.gpt import gpt_layer_specs

    return dict(gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm").submodules.sharded_state_dict_keys_map)


def read_manifest(directory: Path) -> dict | None:
    f = Path(directory) / MANIFEST
    return json.loads(f.read_text())["tensors"] if f.is_file() else None


def write_manifest(directory: Path, kind: str, tensors: dict[str, dict]) -> None:
    (Path(directory) / MANIFEST).write_text(json.dumps(
        {"format": 1, "kind": kind, "checksum": "sha256", "tensors": tensors}, indent=1))


class Checker:
    """Checks each tensor read against the checkpoint's manifest (if it has one)."""

    def __init__(self, where: Path, manifest: dict | None):
        self.where, self.manifest, self.seen = where, manifest, set()

    def __call__(self, name: str, t: Tensor) -> None:
        if self.manifest is None:
            return
        entry = self.manifest.get(name)
        if entry is None:
            raise ConversionError(f"{self.where}: tensor {name} is not in its manifest ({MANIFEST})")
        if checksum(t) != entry["sha256"]:
            raise ConversionError(f"{self.where}: checksum mismatch for tensor {name}: the data does not match "
                                  f"its manifest ({MANIFEST}); the checkpoint is corrupt")
        self.seen.add(name)


# -- safetensors, streamed ----------------------------------------------------------------------
def read_safetensors_header(file: Path) -> tuple[dict, int]:
    """(header, where the data starts) of a safetensors file, checked against the file's size."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ConversionError(f"{file} is not a safetensors file (truncated)")
        n = struct.unpack("<Q", raw)[0]
        if n > min(size - 8, 100_000_000):
            raise ConversionError(f"{file} is not a safetensors file (header of {n} bytes)")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if 8 + n + end > size:
        raise ConversionError(f"{file} is truncated: its header describes {8 + n + end} bytes, the file has {size}")
    return header, 8 + n


def read_safetensor(file: Path, entry: dict, start: int) -> Tensor:
    """One tensor, by a plain read into a fresh tensor (no mmap)."""
    if entry["dtype"] not in ST_DTYPES:
        raise ConversionError(f"{file}: dtype {entry['dtype']} is not supported")
    t = torch.empty(entry["shape"], dtype=ST_DTYPES[entry["dtype"]])
    b, e = entry["data_offsets"]
    if e - b != t.numel() * t.element_size():
        raise ConversionError(f"{file}: a tensor's byte range does not match its shape")
    with open(file, "rb") as f:
        f.seek(start + b)
        if t.numel() and f.readinto(_bytes_of(t)) != e - b:
            raise ConversionError(f"{file} is truncated")
    return t


class SafetensorsWriter:
    """Writes a planned list of tensors (name, shape, dtype) as sharded safetensors, each tensor as it
    arrives, in plan order: the headers are known from the plan, so only one tensor is ever held."""

    def __init__(self, directory: Path, plan: list[tuple[str, tuple[int, ...], torch.dtype]], max_shard: int):
        self.dir = Path(directory)
        shards: list[list] = [[]]
        used = 0
        for name, shape, dtype in plan:
            nbytes = math.prod(shape) * dtype.itemsize
            if shards[-1] and used + nbytes > max_shard:
                shards.append([])
                used = 0
            shards[-1].append((name, shape, dtype, nbytes))
            used += nbytes
        self.total = sum(x[3] for s in shards for x in s)
        n = len(shards)
        self.files = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self.where = {x[0]: (i, x) for i, s in enumerate(shards) for x in s}
        self.order = [x[0] for s in shards for x in s]
        self.shards, self.pos, self.handle, self.current = shards, 0, None, -1
        self.manifest: dict[str, dict] = {}

    def _open(self, i: int) -> None:
        if self.handle:
            self.handle.close()
        header, offset = {}, 0
        for name, shape, dtype, nbytes in self.shards[i]:
            header[name] = {"dtype": ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.handle = open(self.dir / self.files[i], "wb")
        self.handle.write(struct.pack("<Q", len(raw)) + raw)
        self.current = i

    def write(self, name: str, t: Tensor) -> None:
        if self.pos >= len(self.order) or self.order[self.pos] != name:
            raise RuntimeError(f"tensor {name} out of plan order")
        i, (_, shape, dtype, nbytes) = self.where[name]
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise RuntimeError(f"tensor {name}: {tuple(t.shape)} {t.dtype}, planned {shape} {dtype}")
        if i != self.current:
            self._open(i)
        data = _bytes_of(t)
        self.handle.write(data)
        self.manifest[name] = {"shape": list(shape), "dtype": _dtype_name(dtype),
                               "sha256": hashlib.sha256(data).hexdigest()}
        self.pos += 1

    def close(self) -> None:
        if self.pos != len(self.order):
            raise RuntimeError(f"{len(self.order) - self.pos} planned tensors never written")
        if self.handle:
            self.handle.close()
        if len(self.files) > 1:
            (self.dir / INDEX).write_text(json.dumps({
                "metadata": {"total_size": self.total},
                "weight_map": {name: self.files[i] for name, (i, _) in self.where.items()}}, indent=1))
        write_manifest(self.dir, "hf", self.manifest)


# -- torch.distributed.checkpoint, restricted ------------------------------------------------------
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
        raise ConversionError(f"the checkpoint's .metadata refers to {module}.{name}: not a torch_dist metadata "
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
            raise ConversionError(f"{path} is not a directory")
        self.config = load_config(self.path)
        self.layout = layout_of(self.config)
        if (self.path / INDEX).is_file():
            weight_map = json.loads((self.path / INDEX).read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (self.path / f).is_file()]
            if missing:
                raise ConversionError(f"{self.path}: missing shard(s) {', '.join(missing)} listed in {INDEX}")
        elif (self.path / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            pickled = [p.name for p in self.path.glob("*.bin")] + [p.name for p in self.path.glob("*.pt*")]
            raise ConversionError(f"{self.path} holds no safetensors weights" + (
                f" (found {', '.join(pickled)}: pickled checkpoints are never read; convert them to safetensors "
                f"where they were made)" if pickled else ""))
        self.entries: dict[str, tuple[Path, dict, int]] = {}
        for f in files:
            header, start = read_safetensors_header(self.path / f)
            for name, entry in header.items():
                self.entries[name] = (self.path / f, entry, start)
        self.check = Checker(self.path, read_manifest(self.path))
        self.files = [self.path / f for f in files]

    def names(self) -> list[str]:
        return self.layout.megatron_names()

    def _entry(self, hf_name: str) -> tuple[Path, dict, int]:
        if hf_name not in self.entries:
            raise ConversionError(f"{self.path}: tensor {hf_name} is missing from the checkpoint")
        return self.entries[hf_name]

    def hf_meta(self, name: str) -> dict[str, Tensor]:
        out = {}
        for hf in self.layout.hf_sources(name):
            _, entry, _ = self._entry(hf)
            out[hf] = torch.empty(entry["shape"], dtype=ST_DTYPES[entry["dtype"]], device="meta")
        return out

    def hf_group(self, name: str) -> dict[str, Tensor]:
        out = {}
        for hf in self.layout.hf_sources(name):
            t = read_safetensor(*self._entry(hf))
            self.check(hf, t)
            out[hf] = t
        return out

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
            raise ConversionError(f"{path} is not a Megatron checkpoint of this project ({info} missing)")
        self.info = json.loads(info.read_text())
        hf = next((d for d in (root / "hf", root / "policy") if (d / "config.json").is_file()), None)
        if hf is None:
            raise ConversionError(f"{root}: no Hugging Face config next to the Megatron checkpoint (hf/ or policy/)")
        self.hf_dir = hf
        self.config = load_config(hf)
        saved = self.info["saved_at"]
        self.layout = layout_of(self.config, saved["tensor"], saved["pipeline"])
        from fastgrpo.backends.megatron.trainer import checkpoint_identity

        identity = checkpoint_identity(self.config, self.layout)
        if self.info["model"] != identity:
            diff = {k: (v, identity.get(k)) for k, v in self.info["model"].items() if identity.get(k) != v}
            raise ConversionError(f"{root}: the Megatron checkpoint is of another model than {hf}/config.json "
                                  f"(checkpoint, config): {diff}")
        if not (self.dir / ".metadata").is_file():
            raise ConversionError(f"{self.dir}: .metadata missing (not a torch_dist checkpoint, or incomplete)")
        self.reader = dcp_reader(self.dir)
        self.metadata = self.reader.read_metadata()
        files = sorted({s.relative_path for s in self.metadata.storage_data.values()})
        missing = [f for f in files if not (self.dir / f).is_file()]
        if missing:
            raise ConversionError(f"{self.dir}: missing shard file(s) {', '.join(missing)}")
        self.files = [self.dir / f for f in files]
        self.keys_map = keys_map()
        self.check = Checker(self.dir, read_manifest(self.dir))

    def names(self) -> list[str]:
        return self.layout.megatron_names()

    def _stored(self, name: str):
        key, layer = self.layout.dist_key(name, self.keys_map)
        md = self.metadata.state_dict_metadata.get(key)
        if md is None or not hasattr(md, "chunks"):
            raise ConversionError(f"{self.dir}: tensor {key} (of {name}) is missing from the checkpoint")
        return key, layer, md

    def _stored_meta(self, name: str) -> Tensor:
        key, layer, md = self._stored(name)
        shape = tuple(md.size)[1:] if layer is not None else tuple(md.size)
        return torch.empty(shape, dtype=md.properties.dtype, device="meta")

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

        key, layer, md = self._stored(name)
        sizes = (1, *tuple(md.size)[1:]) if layer is not None else tuple(md.size)
        offsets = (layer, *[0] * (len(md.size) - 1)) if layer is not None else (0,) * len(md.size)
        if layer is not None and layer >= md.size[0]:
            raise ConversionError(f"{self.dir}: {key} holds {md.size[0]} layers, the config {self.layout.layers}")
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
            raise ConversionError(f"{self.dir}: reading {key} failed (a missing or corrupt shard file?): "
                                  f"{str(e).strip().splitlines()[-1]}") from e
        if covered[0] != dest.numel():
            raise ConversionError(f"{self.dir}: the stored chunks of {key} do not cover {name}: missing shards")
        full = self.layout.from_dist(name, dest[0] if layer is not None else dest)
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
        raise ConversionError(f"{path} does not exist")
    if (path / "megatron" / "fastgrpo.json").is_file() or (path / "fastgrpo.json").is_file():
        return MegatronSource(path)
    if (path / "config.json").is_file():
        return HFSource(path)
    if (path / "draft.safetensors").is_file() or (path / "draft_config.json").is_file():
        raise ConversionError(f"{path} is a draft head, not a policy checkpoint (use export-draft)")
    raise ConversionError(f"{path} is neither a Hugging Face directory (config.json) nor a Megatron checkpoint "
                          f"(megatron/fastgrpo.json)")


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
    """Every tensor a Megatron checkpoint at `layout` stores: its key, layer, stored shape (one layer),
    dtype and the TP pieces, from the source's shapes on the meta device (no weight read)."""
    km = keys_map()
    plan = []
    for name in layout.megatron_names():
        full = layout.to_dist(name, layout.megatron_tensor(name, source.hf_meta(name)))
        key, layer = layout.dist_key(name, km)
        plan.append({"name": name, "key": key, "layer": layer, "shape": tuple(full.shape),
                     "dtype": dtype or full.dtype, "chunks": layout.dist_chunks(name, tuple(full.shape))})
    return plan


def write_megatron(source, out: Path, layout: Layout, dtype: torch.dtype | None = None) -> dict:
    """A model-only Megatron distributed checkpoint (torch_dist) at `layout`, that the Megatron trainer
    loads (`MegatronPolicyTrainer.load`), at this layout or any other: `out/megatron/` and the model's
    config and tokenizer in `out/hf/`."""
    from torch.distributed.checkpoint import FileSystemWriter, save
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    from fastgrpo.backends.megatron.trainer import checkpoint_identity

    plan = megatron_plan(source, layout, dtype)
    items, owner = [], {}
    for p in plan:
        stacked = p["layer"] is not None
        size = torch.Size((layout.layers, *p["shape"]) if stacked else p["shape"])
        for offsets, sizes in p["chunks"]:
            off = torch.Size((p["layer"], *offsets) if stacked else offsets)
            sz = torch.Size((1, *sizes) if stacked else sizes)
            index = MetadataIndex(p["key"], off)
            items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(off, sz), properties=TensorProperties(dtype=p["dtype"]), size=size)))
            owner[(p["key"], tuple(off))] = (p, offsets, sizes)
    extra = torch.Size([layout.layers])
    for i in range(layout.layers):  # the linear layers' (empty) extra state, as megatron saves it
        for module in LINEAR_EXTRA_STATE:
            items.append(WriteItem(index=MetadataIndex(f"decoder.layers.{module}._extra_state/shard_{i}_{layout.layers}"),
                                   type=WriteItemType.BYTE_IO))
    manifest: dict[str, dict] = {}
    current: dict = {"name": None, "full": None}
    failed: list[ConversionError] = []

    class Lazy(DefaultSavePlanner):
        """Hands the writer each piece when it asks for it: one full tensor is held at a time."""

        def create_local_plan(self):
            self.plan = SavePlan(items)
            return self.plan

        def resolve_data(self, write_item):
            try:
                return self._resolve(write_item)
            except ConversionError as e:  # torch.distributed.checkpoint wraps what it catches: keep ours
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
            return piece.unsqueeze(0) if p["layer"] is not None else piece

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
             "saved_at": {"tensor": layout.tp, "pipeline": layout.pp, "data": 1}, "updates": 0, "optimizer": False,
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
        with torch.device("meta"):
            self.state = {k: v.to(dtype) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}

    def names(self) -> list[str]:
        return self.layout.megatron_names()

    def hf_meta(self, name: str) -> dict[str, Tensor]:
        return {k: self.state[k] for k in self.layout.hf_sources(name)}


def dry_run(config, tp: int, pp: int, dtype: torch.dtype | None = None, out=None) -> dict:
    """Every tensor a conversion to TP x PP writes (shape, each rank's piece) and the bytes each rank
    holds, computed by the conversion's own code on the meta device."""
    out = out or sys.stdout
    source = MetaSource(config)
    layout = layout_of(config, tp, pp)
    per_rank = {(t, p): 0 for p in range(pp) for t in range(tp)}
    print(f"{'tensor':<52} {'dtype':<9} {'full shape':<14} {'per-TP-rank':<14} stage", file=out)
    for name in layout.megatron_names():
        full = layout.megatron_tensor(name, source.hf_meta(name))
        if dtype is not None:
            full = full.to(dtype)
        stages = [s for s in range(pp) if layout.stage_name(name, s) is not None]
        if layout.tied and pp > 1 and name == "embedding.word_embeddings.weight":
            stages.append(pp - 1)  # the last stage's copy for the LM head
        piece = layout.shard(name, full, 0)
        for s in stages:
            for t in range(tp):
                per_rank[(t, s)] += piece.numel() * piece.element_size()
        print(f"{name:<52} {_dtype_name(full.dtype):<9} {'x'.join(map(str, full.shape)):<14} "
              f"{'x'.join(map(str, piece.shape)):<14} {','.join(map(str, stages))}", file=out)
    total = sum(math.prod(t.shape) * t.element_size() for t in source.state.values()
                if not (layout.tied and t is source.state.get("lm_head.weight")))
    print(f"\nbytes per rank at TP{tp} x PP{pp} (vocabulary padded to {layout.padded_vocab}; every TP rank of a "
          f"stage holds the same):", file=out)
    for s in range(pp):
        b = {per_rank[(t, s)] for t in range(tp)}
        print(f"  stage {s} (layers {layout.stage_layers(s).start}-{layout.stage_layers(s).stop - 1}): "
              f"{max(b):,} bytes = {max(b) / 2**30:.2f} GiB on each of its {tp} TP ranks", file=out)
    print(f"model: {sum(v.numel() for v in source.state.values()) / 1e9:.2f}B parameters "
          f"({total / 2**30:.1f} GiB as {_dtype_name(next(iter(source.state.values())).dtype)}); "
          f"largest rank {max(per_rank.values()) / 2**30:.2f} GiB", file=out)
    return {"per_rank": {f"tp{t}_pp{s}": b for (t, s), b in per_rank.items()}, "model_bytes": total}


# -- verify, inspect ---------------------------------------------------------------------------
PROMPTS = torch.randint(3, 100, (3, 16), generator=torch.Generator().manual_seed(0))


def _logits(source, prompts: Tensor) -> Tensor:
    """The logits of a checkpoint's model on `prompts` (Hugging Face's implementation, fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(source.config, dtype=torch.float32).eval()
    params = dict(model.named_parameters())
    for name in source.names():
        for hf, t in source.hf_group(name).items():
            params[hf].data.copy_(t)
    with torch.no_grad():
        return model(prompts % source.layout.vocab).logits.float()


def verify(a: Path, b: Path, atol: float = 0.0, logits_atol: float = 1e-4, logits: bool = True,
           out=None) -> bool:
    """Tensor-by-tensor (names mapped through the layout) and logits comparison of two checkpoints of
    any kind; True if they match."""
    out = out or sys.stdout
    sa, sb = open_checkpoint(a), open_checkpoint(b)
    from fastgrpo.backends.megatron.trainer import checkpoint_identity

    ia, ib = checkpoint_identity(sa.config, sa.layout), checkpoint_identity(sb.config, sb.layout)
    if ia != ib:
        print(f"MISMATCH: different models: {a}: {ia}, {b}: {ib}", file=out)
        return False
    worst, worst_name, ok, count = 0.0, None, True, 0
    for name in sa.names():
        ga, gb = sa.hf_group(name), sb.hf_group(name)
        if set(ga) != set(gb):
            print(f"MISMATCH: {name}: tensors {sorted(ga)} vs {sorted(gb)}", file=out)
            return False
        for hf in ga:
            x, y = ga[hf], gb[hf]
            count += 1
            if x.shape != y.shape:
                print(f"MISMATCH: {hf}: shape {tuple(x.shape)} vs {tuple(y.shape)}", file=out)
                ok = False
                continue
            d = (x.double() - y.double()).abs().max().item() if x.numel() else 0.0
            if x.dtype != y.dtype:
                print(f"note: {hf}: dtype {x.dtype} vs {y.dtype}", file=out)
            if d > worst or worst_name is None:
                worst, worst_name = d, hf
            if d > atol:
                ok = False
    print(f"tensors: {count} compared; largest difference {worst:.3g} ({worst_name}); "
          f"{'equal' if worst == 0 else 'within' if ok else 'BEYOND'} tolerance {atol:g}", file=out)
    if logits:
        la, lb = _logits(sa, PROMPTS), _logits(sb, PROMPTS)
        d = (la - lb).abs().max().item()
        print(f"logits on {PROMPTS.shape[0]} fixed prompts of {PROMPTS.shape[1]} tokens: largest difference {d:.3g} "
              f"({'within' if d <= logits_atol else 'BEYOND'} tolerance {logits_atol:g})", file=out)
        ok = ok and d <= logits_atol
    print("OK: the checkpoints match" if ok else "MISMATCH", file=out)
    return ok


def inspect(path: Path, check: bool = False, tensors: bool = False, out=None) -> dict:
    """What a checkpoint is, from headers and metadata (no tensor read unless `check`)."""
    out = out or sys.stdout
    src = open_checkpoint(path)
    shapes, dtypes = {}, set()
    for name in src.names():
        for hf, t in src.hf_meta(name).items():
            shapes[hf] = (tuple(t.shape), t.dtype)
            dtypes.add(_dtype_name(t.dtype))
    params = sum(math.prod(s) for s, _ in shapes.values())
    disk = sum(f.stat().st_size for f in src.files)
    info = {"path": str(path), "kind": src.kind, "architecture": (getattr(src.config, "architectures", None) or
                                                                  [src.config.model_type])[0],
            "parameters": params, "dtype": sorted(dtypes), "size_on_disk": disk, "files": len(src.files)}
    if src.kind == "megatron":
        info["layout"] = {"tensor": src.layout.tp, "pipeline": src.layout.pp}
        info["training_checkpoint"] = src.info.get("optimizer", True)
        info["updates"] = src.info.get("updates")
    manifest = src.check.manifest
    info["manifest"] = None if manifest is None else f"{len(manifest)} tensors, sha256"
    if manifest is not None and set(manifest) != set(shapes):
        raise ConversionError(f"{path}: its manifest lists other tensors than the checkpoint holds: "
                              f"{sorted(set(manifest) ^ set(shapes))[:5]}")
    if check:
        sums = {}
        for name in src.names():
            for hf, t in src.hf_group(name).items():
                sums[hf] = checksum(t)
        info["checked"] = "against the manifest" if manifest is not None else "no manifest: checksums computed"
        manifest = manifest or {k: {"shape": list(shapes[k][0]), "dtype": _dtype_name(shapes[k][1]), "sha256": v}
                                for k, v in sums.items()}
    for k, v in info.items():
        print(f"{k:<20} {v}", file=out)
    if tensors and manifest:
        for k, v in manifest.items():
            print(f"  {k:<56} {'x'.join(map(str, v['shape'])):<14} {v['dtype']:<9} {v['sha256'][:16]}", file=out)
    return info


# -- model configs ----------------------------------------------------------------------------------
def scaled_config(config, layers: int = 2, head_dim: int = 8, kv_heads: int = 2, ffn_per_hidden: float | None = None,
                  vocab: int | None = None):
    """The same architecture scaled down for tests: the real GQA ratio (heads per KV head), biases,
    tying and norm/rope settings, with few layers, `kv_heads` KV heads of `head_dim`, the real MLP
    width ratio, and a vocabulary (not a multiple of 128, so padding is exercised)."""
    raw = config.to_dict()
    ratio = config.num_attention_heads // config.num_key_value_heads
    heads = kv_heads * ratio
    hidden = heads * head_dim
    ffn = ffn_per_hidden or config.intermediate_size / config.hidden_size
    raw.update(num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
               hidden_size=hidden, intermediate_size=int(round(hidden * ffn / 4)) * 4,
               vocab_size=vocab or config.vocab_size // 512, max_position_embeddings=128)
    raw.pop("max_window_layers", None)
    raw.pop("layer_types", None)
    raw.pop("transformers_version", None)
    return type(config).from_dict(raw)


# -- the command line --------------------------------------------------------------------------------
def _dtype_arg(text: str | None) -> torch.dtype | None:
    if text in (None, "keep"):
        return None
    if text not in DTYPES:
        raise ConversionError(f"--dtype {text}: one of keep, {', '.join(DTYPES)}")
    return DTYPES[text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="convert_checkpoint.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("hf-to-megatron", help="a Hugging Face directory -> a Megatron distributed checkpoint")
    p.add_argument("--hf", type=Path, help="Hugging Face directory (safetensors)")
    p.add_argument("--config", type=Path, help="with --dry-run: a config.json alone (e.g. configs/models/llama-3-70b.json)")
    p.add_argument("--out", type=Path)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dtype", default="keep")
    p.add_argument("--dry-run", action="store_true", help="list the output tensors and bytes per rank on the meta device")
    p = sub.add_parser("megatron-to-hf", help="a Megatron checkpoint (any layout, or a training step_N) -> Hugging Face")
    p.add_argument("--megatron", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--dtype", default="keep")
    p.add_argument("--tokenizer", type=Path, help="copy the tokenizer (and config) from this directory")
    p = sub.add_parser("deepspeed-to-hf", help="a checkpoint of the DeepSpeed trainer (any ZeRO stage) -> Hugging Face")
    p.add_argument("--checkpoint", type=Path, required=True, help="a training checkpoint (step_N) of trainer.backend=deepspeed")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--dtype", default="keep")
    p = sub.add_parser("reshard", help="a Megatron checkpoint -> the same at another TP x PP (model only)")
    p.add_argument("--megatron", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p = sub.add_parser("verify", help="compare two checkpoints of any kind tensor by tensor and by logits")
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--atol", type=float, default=0.0)
    p.add_argument("--logits-atol", type=float, default=1e-4)
    p.add_argument("--no-logits", action="store_true", help="tensors only (logits need each model in memory)")
    p = sub.add_parser("inspect", help="kind, architecture, size, layout and the manifest of a checkpoint")
    p.add_argument("path", type=Path)
    p.add_argument("--check", action="store_true", help="read every tensor and check it against the manifest")
    p.add_argument("--tensors", action="store_true", help="list every tensor's checksum")
    p = sub.add_parser("export-draft", help="the draft head as an EAGLE draft model for SGLang")
    p.add_argument("--draft", type=Path, required=True)
    p.add_argument("--policy", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--format", default="sglang-eagle", choices=["sglang-eagle"])
    p.add_argument("--drop-norms", action="store_true", help="export although SGLang's EAGLE draft has no place for "
                                                             "the draft's input and final norms")
    p = sub.add_parser("bench-memory", help="peak RSS converting a random model of --size-gb (fp32) both ways")
    p.add_argument("--size-gb", type=float, default=2.5)
    p.add_argument("--output", type=Path, default=Path("bench/convert-memory.json"))
    p.add_argument("--workdir", type=Path, help="where the model is built (default: a temporary directory)")
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except (ConversionError, LayoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(args) -> int:
    c = args.command
    if c == "hf-to-megatron":
        if args.dry_run:
            config = load_config(args.config or args.hf) if (args.config or args.hf) else None
            if config is None:
                raise ConversionError("--dry-run needs --config FILE or --hf DIR")
            dry_run(config, args.tp, args.pp, _dtype_arg(args.dtype))
            return 0
        if not args.hf or not args.out:
            raise ConversionError("hf-to-megatron needs --hf DIR and --out DIR (or --dry-run)")
        source = open_checkpoint(args.hf)
        if source.kind != "hf":
            raise ConversionError(f"{args.hf} is a Megatron checkpoint, not a Hugging Face directory (use reshard, "
                                  f"or megatron-to-hf)")
        stats = write_megatron(source, args.out, layout_of(source.config, args.tp, args.pp), _dtype_arg(args.dtype))
    elif c == "megatron-to-hf":
        source = open_checkpoint(args.megatron)
        if source.kind != "megatron":
            raise ConversionError(f"{args.megatron} is a Hugging Face directory, not a Megatron checkpoint")
        stats = write_hf(source, args.out, parse_size(args.max_shard_size), _dtype_arg(args.dtype), args.tokenizer)
    elif c == "deepspeed-to-hf":
        stats = deepspeed_to_hf(args.checkpoint, args.out, parse_size(args.max_shard_size), _dtype_arg(args.dtype))
    elif c == "reshard":
        source = open_checkpoint(args.megatron)
        if source.kind != "megatron":
            raise ConversionError(f"{args.megatron} is a Hugging Face directory, not a Megatron checkpoint")
        stats = write_megatron(source, args.out, layout_of(source.config, args.tp, args.pp))
    elif c == "verify":
        return 0 if verify(args.a, args.b, args.atol, args.logits_atol, not args.no_logits) else 1
    elif c == "inspect":
        inspect(args.path, args.check, args.tensors)
        return 0
    elif c == "export-draft":
        stats = export_draft(args.draft, args.policy, args.out, args.drop_norms)
    elif c == "bench-memory":
        stats = bench_memory(args.size_gb, args.output, args.workdir)
    print(json.dumps(stats))
    return 0


def export_draft(draft: Path, policy: Path, out: Path, drop_norms: bool = False) -> dict:
    """Our draft head (fastgrpo/speculation/draft.py) as SGLang's EAGLE Llama draft model
    (`sglang_eagle_tensors`: the names, and the norms SGLang's class has no place for). A draft whose
    norms would be dropped computes another function there: refused unless `drop_norms` (SGLang's
    verification keeps sampling lossless; acceptance may drop)."""
    from fastgrpo.speculation.draft import (DRAFT_CONFIG, DRAFT_WEIGHTS, SGLANG_EAGLE_ARCHITECTURE, sglang_eagle_config,
                                            sglang_eagle_tensors)

    draft, policy = Path(draft), Path(policy)
    if not (draft / DRAFT_WEIGHTS).is_file():
        raise ConversionError(f"{draft} is not a draft directory ({DRAFT_WEIGHTS} missing; `fastgrpo draft-pretrain` "
                              f"writes one)")
    config = load_config(policy)
    header, start = read_safetensors_header(draft / DRAFT_WEIGHTS)
    w = {k: read_safetensor(draft / DRAFT_WEIGHTS, e, start) for k, e in header.items()}
    try:
        tensors, dropped = sglang_eagle_tensors(w, config)
    except ValueError as e:
        raise ConversionError(f"{draft}: {e} (policy at {policy})") from e
    if dropped and not drop_norms:
        raise ConversionError(
            f"SGLang's EAGLE Llama draft ({SGLANG_EAGLE_ARCHITECTURE}, llama_eagle.py) has no input norm in its layer "
            f"and no final norm, so this draft's {', '.join(dropped)} cannot be carried over; pass --drop-norms to "
            f"export without them (verification stays lossless, acceptance may drop)")
    with atomic_dir(out) as tmp:
        writer = SafetensorsWriter(tmp, [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()], 2**62)
        for n, t in tensors.items():
            writer.write(n, t)
        writer.close()
        # SGLang runs the draft in the dtype its config names: the policy's (bfloat16 unless it says)
        dtype = str(getattr(config, "dtype", None) or "bfloat16").removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(sglang_eagle_config(config, dtype), indent=2))
        meta = json.loads((draft / DRAFT_CONFIG).read_text()) if (draft / DRAFT_CONFIG).is_file() else {}
        (tmp / "fastgrpo-export.json").write_text(json.dumps(
            {"format": "sglang-eagle", "sglang_class": SGLANG_EAGLE_ARCHITECTURE,
             "sglang_source": "python/sglang/srt/models/llama_eagle.py (sglang 0.5.23)", "dropped": dropped,
             "draft": meta}, indent=1))
    return {"tensors": len(tensors), "dropped": dropped}


def deepspeed_to_hf(checkpoint: Path, out: Path, max_shard: int, dtype: torch.dtype | None = None) -> dict:
    """The DeepSpeed trainer's checkpoint (`<checkpoint>/deepspeed`, every rank's ZeRO partitions) as a
    Hugging Face directory, consolidated by DeepSpeed's own `zero_to_fp32` (which holds the whole fp32
    model in memory: a tool for one machine with enough of it); config and tokenizer from the
    checkpoint's `policy/`."""
    from fastgrpo.backends.deepspeed_trainer import CHECKPOINT_TAG

    checkpoint = Path(checkpoint)
    ds_dir, policy = checkpoint / "deepspeed", checkpoint / "policy"
    if not (ds_dir / "fastgrpo.json").is_file():
        raise ConversionError(f"{checkpoint} holds no DeepSpeed checkpoint ({ds_dir / 'fastgrpo.json'} missing)")
    if not (policy / "config.json").is_file():
        raise ConversionError(f"{checkpoint} has no policy/config.json to name the model")
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(ds_dir), tag=CHECKPOINT_TAG)
    if load_config(policy).tie_word_embeddings:
        state.pop("lm_head.weight", None)
    plan = [(name, tuple(t.shape), dtype or t.dtype) for name, t in state.items()]
    with atomic_dir(out) as tmp:
        writer = SafetensorsWriter(tmp, plan, max_shard)
        for name, t in state.items():
            writer.write(name, _cast(t, dtype))
        writer.close()
        _copy_non_weights(policy, tmp)
    return {"tensors": len(plan), "bytes": writer.total, "files": len(writer.files)}


def bench_memory(size_gb: float, output: Path, workdir: Path | None) -> dict:
    """Peak RSS of hf-to-megatron (TP2 x PP2) and megatron-to-hf on a random Llama model of about
    `size_gb` GB in fp32, each in a fresh process, against the model's and its largest tensor's size.
    The model is written tensor by tensor (this process never holds it either)."""
    import platform
    import subprocess
    import time

    from transformers import LlamaConfig

    layers = max(2, round((size_gb * 1e9 / 4 - 2 * 32000 * 2048) / (3 * 2048 * 2048 + 3 * 2048 * 5632)))
    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=False)
    work = Path(workdir or tempfile.mkdtemp(prefix="convert-bench-"))
    hf, mg, back = work / "hf", work / "mg", work / "back"
    for d in (hf, mg, back):
        shutil.rmtree(d, ignore_errors=True)
    meta = MetaSource(config)
    plan = [(k, tuple(v.shape), torch.float32) for k, v in meta.state.items()]
    gen = torch.Generator().manual_seed(0)
    with atomic_dir(hf) as tmp:
        writer = SafetensorsWriter(tmp, plan, parse_size("1GB"))
        for name, shape, dtype in plan:
            writer.write(name, torch.randn(shape, generator=gen, dtype=dtype) * 0.02)
        writer.close()
        config.save_pretrained(tmp)
    model_bytes = writer.total
    largest = max(math.prod(s) * 4 for _, s, _ in plan)
    tool = str(Path(__file__).resolve())
    runs = {}
    for name, argv in (("hf-to-megatron TP2xPP2", ["hf-to-megatron", "--hf", str(hf), "--out", str(mg), "--tp", "2", "--pp", "2"]),
                       ("megatron-to-hf", ["megatron-to-hf", "--megatron", str(mg), "--out", str(back)])):
        code = ("import resource, runpy, sys, time; sys.argv = [sys.argv[1]] + sys.argv[2:]; t = time.time()\n"
                "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
                "except SystemExit as e:\n    assert not e.code, e.code\n"
                "print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, time.time() - t)")
        t = time.time()
        res = subprocess.run([sys.executable, "-c", code, tool, *argv], capture_output=True, text=True)
        if res.returncode:
            raise ConversionError(f"bench {name} failed: {res.stderr[-2000:]}")
        peak = int(next(l for l in res.stdout.splitlines() if l.startswith("PEAK")).split()[1])
        runs[name] = {"peak_rss_bytes": peak, "seconds": round(time.time() - t, 1),
                      "peak_over_model": round(peak / model_bytes, 3), "peak_over_largest_tensor": round(peak / largest, 2)}
    baseline = subprocess.run([sys.executable, "-c", "import resource, sys; sys.argv = ['x', '--help']\n"
                               f"sys.path.insert(0, {str(Path(tool).parents[1])!r})\n"
                               "import tools.convert_checkpoint, megatron.core.models.gpt, transformers\n"
                               "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"],
                              capture_output=True, text=True)
    result = {"command": f"python tools/convert_checkpoint.py bench-memory --size-gb {size_gb}",
              "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
              f"{platform.system()} {platform.release()}", "model": {"layers": layers, "hidden": 2048, "ffn": 5632,
              "vocab": 32000, "parameters": model_bytes // 4, "bytes_fp32": model_bytes, "largest_tensor_bytes": largest},
              "imports_only_rss_bytes": int(baseline.stdout.strip() or 0), "runs": runs,
              "verified_bit_exact": None}
    if not workdir:
        back_src, hf_src = HFSource(back), HFSource(hf)
        result["verified_bit_exact"] = all(
            all(torch.equal(t, hf_src.hf_group(n)[k]) for k, t in back_src.hf_group(n).items()) for n in hf_src.names())
        shutil.rmtree(work, ignore_errors=True)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    sys.exit(main())
