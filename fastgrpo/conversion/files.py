"""Checkpoint files written: dtypes, manifests, atomic output directories, safetensors written one tensor
at a time (reading them is `fastgrpo.safetensors_dir`, below the trainers and this package alike)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from fastgrpo.safetensors_dir import INDEX, MANIFEST, ST_DTYPES, CheckpointError, tensor_bytes

HF_NON_WEIGHT = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# -- small helpers ----------------------------------------------------------------------------
def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a byte count."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?i?B?)?\s*", text, re.I)
    if not m:
        raise CheckpointError(f"not a size: {text!r} (e.g. 5GB, 500MB)")
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
        raise CheckpointError(f"{out} already exists: remove it or choose another output directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        yield tmp
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_manifest(directory: Path, kind: str, tensors: dict[str, dict]) -> None:
    (Path(directory) / MANIFEST).write_text(json.dumps(
        {"format": 1, "kind": kind, "checksum": "sha256", "tensors": tensors}, indent=1))


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
        data = tensor_bytes(t)
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
