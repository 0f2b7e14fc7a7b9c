"""sglang/srt/managers/scheduler.py: the Scheduler class (the emulator's), which plugins extend."""

from _sglang_emulator import Scheduler  # noqa: F401
