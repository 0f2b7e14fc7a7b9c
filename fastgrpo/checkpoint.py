"""Atomic checkpoints: written into a hidden temp directory, then renamed; the last K are kept.

A job killed at any moment (preemption, OOM, Ctrl-C) leaves only complete checkpoints visible,
so `--resume` never loads half a model. One run saves into a root at a time; in a distributed run
every rank writes its part into the same hidden directory, which rank 0 publishes once all are done.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

_NAME = re.compile(r"^step_(\d{8,})$")
_HIDDEN = (".tmp-", ".old-")  # in-progress saves and replaced checkpoints; never complete


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(top: Path) -> None:
    """File data and directory entries must be on disk before the rename publishes them,
    or a power loss can leave a visible checkpoint with empty files."""
    for dirpath, _, files in os.walk(top):
        for name in files:
            _fsync(Path(dirpath) / name)
        _fsync(Path(dirpath))


class CheckpointManager:
    def __init__(self, root: Path, keep_last: int) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last

    @staticmethod
    def step_of(path: Path) -> int:
        m = _NAME.match(Path(path).name)
        if not m:
            raise ValueError(f"{path} is not a checkpoint directory (step_NNNNNNNN)")
        return int(m.group(1))

    def checkpoints(self) -> list[Path]:
        """Sorted by step number: names past 8 digits and copied mtimes would mislead other orders."""
        if not self.root.is_dir():
            return []
        return sorted((p for p in self.root.iterdir() if p.is_dir() and _NAME.match(p.name)), key=self.step_of)

    def latest(self) -> Path | None:
        found = self.checkpoints()
        return found[-1] if found else None

    def save(self, step: int, write: Callable[[Path], None]) -> Path:
        """A crash at any point leaves the old checkpoints or the new one, never half of one. In a
        torch.distributed world every rank calls this (collective): `write` runs on every rank."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        final = self.root / f"step_{step:08d}"
        if dist.is_initialized() and dist.get_world_size() > 1:
            box = [self._begin(final) if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(box, src=0)
            write(box[0])
            dist.barrier()  # every rank's part is on disk
            if dist.get_rank() == 0:
                self._publish(box[0], final)
            dist.barrier()  # nobody reads it before it is visible
            return final
        tmp = self._begin(final)
        try:
            write(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._publish(tmp, final)
        return final

    def _begin(self, final: Path) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        # not tempfile.mkdtemp: its 0700 mode would survive the rename and hide checkpoints from the group
        tmp = self.root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        return tmp

    def _publish(self, tmp: Path, final: Path) -> None:
        try:
            _fsync_tree(tmp)
            if final.exists():  # a directory cannot be renamed over a non-empty one: move the old aside
                old = self.root / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
                final.rename(old)
                tmp.rename(final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                tmp.rename(final)
            _fsync(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for entry in self.root.iterdir():  # left by saves that were killed
            if entry.name.startswith(_HIDDEN):
                shutil.rmtree(entry, ignore_errors=True)
        # steps normally only grow; if not, the checkpoint just written is still never the one deleted
        others = [p for p in self.checkpoints() if p != final]
        for old in others[: max(0, len(others) - (self.keep_last - 1))]:
            shutil.rmtree(old, ignore_errors=True)
