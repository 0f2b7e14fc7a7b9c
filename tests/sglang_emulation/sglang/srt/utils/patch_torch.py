"""sglang/srt/utils/patch_torch.py: tensor reductions that carry device UUIDs (idempotent)."""

from _sglang_emulator import _IPC


def monkey_patch_torch_reductions():
    _IPC.patched = True
