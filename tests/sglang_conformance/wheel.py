"""The pinned sglang wheel: fetched once (`pip download --no-deps`, cached outside the checkout under
~/.cache/fastgrpo, its sha256 checked), its Python files and METADATA unpacked next to it, and read
as a `Source` (`source()`); nothing of it is imported."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from fastgrpo.engines.sglang.adapter import SGLANG_VERSION
from tests.sglang_conformance.reading import Source

# the one wheel read (sglang publishes one per CPython version and platform; their Python files agree)
WHEEL = f"sglang-{SGLANG_VERSION}-cp311-cp311-manylinux_2_34_x86_64.whl"
WHEEL_SHA256 = "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937"


class SourceUnavailable(RuntimeError):
    """The pinned wheel could not be fetched (no network to PyPI)."""


def cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "fastgrpo" / f"sglang-{SGLANG_VERSION}"


def fetch_wheel() -> Path:
    """The pinned wheel, downloaded once into the cache; raises SourceUnavailable if pip cannot get it."""
    directory = cache_dir()
    wheel = directory / WHEEL
    if not wheel.is_file():
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
                   "--python-version", "3.11", "--implementation", "cp", "--platform", "manylinux_2_34_x86_64",
                   f"sglang=={SGLANG_VERSION}", "-d", tmp]
            try:
                run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise SourceUnavailable(f"pip download sglang=={SGLANG_VERSION} failed: {e}") from e
            got = Path(tmp) / WHEEL
            if run.returncode != 0 or not got.is_file():
                raise SourceUnavailable(f"pip download sglang=={SGLANG_VERSION} failed: "
                                        f"{(run.stderr or run.stdout).strip()[-400:]}")
            os.replace(got, wheel)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        wheel.unlink()
        raise RuntimeError(f"{WHEEL} has sha256 {digest}, not the pinned {WHEEL_SHA256}")
    return wheel


def source_root() -> Path:
    """The wheel's Python files and METADATA, unpacked once next to it."""
    wheel = fetch_wheel()
    root = wheel.parent / "src"
    if (root / ".complete").is_file():
        return root
    with tempfile.TemporaryDirectory(dir=wheel.parent) as tmp:
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                path = Path(name)
                if path.is_absolute() or ".." in path.parts:
                    continue
                if (name.startswith("sglang/") and name.endswith(".py")) or name.endswith(".dist-info/METADATA"):
                    z.extract(name, tmp)
        (Path(tmp) / ".complete").write_text(WHEEL_SHA256)
        if root.exists():
            shutil.rmtree(root, ignore_errors=True)
        try:
            os.replace(tmp, root)
        except OSError:  # another process unpacked it meanwhile
            if not (root / ".complete").is_file():
                raise
        Path(tmp).mkdir(exist_ok=True)  # for TemporaryDirectory's cleanup
    return root


_SOURCE: Source | None = None


def source() -> Source:
    global _SOURCE
    if _SOURCE is None:
        _SOURCE = Source(source_root())
    return _SOURCE


def wheel_text(name: str) -> str:
    """One non-Python file of the wheel (`name` its path in the wheel: a kernel's C++ or CUDA source),
    read from the wheel itself: `source_root` unpacks the Python files only."""
    with zipfile.ZipFile(fetch_wheel()) as z:
        return z.read(name).decode()


def metadata_requirements() -> list[str]:
    """The wheel's Requires-Dist lines."""
    meta = next((source_root()).glob("sglang-*.dist-info/METADATA"))
    return [line.split(":", 1)[1].strip() for line in meta.read_text().splitlines() if line.startswith("Requires-Dist:")]
