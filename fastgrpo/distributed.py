"""Running a function on a torch.distributed world of spawned processes on this machine, as torchrun
would set it up (every rank sees RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT): what the tests and
`bench trainer` use to run multi-rank code without a launcher. A deadline bounds the whole world, and
the processes started here (and only those) are ended by pid if it passes."""

from __future__ import annotations

import os
import socket
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank: int, world: int, port: int, out: Path, args: tuple, threads: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    try:
        result = fn(rank, world, *args)
        torch.save({"ok": result}, out / f"rank{rank}.pt")
    except BaseException:
        torch.save({"error": traceback.format_exc()}, out / f"rank{rank}.pt")
        raise


def run_world(fn, world: int, tmp: Path, *args, timeout_s: float = 180.0, threads: int = 1) -> list:
    """fn(rank, world, *args) on `world` processes of `threads` torch threads each; returns each rank's
    result (rank order), or raises with a failed rank's traceback."""
    tmp.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, port, tmp, args, threads), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=timeout_s)
    finally:
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
            p.join(5)
    results = []
    for r in range(world):
        path = tmp / f"rank{r}.pt"
        if not path.is_file():
            raise TimeoutError(f"rank {r} of {world} gave no result within {timeout_s:.0f}s"
                               + (" (killed)" if alive else ""))
        saved = torch.load(path, weights_only=False)
        if "error" in saved:
            raise RuntimeError(f"rank {r} of {world} failed:\n{saved['error']}")
        results.append(saved["ok"])
    return results
