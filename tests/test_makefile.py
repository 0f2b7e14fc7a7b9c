"""The Makefile's install stamps, read with `make -n` (nothing runs): a GPU node set up by `make
install-gpu` (SGLang's torch 2.14.1) must never get the CPU recipe (torch 2.13.0) from `make test`,
`make train` or `make check-gpu-install`, not even after pyproject.toml changes (one venv holds one
torch). And `make test-slurm`, run with a fake apt-get and pytest (nothing installed, nothing tested):
under CI=true a Slurm that cannot be installed fails it, as tests/slurm/cluster.py fails rather than
skips, so CI's Slurm tier cannot pass having run nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.slurm import cluster

ROOT = Path(__file__).resolve().parent.parent
CPU_TORCH = "torch==2.13.0"
GPU_RECIPE = "tools/gpu_requirements.py >"
# what each install stamp is made from (the GPU install's list comes from the script and the pins)
CPU_SOURCES = ("pyproject.toml", "setup.py", "fastgrpo/speculation/_suffix_trie.c",  # the C built at install
               "fastgrpo/engines/embedded/_tree_merge.c")
GPU_SOURCES = (*CPU_SOURCES, "tools/gpu_requirements.py", "fastgrpo/bench/gpu_check/pins.py")

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


def make_test_slurm(tmp_path: Path, ci: bool) -> tuple[subprocess.CompletedProcess, list[str]]:
    """`make test-slurm` on a machine without Slurm whose apt-get fails (a fake one, the only command on
    PATH) and whose pytest only records that it ran; returns make's result and what ran, in order."""
    venv, fake, log = tmp_path / "venv", tmp_path / "fake-bin", tmp_path / "ran"
    (venv / "bin").mkdir(parents=True)
    fake.mkdir()
    (stamp,) = stamps_made_by("install", venv)
    stamp.touch()
    age(stamp, -60)  # installed: the target goes straight to its own recipe
    for script, name, status in ((fake / "apt-get", "apt-get", 100), (venv / "bin" / "pytest", "pytest", 0)):
        script.write_text(f'#!/bin/sh\necho "{name} $*" >> {log}\nexit {status}\n')
        script.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "MAKEFLAGS", "MAKELEVEL")} | {"PATH": str(fake)}
    if ci:
        env["CI"] = "true"
    done = subprocess.run([shutil.which("make"), "-C", str(ROOT), "test-slurm", f"VENV={venv}"], env=env,
                          capture_output=True, text=True)
    return done, log.read_text().splitlines() if log.exists() else []


def test_under_ci_make_test_slurm_fails_when_slurm_cannot_be_installed(tmp_path):
    done, ran = make_test_slurm(tmp_path, ci=True)
    assert ran == ["apt-get update -q"], ran  # the install was tried, and the tests never started
    assert done.returncode != 0 and "CI=true" in done.stderr, done.stdout + done.stderr


def test_outside_ci_make_test_slurm_goes_on_to_the_tests_that_say_why_they_skip(tmp_path):
    # the control: the same machine without CI=true passes the failed install on to the tests
    done, ran = make_test_slurm(tmp_path, ci=False)
    assert ran == ["apt-get update -q", "pytest -x -q -rs tests/slurm"], ran
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("why", ["no slurm", "not root"])
def test_the_slurm_tests_fail_under_ci_and_skip_elsewhere_when_they_cannot_run(monkeypatch, why):
    if why == "no slurm":
        monkeypatch.setattr(cluster.shutil, "which", lambda name: None)
    else:
        monkeypatch.setattr(cluster.shutil, "which", lambda name: f"/usr/sbin/{name}")
        monkeypatch.setattr(cluster.os, "geteuid", lambda: 1000)
    reason = cluster.missing()
    assert reason and ("not found" in reason) == (why == "no slurm")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        cluster.require()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception):
        cluster.require()


def test_a_machine_that_can_run_the_slurm_tests_neither_fails_nor_skips_them(monkeypatch):
    monkeypatch.setattr(cluster.shutil, "which", lambda name: f"/usr/sbin/{name}")
    monkeypatch.setattr(cluster.os, "geteuid", lambda: 0)
    monkeypatch.setenv("CI", "true")
    assert cluster.missing() is None
    cluster.require()
