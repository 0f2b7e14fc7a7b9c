"""A Hugging Face checkpoint's safetensors, read one tensor at a time and checked against its manifest.

Both the Megatron trainer (each rank reads only the tensors it holds a piece of) and the conversion
tools (one Megatron parameter at a time) read checkpoints through `SafetensorsDir`, so it sits below
both. Tensors are read with plain file reads into fresh tensors, not mmap, which would keep every page
touched resident while a 70B model streams through; a `.bin` is refused, never unpickled. Where the
directory has a manifest (`fastgrpo-manifest.json`, per-tensor sha256, written by fastgrpo's writers),
every tensor read is checked against it.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import Tensor

MANIFEST = "fastgrpo-manifest.json"
INDEX = "model.safetensors.index.json"
ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool}


class CheckpointError(Exception):
    """Bad input or a checkpoint that is not what it says: the message names the problem."""


def tensor_bytes(t: Tensor) -> memoryview:
    """A tensor's bytes without a copy (contiguous tensors; any dtype)."""
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def checksum(t: Tensor) -> str:
    return hashlib.sha256(tensor_bytes(t)).hexdigest()


def read_manifest(directory: Path) -> dict | None:
    f = Path(directory) / MANIFEST
    return json.loads(f.read_text())["tensors"] if f.is_file() else None


class Checker:
    """Checks each tensor read against the checkpoint's manifest (if it has one)."""

    def __init__(self, where: Path, manifest: dict | None):
        self.where, self.manifest, self.seen = where, manifest, set()

    def __call__(self, name: str, t: Tensor) -> None:
        if self.manifest is None:
            return
        entry = self.manifest.get(name)
        if entry is None:
            raise CheckpointError(f"{self.where}: tensor {name} is not in its manifest ({MANIFEST})")
        if checksum(t) != entry["sha256"]:
            raise CheckpointError(f"{self.where}: checksum mismatch for tensor {name}: the data does not match "
                                  f"its manifest ({MANIFEST}); the checkpoint is corrupt")
        self.seen.add(name)


def read_safetensors_header(file: Path) -> tuple[dict, int]:
    """(header, where the data starts) of a safetensors file, checked against the file's size."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{file} is not a safetensors file (truncated)")
        n = struct.unpack("<Q", raw)[0]
        if n > min(size - 8, 100_000_000):
            raise CheckpointError(f"{file} is not a safetensors file (header of {n} bytes)")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if 8 + n + end > size:
        raise CheckpointError(f"{file} is truncated: its header describes {8 + n + end} bytes, the file has {size}")
    return header, 8 + n


def read_safetensor(file: Path, entry: dict, start: int) -> Tensor:
    """One tensor, by a plain read into a fresh tensor (no mmap)."""
    if entry["dtype"] not in ST_DTYPES:
        raise CheckpointError(f"{file}: dtype {entry['dtype']} is not supported")
    t = torch.empty(entry["shape"], dtype=ST_DTYPES[entry["dtype"]])
    b, e = entry["data_offsets"]
    if e - b != t.numel() * t.element_size():
        raise CheckpointError(f"{file}: a tensor's byte range does not match its shape")
    with open(file, "rb") as f:
        f.seek(start + b)
        if t.numel() and f.readinto(tensor_bytes(t)) != e - b:
            raise CheckpointError(f"{file} is truncated")
    return t


class SafetensorsDir(Mapping[str, Tensor]):
    """A directory's safetensors (`model.safetensors`, or shards listed by their index) as a mapping
    from Hugging Face tensor names to tensors, each read from disk when it is looked up and checked
    against the manifest where there is one: a consumer that looks up only the tensors it needs reads
    only those. A name the files do not hold raises CheckpointError; `in` reads nothing."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{path} is not a directory")
        if (self.path / INDEX).is_file():
            weight_map = json.loads((self.path / INDEX).read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (self.path / f).is_file()]
            if missing:
                raise CheckpointError(f"{self.path}: missing shard(s) {', '.join(missing)} listed in {INDEX}")
        elif (self.path / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            pickled = [p.name for p in self.path.glob("*.bin")] + [p.name for p in self.path.glob("*.pt*")]
            raise CheckpointError(f"{self.path} holds no safetensors weights" + (
                f" (found {', '.join(pickled)}: pickled checkpoints are never read; convert them to safetensors "
                f"where they were made)" if pickled else ""))
        self.entries: dict[str, tuple[Path, dict, int]] = {}
        for f in files:
            header, start = read_safetensors_header(self.path / f)
            for name, entry in header.items():
                self.entries[name] = (self.path / f, entry, start)
        self.check = Checker(self.path, read_manifest(self.path))
        self.files = [self.path / f for f in files]

    def _entry(self, name: str) -> tuple[Path, dict, int]:
        if name not in self.entries:
            raise CheckpointError(f"{self.path}: tensor {name} is missing from the checkpoint")
        return self.entries[name]

    def __getitem__(self, name: str) -> Tensor:
        t = read_safetensor(*self._entry(name))
        self.check(name, t)
        return t

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def meta(self, name: str) -> Tensor:
        """The tensor's shape and dtype, on the meta device: nothing read."""
        _, entry, _ = self._entry(name)
        return torch.empty(entry["shape"], dtype=ST_DTYPES[entry["dtype"]], device="meta")
