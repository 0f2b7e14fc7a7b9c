"""sglang/srt/utils (re-exporting utils/common.py): the tensor serializer weight updates use."""

from _sglang_emulator import _IPC


class MultiprocessingSerializer:
    @staticmethod
    def serialize(obj, output_str: bool = False):
        return _IPC.serialize(obj, output_str)

    @staticmethod
    def deserialize(data):
        return _IPC.deserialize(data)
