"""An emulation of the parts of SGLang 0.5.23 that fastgrpo's adapter uses, for tests on CPU.

Every public module, class, function, signature, field and constant in this package is checked
against the real sglang 0.5.23 source by tests/test_sglang_conformance.py (names starting with an
underscore are the emulation's own). The behaviour behind it is in ../_sglang_emulator/.
"""

from sglang.srt.entrypoints.engine import Engine  # noqa: F401  (sglang: a LazyImport of the same)
from sglang.srt.server_args import ServerArgs  # noqa: F401

__version__ = "0.5.23"
