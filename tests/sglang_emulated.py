"""The emulated SGLang (tests/sglang_emulation) as `sglang`, for tests that run the adapter on CPU.

`emulated_sglang()` puts the emulation first on the import path (removing any `sglang` already
imported, and putting it back after) and lets the adapter's GPU check pass; it yields the
emulator package, whose knobs tests may set (`scheduler.DEFAULT_CHUNKED_PREFILL`, `reset_ipc`).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

EMULATION = Path(__file__).parent / "sglang_emulation"


def _ours(name: str) -> bool:
    return name in ("sglang", "_sglang_emulator") or name.startswith(("sglang.", "_sglang_emulator."))


@contextmanager
def emulated_sglang() -> Iterator:
    from fastgrpo.engines.sglang import adapter as sglang_engine

    saved = {k: sys.modules.pop(k) for k in [k for k in sys.modules if _ours(k)]}
    sys.path.insert(0, str(EMULATION))
    gpus = sglang_engine.gpus_available
    sglang_engine.gpus_available = lambda: True
    try:
        emulator = importlib.import_module("_sglang_emulator")
        emulator.reset_ipc()
        yield emulator
    finally:
        sglang_engine.gpus_available = gpus
        sys.path.remove(str(EMULATION))
        for k in [k for k in sys.modules if _ours(k)]:
            del sys.modules[k]
        sys.modules.update(saved)


def scheduler(engine):
    """The emulated scheduler behind an SGLangEngine adapter (what SGLang received, its state)."""
    return engine._engine.tokenizer_manager._scheduler
