"""Catching, on a machine with one device, a tensor that would land on the wrong device on a GPU.

On a GPU a tensor factory called without a device (`torch.zeros(n)`, `torch.arange(k)`,
`torch.tensor(list)`) makes a CPU tensor, and the first op that meets a CUDA tensor raises. On the CPU every
tensor is on the one device, so no test sees it. `StrictDevice` closes that gap: while it is active, a
factory call made from fastgrpo's own code with no device (neither a `device=` argument nor an enclosing
`with torch.device(...)`, which fills the argument in before this mode sees the call) is recorded with its
file and line and the fastgrpo frames that led there. Code that means a host tensor says `device="cpu"`;
code that means the compute device names it or derives it (`x.new_zeros`, `torch.zeros_like`, which follow
their source and are not checked); a constructor that leaves the choice to its caller passes its
`device=None` on, as torch's modules do (an explicit None is the caller's decision, not an omission).

Library code (torch, transformers, megatron) is not checked: only frames of the `fastgrpo` package count,
the nearest one on the stack deciding, so a library building its own CPU scratch is left alone.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

# the factories that take a device and make a tensor from nothing (the *_like ones follow their source)
FACTORIES = frozenset({
    torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn, torch.randint, torch.randperm,
    torch.arange, torch.linspace, torch.logspace, torch.eye, torch.tensor, torch.as_tensor, torch.scalar_tensor,
    torch.empty_strided, torch.tril_indices, torch.triu_indices,
})


def _caller() -> tuple[str, str] | None:
    """(module, "file:line <- file:line ...") of the nearest frame outside torch and this file, with the
    fastgrpo frames that called it (where the call came from)."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module != __name__ and not module.startswith("torch"):
            break
        frame = frame.f_back
    if frame is None:
        return None
    module, chain = frame.f_globals.get("__name__", ""), []
    while frame is not None and len(chain) < 4:
        if frame.f_globals.get("__name__", "").startswith("fastgrpo"):
            chain.append(f"fastgrpo/{frame.f_code.co_filename.rsplit('fastgrpo/', 1)[-1]}:{frame.f_lineno}")
        frame = frame.f_back
    return module, " <- ".join(chain)


class StrictDevice(TorchFunctionMode):
    """Records every tensor factory that fastgrpo's code calls without a device (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.violations: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and "device" not in kwargs:
            from_tensor = func is torch.as_tensor and args and isinstance(args[0], torch.Tensor)
            caller = None if from_tensor else _caller()
            if caller is not None and caller[0].split(".")[0] == "fastgrpo":
                site = f"torch.{func.__name__} without a device at {caller[1]}"
                if site not in self.violations:
                    self.violations.append(site)
        return func(*args, **kwargs)


@contextmanager
def strict_device() -> Iterator[StrictDevice]:
    """`with strict_device() as guard: ...; assert not guard.violations`."""
    mode = StrictDevice()
    with mode:
        yield mode
