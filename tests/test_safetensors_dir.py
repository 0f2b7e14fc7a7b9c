"""fastgrpo.safetensors_dir: a checkpoint's safetensors read one tensor at a time, each checked against the
manifest when it is looked up (what the Megatron trainer loads a policy with, rank by rank)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fastgrpo.conversion.files import SafetensorsWriter
from fastgrpo.safetensors_dir import INDEX, MANIFEST, CheckpointError, SafetensorsDir


def written(directory: Path, tensors: dict[str, torch.Tensor], max_shard: int = 1 << 30) -> Path:
    """`tensors` written by fastgrpo's writer: safetensors (sharded past `max_shard` bytes) and a manifest."""
    directory.mkdir()
    writer = SafetensorsWriter(directory, [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()], max_shard)
    for name, t in tensors.items():
        writer.write(name, t)
    writer.close()
    return directory


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(8, 4, generator=g), "b.weight": torch.randn(16, generator=g).to(torch.bfloat16),
            "c.bias": torch.arange(5, dtype=torch.int64)}


def test_lookups_read_the_files_bit_exact_across_shards(tmp_path):
    expected = tensors()
    d = SafetensorsDir(written(tmp_path / "ckpt", expected, max_shard=150))
    assert (tmp_path / "ckpt" / INDEX).is_file() and len(d.files) > 1  # a sharded directory, read through its index
    assert sorted(d) == sorted(expected) and len(d) == 3
    for name, t in expected.items():
        assert d[name].dtype == t.dtype and torch.equal(d[name], t)
        assert d.meta(name).shape == t.shape and d.meta(name).device.type == "meta"
    assert sorted(d.check.seen) == sorted(expected)  # every lookup checked against the manifest


def test_a_corrupt_tensor_fails_when_looked_up_and_only_then(tmp_path):
    d = written(tmp_path / "ckpt", tensors())
    file = d / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[-3] ^= 0xFF  # in the last tensor's data (c.bias, the plan's last)
    file.write_bytes(bytes(data))
    reader = SafetensorsDir(d)
    assert "c.bias" in reader and "nope" not in reader  # `in` reads nothing: no checksum failure here
    assert torch.equal(reader["a.weight"], tensors()["a.weight"])  # the others still read
    with pytest.raises(CheckpointError, match="checksum mismatch for tensor c.bias"):
        reader["c.bias"]
    with pytest.raises(CheckpointError, match="tensor nope is missing"):
        reader["nope"]


def test_without_a_manifest_nothing_is_checked_and_pickles_are_refused(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    save_file(tensors(), str(plain / "model.safetensors"))  # the safetensors library's own file: no manifest
    reader = SafetensorsDir(plain)
    assert reader.check.manifest is None
    assert all(torch.equal(reader[n], t) for n, t in load_file(str(plain / "model.safetensors")).items())
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "pytorch_model.bin").write_bytes(b"never unpickled")
    with pytest.raises(CheckpointError, match="pickled checkpoints are never read"):
        SafetensorsDir(pickled)
    with pytest.raises(CheckpointError, match="is not a directory"):
        SafetensorsDir(tmp_path / "nowhere")


def test_a_tensor_missing_from_the_manifest_is_refused(tmp_path):
    d = written(tmp_path / "ckpt", tensors())
    manifest = json.loads((d / MANIFEST).read_text())
    del manifest["tensors"]["b.weight"]
    (d / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="tensor b.weight is not in its manifest"):
        SafetensorsDir(d)["b.weight"]
