"""The gpu check's entry points: `run` (every stage in order) and `main` (`python -m
fastgrpo.bench.gpu_check`, `fastgrpo bench gpu-check`, tools/gpu_check.sh)."""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

from fastgrpo.bench.gpu_check.harness import SIZES, STAGES, Check, log, release
from fastgrpo.bench.gpu_check.pins import WHEELS, wheels_to_install
from fastgrpo.bench.gpu_check.report import against_simulator, dumps, finite, markdown
from fastgrpo.bench.gpu_check.targets import targets
from fastgrpo.bench.gpu_check.stages import STAGE_FUNCTIONS


def run(out: Path, size: str = "gpu", device: str = "auto", work: Path | None = None,
        stages: tuple[str, ...] = STAGES, overrides: list[str] | None = None, budget_s: float | None = None) -> int:
    """Every stage in order; 0 if all succeeded, else 1. The policy, draft and cost model go to `work`
    (default: a temporary directory, removed at the end). `budget_s`: the whole run's (default: the
    size's, 540 s at gpu size), which the last stage (rollout) fits itself into."""
    own_work = work is None
    work = Path(tempfile.mkdtemp(prefix="fastgrpo-gpu-check-")) if own_work else Path(work)
    try:
        check = Check(Path(out), work, size, device, list(overrides or []), budget_s, stages)
        log(f"size {size} on {check.compute.device} ({check.compute.dtype}); results in {out}/gpu_check.json and .md")
        for name in stages:
            check.stage(name, lambda name=name: STAGE_FUNCTIONS[name](check))
            if name == "weight_push":  # the trainers are done with: their memory goes back before rollout
                check.held.clear()
                release()
        check.result["meta"]["imported_modules"] = sorted({n.split(".")[0] for n in list(sys.modules)})
        if sim := against_simulator(check.result):
            check.result["against_simulator"] = sim
        check.result["meta"]["within_budget"] = not check.budget_s or check.seconds() <= check.budget_s
        check.write()
        failed = [n for n, s in check.result["stages"].items() if s["status"] != "ok"]
        print("\n" + (Path(out) / "gpu_check.md").read_text(), flush=True)  # the tables in the log too
        log(f"done in {check.seconds():.0f}s" + (f"; FAILED: {', '.join(failed)}" if failed else "; every stage ok")
             + f"; wrote {out}/gpu_check.json and {out}/gpu_check.md")
        if not check.result["meta"]["within_budget"]:
            log(f"over the budget of {check.budget_s:.0f}s ({check.seconds():.0f}s)")
        for t in targets(check.result):  # (last: a log's tail is what a short-lived machine hands back)
            log(f"target: {t.target}: {t.measured}: {t.verdict}")
        return 1 if failed else 0
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():  # the Megatron trainer's world of one
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        if own_work:
            shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastgrpo.bench.gpu_check", description=sys.modules[__package__].__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/gpu_check", help="directory of gpu_check.json and gpu_check.md")
    p.add_argument("--size", choices=sorted(SIZES), default="gpu", help="gpu (~308M policy, ~9 minutes on an H100 or H200) "
                   "or test (toy sizes, seconds, any device)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")  # config.DEVICES
    p.add_argument("--work", help="where the policy, draft and cost model go (default: a temporary directory, removed)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {', '.join(STAGES)}")
    p.add_argument("--budget-s", type=float, help="the whole run's seconds, which rollout (the last stage) fits "
                   "itself into (default: 540 at gpu size, none at test size; 0: none)")
    p.add_argument("--check-replays", action="store_true", help="where no CUDA graph is captured (a CPU), hold every "
                   "static step to what a replay of its graph would compute (slower; with engine.steps=static on a CPU)")
    p.add_argument("--wheel-specs", action="store_true", help="print the wheels the GPU machine needs and exit")
    p.add_argument("--wheels-to-install", metavar="DIR", help="print the wheels in DIR this Python lacks or has "
                   "in an older version, and exit (tools/gpu_check.sh installs those)")
    p.add_argument("--report", metavar="JSON", help="rewrite the tables (gpu_check.md beside it) from a run's "
                   "gpu_check.json, and exit (no device needed)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. sft.max_minutes=1")
    args = p.parse_args(argv)
    if args.wheel_specs:
        print(" ".join(WHEELS))
        return 0
    if args.wheels_to_install:
        print("\n".join(str(w) for w in wheels_to_install(list(Path(args.wheels_to_install).glob("*.whl")))))
        return 0
    if args.report:
        path = Path(args.report)
        result = json.loads(path.read_text())
        if sim := against_simulator(result):
            result["against_simulator"] = sim
            path.write_text(dumps(finite(result)))
        (path.parent / "gpu_check.md").write_text(markdown(result))
        print((path.parent / "gpu_check.md").read_text())
        return 0
    stages = tuple(s for s in args.stages.split(",") if s)
    if unknown := [s for s in stages if s not in STAGES]:
        p.error(f"unknown stages {unknown}; choose from {', '.join(STAGES)}")
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.check_replays:
        from fastgrpo.engines.embedded import graphs

        graphs.CHECK_REPLAYS = True
    return run(Path(args.out), args.size, args.device, Path(args.work) if args.work else None, stages, args.overrides,
               args.budget_s)


# -- `fastgrpo bench gpu-check`: its sub-parser (fastgrpo/bench/command.py) --
def add_arguments(parser) -> None:
    """`fastgrpo bench gpu-check`: no flags of its own (--output is its directory, --quick its toy size,
    key=value overrides go to its config, which it builds itself: no --config)."""
    parser.set_defaults(run=from_cli, needs=None)


def from_cli(args, cfg) -> int:
    if args.config:
        raise ValueError("bench gpu-check builds its own config: give key=value overrides, not --config")
    return main([*(["--out", args.output] if args.output else []), *(["--size", "test"] if args.quick else []),
                 *args.overrides])
