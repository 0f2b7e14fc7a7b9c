"""Index constants of the step functions (ranges, identities, fills), made once per shape and device.

In a captured graph every tensor a step makes is a kernel at each replay, however constant its values: an
`arange` costs a launch as a matmul does. The step functions take such tensors from here instead. Each is
made on its first use outside any dispatch mode, so that a replay check or an audit sees it as the
persistent buffer it is to a graph (a key's first call, which runs before its capture, makes what the
capture reads). They are shared: a caller must never write into one, only read it or index with it. They
are kept for the process, so only shapes a static step takes (a few buckets and tree sizes) are made here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

_made: dict[tuple, Tensor] = {}


def constant(key: tuple, make: Callable[[], Tensor]) -> Tensor:
    """The tensor `make()` returns, made on the first call with `key` (which names everything it depends on,
    its device included)."""
    t = _made.get(key)
    if t is None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"index constant {key} first asked for during a graph capture: the step's first "
                               "call (before its capture) must have made it; a replay would refill it")
        # (not an inference tensor, so that code outside inference mode may read it too)
        with _disable_current_modes(), torch.inference_mode(False), torch.no_grad():
            made = make()
        t = _made.setdefault(key, made)  # (two threads making one: both use the first kept)
    return t


def arange(n: int, device: torch.device, start: int = 0, keep: bool = True) -> Tensor:
    """start, start + 1, ..., start + n - 1 (int64). `keep` false: made afresh, for a size an eager step takes
    from the data (any of thousands of context lengths: kept, they would add up to gigabytes)."""
    if not keep:
        return torch.arange(start, start + n, device=device)
    return constant(("arange", n, start, device), lambda: torch.arange(start, start + n, device=device))


def eye(n: int, device: torch.device) -> Tensor:
    """The [n, n] bool identity."""
    return constant(("eye", n, device), lambda: torch.eye(n, dtype=torch.bool, device=device))


def full(shape: tuple[int, ...], value: int | float | bool, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A tensor of `shape` holding `value` everywhere."""
    return constant(("full", shape, value, dtype, device), lambda: torch.full(shape, value, dtype=dtype, device=device))


