"""How a fastgrpo process ends (standard library only: the GPU check's driver runs it before torch is
installed, and a rank's helper processes import it without paying for torch)."""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
import threading
from typing import NoReturn


def end_process(code: int) -> NoReturn:
    """End this process with exit status `code` the way the interpreter would (the threading module's
    shutdown: idle thread pools told to stop, then the other non-daemon threads joined; then every exit
    handler: the process groups' destruction, MLflow's, logging's, multiprocessing's), but without the
    interpreter's finalization after them. Called from the main thread.

    Why: `close_world` cannot free a gloo group that something else still holds (DeepSpeed's engine,
    its ZeRO-3 parameters and its module globals hold the world group), so the group's worker threads
    outlive it. A worker that releases a collective's tensors (Python objects) once finalization has
    begun cannot take the GIL and the process aborts with SIGABRT ("terminate called without an
    active exception"); under torchrun that fails the job after its work is done. Nothing is lost by
    skipping finalization: every file is closed and every exit handler has run by then."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("end_process must be called from the main thread (it joins the others)")
    threading._shutdown()  # what the interpreter runs first at exit: thread pools told to stop, then threads joined
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed stream or pipe
            pass
    os._exit(code)


def die_with_parent() -> None:
    """End this process with SIGKILL when its parent dies (Linux's parent-death signal; a no-op
    elsewhere): a rank's helpers must not outlive a rank that was killed without a chance to end them."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def serve_for(rank_pid: int) -> None:
    """In a helper server of rank `rank_pid` (the checkpoint writer's results server): deaf to SIGTERM,
    killed when its rank dies (Linux's parent-death signal; elsewhere it ends when the job's processes
    are ended). Here, not beside the trainer, because the server is a fresh interpreter that imports
    this function's module: standard library only, it starts without importing torch (~2 s a rank)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent()
    if os.getppid() != rank_pid:  # the rank died before the signal was armed
        os._exit(1)
