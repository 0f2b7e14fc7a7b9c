"""Where a run computes and in what precision: `device` and `trainer.precision` resolved against the
machine, once, before any work (a config that asks for what the machine lacks fails naming its key).

`fastgrpo plan` does not resolve them: it plans GPU clusters from a login node without one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from fastgrpo.config import Config, ConfigError


@dataclass(frozen=True)
class Compute:
    device: torch.device
    dtype: torch.dtype  # the weights' and activations' dtype (master weights and reductions stay fp32)

    @property
    def bf16(self) -> bool:
        return self.dtype == torch.bfloat16


def cpu_has_bf16() -> bool:
    """A CPU whose matmuls run in bf16 natively (AVX512-BF16 or AMX): elsewhere torch emulates them,
    slowly, and a bf16 run is not worth it."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def cpu_description() -> str:
    """The host CPU as a benchmark's header names it: its model (Linux's /proc/cpuinfo, else the platform's
    word) and the vector ISA torch's CPU kernels use (`torch.backends.cpu.get_cpu_capability()`). Timings
    move between CPU types (kernels differ), so figures from two sessions compare only on the same one."""
    import platform

    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    return f"{model}, {torch.backends.cpu.get_cpu_capability()}"


# Tests set this to enter every device context on the CPU too, as a GPU run does, so that a tensor made
# outside one shows (tests/device_guard.py).
ENTER_CPU_CONTEXT = False


@contextlib.contextmanager
def thread_count(threads: int | None) -> Iterator[None]:
    """torch's CPU thread count at `threads` (None or 0: unchanged) inside, and back to what it was after:
    the count is the process's, and a run called in-process (a test, a notebook, the GPU check) must not
    leave it changed for whatever runs next (a matmul's last bits can follow the count)."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """`device` as the default device of the tensor factories called inside (the engine's and the
    calibration's work runs in it); skipped on a CPU, where that is where tensors go anyway and the
    context would cost a Python call per torch op, unless ENTER_CPU_CONTEXT."""
    return device if device.type != "cpu" or ENTER_CPU_CONTEXT else contextlib.nullcontext()


def resolve(cfg: Config) -> Compute:
    """The device and dtype of `cfg` on this machine."""
    cuda = torch.cuda.is_available()
    if cfg.device == "cuda" and not cuda:
        raise ConfigError("device cuda: this machine has no CUDA device (torch.cuda.is_available() is false); "
                          "use device=cpu or auto")
    device = torch.device("cuda" if cfg.device == "cuda" or (cfg.device == "auto" and cuda) else "cpu")
    precision = cfg.trainer.precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    if precision == "bf16":
        supported = torch.cuda.is_bf16_supported() if device.type == "cuda" else cpu_has_bf16()
        if not supported:
            raise ConfigError(f"trainer.precision bf16: this {device.type.upper()} has no native bf16 "
                              f"(use trainer.precision=fp32)")
    return Compute(device, torch.bfloat16 if precision == "bf16" else torch.float32)
