"""What a GPU node installs (`make install-gpu`): SGLang pins its own CUDA torch (sglang 0.5.23:
torch==2.14.1), which fastgrpo's CPU pin (torch==2.13.0) cannot share, so a GPU install is its own:
fastgrpo's requirements without its torch pin, the extras a GPU run uses (test, megatron, and the
`sglang` extra's pin), the torch SGLang pins, and the packages the offline GPU check carries as wheels
at the same pins; fastgrpo itself then goes in without dependencies. The pins are
fastgrpo/bench/gpu_check/pins.py's, which tools/gpu_check.sh's wheels come from too (one list: the two
GPU installs cannot drift apart).

    python tools/gpu_requirements.py            # the requirement lines
    python tools/gpu_requirements.py --resolve  # pip resolves them (--dry-run, nothing installed)

tests/test_sglang_conformance.py checks the torch pin against the sglang wheel's own metadata and
that the list resolves; tests/test_gpu_check.py that both installs take the same pins.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script before fastgrpo is installed (`make install-gpu`)
    sys.path.insert(0, str(ROOT))

from fastgrpo.bench.gpu_check.pins import gpu_requirements  # noqa: E402  (the pins: one list for both GPU installs)

# what pip prints when it cannot reach a package index: urllib3's warnings as it retries (pip 26 logs
# the failed fetch itself only at debug level, and then says "No matching distribution found" as for a
# pin the index lacks), pip's "Could not fetch URL" (older pips), its connection diagnostics
UNREACHABLE = ("NewConnectionError", "NameResolutionError", "Failed to establish a new connection", "Max retries exceeded",
               "Could not fetch URL", "connection-failed", "connection-timeout", "Failed to connect to",
               "Failed to resolve", "Temporary failure in name resolution", "Name or service not known",
               "Network is unreachable", "Connection refused", "ConnectTimeoutError", "ReadTimeoutError", "ProxyError")


def requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The GPU install's requirement lines (pins.gpu_requirements)."""
    return gpu_requirements(pyproject)


def resolve(reqs: list[str], timeout: float = 600, index: Sequence[str] = ()) -> tuple[bool, dict[str, str], str]:
    """(resolved, name -> version pip chose, pip's output) for `pip install --dry-run` of `reqs`
    into an empty environment; `index`: pip's index options, if not its configured index."""
    with tempfile.TemporaryDirectory() as tmp:
        listing, report = Path(tmp) / "requirements.txt", Path(tmp) / "report.json"
        listing.write_text("\n".join(reqs) + "\n")
        run = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                              *index, "--report", str(report), "-r", str(listing)], capture_output=True, text=True,
                             timeout=timeout)
        if run.returncode != 0 or not report.is_file():
            return False, {}, run.stdout + run.stderr
        chosen = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
        return True, chosen, run.stdout + run.stderr


def unreachable(out: str) -> bool:
    """Whether pip's output of a failed resolve says only that the package index could not be reached
    (then nothing is known of the install). Any other failure is the install's: a conflict, or a
    pin the index has no distribution for ("No matching distribution found", which pip also prints
    offline, but then with no versions listed and after warnings of a connection error: pip retries
    a failed fetch, 5 times unless told otherwise, and says so)."""
    return (any(m in out for m in UNREACHABLE) and "ResolutionImpossible" not in out
            and re.search(r"\(from versions: (?!none\))", out) is None)


def main() -> None:
    reqs = requirements()
    if sys.argv[1:] == ["--resolve"]:
        ok, chosen, out = resolve(reqs)
        if not ok:
            if unreachable(out):
                sys.exit(f"pip could not reach the package index to resolve the GPU install:\n{out[-1000:]}")
            sys.exit(f"the GPU install does not resolve:\n{out[-3000:]}")
        print(f"the GPU install resolves: {len(chosen)} packages; " +
              ", ".join(f"{k}=={chosen[k]}" for k in ("sglang", "torch", "transformers", "megatron-core") if k in chosen))
    else:
        print("\n".join(reqs))


if __name__ == "__main__":
    main()
