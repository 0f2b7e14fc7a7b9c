"""The GPU installs' pins, in one place (the standard library alone: it runs before anything is installed).

Two installs put fastgrpo's GPU path on a machine:

- `make install-gpu` (a GPU node with network, SGLang rollout): `gpu_requirements()`, which
  tools/gpu_requirements.py prints: fastgrpo's requirements without its CPU torch pin, the extras a GPU
  run uses (`GPU_EXTRAS`), SGLang's torch (`GPU_TORCH`), and every package of `WHEELS` at its pin there;
- `tools/gpu_check.sh` (an offline machine with torch, transformers, safetensors and numpy, `BASE`): the
  no-deps wheels of `WHEELS`, fetched by tools/gpu_wheels.sh (`--wheel-specs`) and installed where the
  machine lacks the package or has an older version (`wheels_to_install`).

So the packages both installs put on a GPU machine come at the same versions: `WHEELS` is their one
list (tests/test_gpu_check.py checks that each pin is what the tests ran, that it satisfies
pyproject.toml's own requirement, and that `gpu_requirements()` carries every one of them verbatim).
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
# Pinned as the project's tested environment has them; --no-deps wheels, so every requirement of each
# is either here or comes with torch / transformers (tests/test_gpu_check.py checks both).
WHEELS = (
    "omegaconf==2.4.0", "antlr4-python3-runtime==4.13.2", "PyYAML==6.0.4",  # the config
    "tqdm==4.70.1",  # progress bars (SFT, draft)
    "math-verify==0.9.0", "latex2sympy2_extended==1.11.0", "sympy==1.14.0", "mpmath==1.3.0",  # rewards (SFT eval)
    "megatron-core==0.16.1", "psutil==7.2.2",  # the Megatron trainer
)
BASE = ("torch", "transformers", "safetensors", "numpy")  # what the offline GPU machine's Python has
# the versions of BASE's torch and transformers that machine's image holds, as its last check recorded them
# (bench/gpu/gpu_check.json's environment): tools/gpu_rehearsal.sh runs the check on a CPU under them
GPU_MACHINE = ("torch==2.11.0", "transformers==5.17.0")
GPU_TORCH = "torch==2.14.1"  # sglang 0.5.23's Requires-Dist (fastgrpo's own pin, 2.13.0, is the CPU build's)
GPU_EXTRAS = ("test", "megatron", "sglang")  # deepspeed stays on CPU installs (built from source against torch)


def name(requirement: str) -> str:
    """A requirement's distribution name, normalised (PEP 503)."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.\-]+", requirement).group(0)).lower()


def pinned(requirement: str) -> str:
    """The exact version a `name==version` pin names."""
    return requirement.split("==", 1)[1].strip()


def gpu_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """What `make install-gpu` installs: fastgrpo's requirements and `GPU_EXTRAS`' with the CPU torch pin
    replaced by `GPU_TORCH` and each package of `WHEELS` at its pin there (the others it brings in come
    pinned too: both installs have the same versions of all of them)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in GPU_EXTRAS:
        wanted += project["optional-dependencies"][extra]
    wheels = {name(w): w for w in WHEELS}
    reqs = [wheels.get(name(r), r) for r in dict.fromkeys(wanted) if name(r) != "torch"]
    return list(dict.fromkeys(reqs + list(WHEELS))) + [GPU_TORCH]


def _release_key(version: str) -> Any:
    """A version's order: packaging's Version where it is there (it comes with pip), else its release
    numbers."""
    try:
        from packaging.version import Version

        return Version(version)
    except Exception:  # no packaging, or a version it cannot parse
        return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:4])


def wheels_to_install(wheels: list[Path], installed=None) -> list[Path]:
    """The carried wheels this Python lacks, or has only in an older version (an old omegaconf breaks the
    config, an old antlr4 runtime breaks math-verify); a newer installed version stays in charge.
    `installed(name)`: the installed version or None (default: importlib.metadata)."""
    import importlib.metadata as metadata

    def version_here(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    installed = installed or version_here
    chosen = []
    for wheel in sorted(wheels):
        name, version = wheel.name.split("-")[:2]  # a wheel's file name: name-version-...
        have = installed(name)
        if have is None or _release_key(have) < _release_key(version):
            chosen.append(wheel)
        print(f"gpu_check: {name} {version}: " + ("absent, installing" if have is None else
              f"{have} installed, " + ("older: installing" if wheel in chosen else "keeping it")), file=sys.stderr)
    return chosen
