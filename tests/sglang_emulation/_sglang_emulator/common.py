"""What the emulated scheduler shares: SGLang's constants it mirrors, the error it raises where SGLang
would crash, hang or compute garbage, the producer side of tensor IPC, and what SGLang derives at start
(dtypes, the decode batch sizes it captures CUDA graphs for, the eos ids)."""

from __future__ import annotations

import base64
import itertools
import json
import pickle
from pathlib import Path
from typing import Any

import torch

ALL_TAGS = ("kv_cache", "weights", "cuda_graph")  # constants.py GPU_MEMORY_ALL_TYPES
TOP_K_ALL = 1 << 30  # sampling/sampling_params.py
DEFAULT_ADAPTIVE_CONFIG = {"1": [1, 3, 5, 7], "8": [0, 1, 3], "32": [0, 1], "64": [0]}  # adaptive_spec_params.py


class EmulationError(AssertionError):
    """SGLang would crash, hang or compute garbage here."""


# -- the producer side of tensor IPC ----------------------------------------------------------------------

class _IPC:
    """CUDA IPC as SGLang relies on it: every serialize() is one producer-side handle, consumed by
    exactly one rank; the producer's reductions carry device UUIDs once monkey_patch_torch_reductions
    has run (utils/patch_torch.py)."""

    patched = False
    _ids = itertools.count()
    consumed: set[int] = set()

    @classmethod
    def serialize(cls, obj, output_str: bool) -> bytes | str:
        data = pickle.dumps(("sglang-emulated-ipc", next(cls._ids), cls.patched, obj))
        return base64.b64encode(data).decode() if output_str else data

    @classmethod
    def deserialize(cls, data) -> Any:
        if isinstance(data, str):
            data = base64.b64decode(data)
        tag, handle, patched, obj = pickle.loads(data)
        if tag != "sglang-emulated-ipc":
            raise EmulationError("not a MultiprocessingSerializer payload")
        if not patched:
            raise EmulationError("the producer serialised tensors without monkey_patch_torch_reductions(): their "
                                 "CUDA IPC handles carry device indices, which the scheduler's process reads as its "
                                 "own devices")
        if handle in cls.consumed:
            raise EmulationError("one serialised payload was deserialised twice (by two tensor-parallel ranks): "
                                 "SGLang needs one serialised copy per rank (producer-side CUDA IPC reference counts)")
        cls.consumed.add(handle)
        return obj


def reset_ipc() -> None:
    _IPC.patched = False


# -- dtypes as SGLang resolves them ----------------------------------------------------------------------

_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
           "bfloat16": torch.bfloat16}


def resolve_dtype(config: dict, dtype: str) -> torch.dtype:
    """configs/model_config.py _get_and_verify_dtype for a config dict."""
    config_dtype = _DTYPES.get(config.get("dtype") or config.get("torch_dtype"), torch.float32)
    if dtype == "auto":
        return torch.float16 if config_dtype == torch.float32 else config_dtype
    return _DTYPES[dtype]


# -- what the scheduler derives from its start ---------------------------------------------------------

H100_DECODE_MAX_BS = 256  # arg_groups/memory_hook.py:133-143: an 80 GB GPU at tp_size < 4 (the emulated GPU)


def decode_capture_sizes(args) -> list[int]:
    """The decode batch sizes SGLang captures CUDA graphs for (cuda_graph_config.decode.bs), with
    padding allowed: up to cuda_graph_max_bs_decode if given (arg_groups/cuda_graph_hook.py:72-73),
    else the GPU's default capped at max_running_requests (arg_groups/memory_hook.py:133-143, 182-188),
    listed by generate_decode_cuda_graph_batch_sizes (cuda_graph_hook.py:500-532; memory_hook.py:201-205)."""
    max_bs = args.cuda_graph_max_bs_decode
    if max_bs is None:
        max_bs = H100_DECODE_MAX_BS if args.tp_size < 4 else 2 * H100_DECODE_MAX_BS
        if args.max_running_requests is not None:
            max_bs = min(max_bs, args.max_running_requests)
    if args.speculative_algorithm is None:
        sizes = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 512, 16), *range(512, max_bs + 1, 32)]
    else:  # "Spec decoding case: less padding for smaller batch sizes"
        sizes = [*range(1, 9), *range(10, 33, 2), *range(40, 65, 4), *range(72, 257, 8), *range(272, max_bs + 1, 16)]
    sizes = [s for s in sizes if s <= max_bs]
    return sizes if max_bs in sizes else [*sizes, max_bs]


def hf_eos_token_ids(path: Path, config: dict) -> set[int]:
    """ModelConfig._get_hf_eos_token_id (configs/model_config.py:2190-2208): config.json's eos_token_id
    and generation_config.json's (read with GenerationConfig.from_pretrained, absent is fine:
    model_config.py:683-688, utils/hf_transformers/common.py:698-731), each an int or a list."""
    def ids(value) -> set[int]:
        return set() if value is None else {value} if isinstance(value, int) else set(value)

    eos = ids(config.get("eos_token_id"))
    generation = path / "generation_config.json"
    if generation.is_file():
        eos |= ids(json.loads(generation.read_text()).get("eos_token_id") or None)
    return eos
