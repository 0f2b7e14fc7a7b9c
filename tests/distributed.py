"""Running a function on a real torch.distributed world (gloo) of spawned processes, as torchrun would:
every rank sees RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT; a deadline bounds the whole world, and
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


def _rank_main(fn, rank: int, world: int, port: int, out: Path, args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        result = fn(rank, world, *args)
        torch.save({"ok": result}, out / f"rank{rank}.pt")
    except BaseException:
        torch.save({"error": traceback.format_exc()}, out / f"rank{rank}.pt")
        raise


def run_world(fn, world: int, tmp: Path, *args, timeout_s: float = 180.0) -> list:
    """fn(rank, world, *args) on `world` processes; returns each rank's result (rank order)."""
    tmp.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, port, tmp, args), daemon=True) for r in range(world)]
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
