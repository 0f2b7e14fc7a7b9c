"""The Makefile's install stamps, read with `make -n` (nothing runs): a GPU node set up by `make
install-gpu` (SGLang's torch 2.14.1) must never get the CPU recipe (torch 2.13.0) from `make test`,
`make train` or `make check-gpu-install`, not even after pyproject.toml changes (issue 41, item 5)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CPU_TORCH = "torch==2.13.0"
GPU_RECIPE = "tools/gpu_requirements.py >"
# what each install stamp is made from (the GPU install's list comes from the script and the pins)
CPU_SOURCES = ("pyproject.toml",)
GPU_SOURCES = ("pyproject.toml", "tools/gpu_requirements.py", "fastgrpo/bench/gpu_check/pins.py")

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def dry_run(target: str, venv: Path) -> str:
    out = subprocess.run(["make", "-n", "-C", str(ROOT), target, f"VENV={venv}"], capture_output=True, text=True,
                         check=True)
    return out.stdout


def stamps_made_by(target: str, venv: Path) -> list[Path]:
    """The files `target`'s recipe touches (its install stamp)."""
    return [Path(line.split()[-1]) for line in dry_run(target, venv).splitlines() if line.startswith("touch ")]


def age(path: Path, seconds: float) -> None:
    """The stamp `path` written `seconds` before the newest of its sources was."""
    sources = GPU_SOURCES if path.name.endswith("-gpu") else CPU_SOURCES
    then = max((ROOT / s).stat().st_mtime for s in sources) - seconds
    os.utime(path, (then, then))


@pytest.mark.parametrize("target", ["test", "train", "check-gpu-install"])
def test_a_gpu_install_is_never_replaced_by_the_cpu_recipe(tmp_path, target):
    venv = tmp_path / "venv"
    venv.mkdir()
    (stamp,) = stamps_made_by("install-gpu", venv)  # as `make install-gpu` leaves the node
    stamp.touch()
    age(stamp, -60)  # installed after the last change of pyproject.toml: nothing to do
    fresh = dry_run(target, venv)
    assert CPU_TORCH not in fresh and GPU_RECIPE not in fresh
    age(stamp, 60)  # pyproject.toml changed since: the GPU install is redone, SGLang's torch kept
    stale = dry_run(target, venv)
    assert CPU_TORCH not in stale, f"make {target} on a GPU node would install the CPU torch over SGLang's"
    assert GPU_RECIPE in stale


def test_a_cpu_node_keeps_the_cpu_install(tmp_path):
    venv = tmp_path / "venv"
    venv.mkdir()
    assert CPU_TORCH in dry_run("test", venv)  # a fresh machine: the CPU install first
    (stamp,) = stamps_made_by("install", venv)
    stamp.touch()
    age(stamp, -60)
    assert CPU_TORCH not in dry_run("test", venv) and GPU_RECIPE not in dry_run("test", venv)
    age(stamp, 60)
    assert CPU_TORCH in dry_run("test", venv)
    # each install removes the other's stamp (the venv holds one torch)
    assert any(line.startswith("rm -f") for line in dry_run("install", venv).splitlines())
