"""Checkpoint conversion: Hugging Face <-> Megatron distributed checkpoints at any TP x PP, reshard,
verify, inspect, and the draft head exported for SGLang.

    python tools/convert_checkpoint.py SUBCOMMAND --help

The command users call; the library is `fastgrpo/conversion/` (its package docstring says why it is
built as it is), which this module re-exports.
"""

from fastgrpo.conversion import *  # noqa: F401,F403  (the library's names, for `from tools import convert_checkpoint`)
from fastgrpo.conversion.cli import main
from fastgrpo.process_exit import end_process

if __name__ == "__main__":
    end_process(main())  # no abort at exit from a group something still holds
