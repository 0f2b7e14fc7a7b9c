"""How a fastgrpo process ends (standard library only: the GPU check's driver runs it before torch is
installed)."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def end_process(code: int) -> NoReturn:
    """End this process with exit status `code` the way the interpreter would (its other non-daemon
    threads joined, every exit handler run: the process groups' destruction, MLflow's, logging's,
    multiprocessing's), but without the interpreter's finalization after them.

    Why: `close_world` cannot free a gloo group that something else still holds (DeepSpeed's engine,
    its ZeRO-3 parameters and its module globals hold the world group), so the group's worker threads
    outlive it. A worker that releases a collective's tensors (Python objects) once finalization has
    begun cannot take the GIL and the process aborts with SIGABRT ("terminate called without an
    active exception"); under torchrun that fails the job after its work is done. Nothing is lost by
    skipping finalization: every file is closed and every exit handler has run by then."""
    main = threading.main_thread()
    for thread in threading.enumerate():
        if thread is not main and thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed stream or pipe
            pass
    os._exit(code)
