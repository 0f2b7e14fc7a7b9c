"""What a GPU node installs (`make install-gpu`): SGLang pins its own CUDA torch (sglang 0.5.23:
torch==2.14.1), which fastgrpo's CPU pin (torch==2.13.0) cannot share, so a GPU install is its own:
fastgrpo's requirements without its torch pin, the extras a GPU run uses (test, megatron, and the
`sglang` extra's pin), and the torch SGLang pins; fastgrpo itself then goes in without
dependencies.

    python tools/gpu_requirements.py            # the requirement lines
    python tools/gpu_requirements.py --resolve  # pip resolves them (--dry-run, nothing installed)

tests/test_sglang_conformance.py checks the torch pin against the sglang wheel's own metadata and
that the list resolves.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPU_TORCH = "torch==2.14.1"  # sglang 0.5.23's Requires-Dist
GPU_EXTRAS = ("test", "megatron", "sglang")  # deepspeed stays on CPU installs (built from source against torch)


def name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.\-]+", requirement).group(0).lower().replace("_", "-")


def requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in GPU_EXTRAS:
        wanted += project["optional-dependencies"][extra]
    return [r for r in dict.fromkeys(wanted) if name(r) != "torch"] + [GPU_TORCH]


def resolve(reqs: list[str], timeout: float = 600) -> tuple[bool, dict[str, str], str]:
    """(resolved, name -> version pip chose, pip's output) for `pip install --dry-run` of `reqs`
    into an empty environment."""
    with tempfile.TemporaryDirectory() as tmp:
        listing, report = Path(tmp) / "requirements.txt", Path(tmp) / "report.json"
        listing.write_text("\n".join(reqs) + "\n")
        run = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                              "--report", str(report), "-r", str(listing)], capture_output=True, text=True,
                             timeout=timeout)
        if run.returncode != 0 or not report.is_file():
            return False, {}, run.stdout + run.stderr
        chosen = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
        return True, chosen, run.stdout + run.stderr


def main() -> None:
    reqs = requirements()
    if sys.argv[1:] == ["--resolve"]:
        ok, chosen, out = resolve(reqs)
        if not ok:
            sys.exit(f"the GPU install does not resolve:\n{out[-3000:]}")
        print(f"the GPU install resolves: {len(chosen)} packages; " +
              ", ".join(f"{k}=={chosen[k]}" for k in ("sglang", "torch", "transformers", "megatron-core") if k in chosen))
    else:
        print("\n".join(reqs))


if __name__ == "__main__":
    main()
