"""Atomic checkpoints: written into a temp directory, then renamed; the last K are kept."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

_NAME = re.compile(r"^step_(\d{8})$")


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
        if not self.root.is_dir():
            return []
        return sorted((p for p in self.root.iterdir() if p.is_dir() and _NAME.match(p.name)), key=self.step_of)

    def latest(self) -> Path | None:
        found = self.checkpoints()
        return found[-1] if found else None

    def save(self, step: int, write: Callable[[Path], None]) -> Path:
        """A crash at any point leaves either the old checkpoints or the new one, never half of one."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step_{step:08d}"
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=self.root))
        try:
            write(tmp)
            for f in tmp.rglob("*"):
                if f.is_file():
                    with open(f, "rb") as fh:
                        os.fsync(fh.fileno())
            if final.exists():  # re-saving a step: move the old one aside first
                old = self.root / f".old-{final.name}"
                shutil.rmtree(old, ignore_errors=True)
                final.rename(old)
                tmp.rename(final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for stale in self.root.iterdir():
            if stale.name.startswith((".tmp-", ".old-")):
                shutil.rmtree(stale, ignore_errors=True)
        for old in self.checkpoints()[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        return final
