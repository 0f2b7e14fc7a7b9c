"""A function on a world of spawned processes on this machine, as torchrun would set it up (every rank
sees RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT): what the tests and benches use to run
multi-rank code without a launcher. A deadline bounds the whole world, and the processes started here
(and only those, with whatever they started) are ended by pid if it passes.

The ranks are not daemonic processes, as under torchrun: megatron's distributed checkpointing writes
its files from child processes, which a daemonic process may not have.

Without CUDA the ranks are forked from one server process that has imported torch, megatron-core,
transformers and fastgrpo's loop once (multiprocessing's forkserver; the server lives as long as this
process): a fresh interpreter spends ~6 s of CPU importing them, so a world of 4 on two cores took ~14 s to
start and now takes ~0.2 s after the first. A rank still starts with this process's sys.path, working
directory and, set here, its environment at the call, as a spawned one would. With CUDA the ranks are
spawned: a child forked after the CUDA driver was initialized cannot use CUDA, and the server's imports
(megatron-core's among them) may initialize it."""

from __future__ import annotations

import multiprocessing.connection
import os
import signal
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

from fastgrpo.distributed import free_port
from fastgrpo.process_exit import end_process


def kill_tree(pid: int) -> None:
    """End process `pid` and every process it started (by pid, children first)."""
    try:
        import psutil

        children = psutil.Process(pid).children(recursive=True)
    except Exception:  # psutil missing, or the process already gone
        children = []
    for child in children:
        try:
            child.kill()
        except Exception:
            pass
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# what a rank imports in most worlds (the trainers, the policy models, the loop); one missing is skipped
PRELOAD = ["__main__", "torch", "torch.distributed", "megatron.core", "transformers.models.llama.modeling_llama",
           "transformers.models.qwen2.modeling_qwen2", "transformers.models.qwen3.modeling_qwen3",
           "transformers.models.qwen3_moe.modeling_qwen3_moe", "fastgrpo.train",
           "fastgrpo.trainers.megatron.trainer"]


def _context():
    """How ranks start: forked from a server that preloads `PRELOAD` where there is no CUDA, else spawned."""
    if torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: on this process's first world
    return ctx


def _rank_main(fn, rank: int, world: int, port: int, out: Path, args: tuple, threads: int,
               environment: dict[str, str]) -> None:
    os.environ.clear()  # a forked rank has the server's environment, from when it started
    os.environ.update(environment)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    try:
        result = fn(rank, world, *args)
        torch.save({"ok": result}, out / f"rank{rank}.pt")
    except BaseException:
        torch.save({"error": traceback.format_exc()}, out / f"rank{rank}.pt")
        raise
    end_process(0)  # as the `fastgrpo` command ends a rank


def run_world(fn, world: int, tmp: Path, *args, timeout_s: float = 180.0, threads: int = 1) -> list:
    """fn(rank, world, *args) on `world` processes of `threads` torch threads each; returns each rank's
    result (rank order), or raises with a failed rank's traceback."""
    tmp.mkdir(parents=True, exist_ok=True)
    ctx = _context()
    port = free_port()
    environment = dict(os.environ)
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, port, tmp, args, threads, environment))
             for r in range(world)]
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.start()
        # until every rank is done, the deadline passes, or a rank fails (the others would wait for it
        # in a collective until their own timeout: they are ended now)
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            multiprocessing.connection.wait([p.sentinel for p in procs if p.is_alive()], timeout=1.0)
    finally:
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            kill_tree(p.pid)
            p.join(5)
    saved = [torch.load(tmp / f"rank{r}.pt", weights_only=False) if (tmp / f"rank{r}.pt").is_file() else None
             for r in range(world)]
    for r, out in enumerate(saved):
        if out is not None and "error" in out:
            raise RuntimeError(f"rank {r} of {world} failed:\n{out['error']}")
    ended = [r for r, p in enumerate(procs) if p in alive]
    for r, p in enumerate(procs):  # a rank that returns and then exits badly fails too, as under torchrun
        if p not in alive and p.exitcode not in (None, 0):
            raise RuntimeError(f"rank {r} of {world} exited with code {p.exitcode} "
                               + ("after its result" if saved[r] is not None else "without a result")
                               + (f" (ranks {ended} were ended then)" if ended else ""))
    for r, out in enumerate(saved):
        if out is None:
            raise TimeoutError(f"rank {r} of {world} gave no result within {timeout_s:.0f}s"
                               + (" (killed)" if alive else ""))
    return [out["ok"] for out in saved]
