"""CUDA graphs of the static steps (`steps.py`), and the audit that keeps a step function capturable.

A graph records a step's kernels once and replays them with one launch: the step's ~1,000 kernel launches
and their Python dispatch, which bound an eager step on a GPU, are paid once per shape. Capture is manual
(as gpt-fast and SGLang do): `torch.compile(mode="reduce-overhead")` would split the step at every host
sync, and a step with none needs no compiler to be captured.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten

# where nothing is captured (a CPU), hold every static step to a replay of its key's first call
# (ReplayCheck); the GPU check's CPU run sets it (--check-replays), so that what a CPU can find is not
# left for a GPU's scarce minutes
CHECK_REPLAYS = False


class StepGraphs:
    """Each step key (its function, batch and context buckets, tree and sampling) captured once as a CUDA
    graph on its first use and replayed after; all graphs share one memory pool. Elsewhere (a CPU, or
    `enabled` false) the step function simply runs.

    A graph replays on the buffers it was captured with: the step must read and write only persistent
    tensors (the caches, `StepState`, the weights, which pushes copy into in place) and return tensors the
    graph made. What it returns is the same tensors at every replay, overwritten by the next."""

    def __init__(self, device: torch.device, enabled: bool = True):
        self.enabled = enabled and device.type == "cuda"
        # when set, every step runs eagerly inside this audit (a check that it could be captured)
        self.audit: StepAudit | None = None
        # when set (where nothing is captured), every step runs eagerly and is held to what a replay of
        # its key's first call would do
        self.replay_check: ReplayCheck | None = ReplayCheck() if CHECK_REPLAYS and not self.enabled else None
        self.pool = torch.cuda.graph_pool_handle() if self.enabled else None
        self._graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self.captures = 0
        self.replays = 0
        # seconds of the steps that captured (the eager run and the recording, synchronised): a one-time
        # cost per key that a benchmark of steady decoding sets apart (SGLang and vLLM capture at start-up)
        self.capture_s = 0.0

    def run(self, key: Hashable, step: Callable[[], Any]) -> Any:
        if self.audit is not None:
            with self.audit:
                return step()
        if self.replay_check is not None:
            return self.replay_check.run(key, step)
        if not self.enabled:
            return step()
        if key in self._graphs:
            graph, out = self._graphs[key]
            graph.replay()
            self.replays += 1
            return out
        # the first call runs eagerly on a side stream (the warm-up capture needs: workspaces, cuBLAS
        # handles, allocations), and is this step; the capture after it records without running
        torch.cuda.current_stream().synchronize()  # (a capture is rare: its syncs time it, and cost nothing)
        t = time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            first = step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step()
        self._graphs[key] = (graph, out)
        self.captures += 1
        torch.cuda.current_stream().synchronize()
        self.capture_s += time.perf_counter() - t
        return first

    def clear(self) -> None:
        """Forget every graph (their buffers or kernels changed: a new draft head, fused kernels)."""
        self._graphs.clear()
        if self.replay_check is not None:
            self.replay_check.forget()


class HostSync(RuntimeError):
    """A step function read a value back from the device or built a tensor from host data."""


# ops whose result the host must wait for (a value read back, or a size that depends on the data)
_SYNCING = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
            aten.bincount.default, aten.repeat_interleave.Tensor, aten._unique2.default, aten.unique_dim.default,
            aten.unique_consecutive.default, aten.is_nonzero.default, aten.item.default}
# a tensor made from Python data (`torch.tensor(...)`): a host-to-device copy on a GPU
_FROM_HOST = {aten.lift_fresh.default, aten.lift_fresh_copy.default}
_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


class StepAudit(TorchDispatchMode):
    """Runs code under a check that it could be captured as a graph: any host sync or host-to-device
    copy raises HostSync naming the op (`strict`, the default) or is recorded in `violations`. Also counts
    the ops run (`ops`, per op name), for op budgets.

    It sees aten ops and the Python reads that bypass them (`Tensor.tolist`, `Tensor.numpy`). On a CPU a
    copy between devices cannot happen; building a tensor from Python data (`lift_fresh`) is what would
    be one on a GPU. A copy from a CPU tensor to another device (`_to_copy`, `copy_`) is caught where
    there is another device."""

    def __init__(self, strict: bool = True):
        super().__init__()
        self.strict = strict
        self.ops: Counter[str] = Counter()
        self.violations: list[str] = []
        self._patched: dict[str, Any] = {}

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def _flag(self, what: str) -> None:
        self.violations.append(what)
        if self.strict:
            raise HostSync(f"a step function must not {what}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops[str(func.overloadpacket.__name__)] += 1
        if func in _SYNCING:
            self._flag(f"sync with the host ({func})")
        elif func in _FROM_HOST:
            self._flag(f"copy host data to the device ({func})")
        elif func in _INDEXING and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                       for i in (args[1] if len(args) > 1 else ()) if i is not None):
            self._flag(f"index with a boolean mask (a data-dependent size: {func})")
        elif func in (aten._to_copy.default, aten.copy_.default):
            src = args[1] if func is aten.copy_.default else args[0]
            dst_device = args[0].device if func is aten.copy_.default else kwargs.get("device")
            if isinstance(src, torch.Tensor) and dst_device is not None and src.device != torch.device(dst_device):
                self._flag(f"copy between devices ({src.device} -> {dst_device})")
        return func(*args, **kwargs)

    def __enter__(self):
        audit = self
        for name in ("tolist", "numpy"):
            original = getattr(torch.Tensor, name)
            self._patched[name] = original

            def read_back(t, *a, _original=original, _name=name, **k):
                audit._flag(f"read a tensor back with .{_name}()")
                return _original(t, *a, **k)

            setattr(torch.Tensor, name, read_back)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._patched.items():
            setattr(torch.Tensor, name, original)
        self._patched.clear()
        return super().__exit__(*exc)


# aten ops that launch no kernel: views and aliases, allocations, and `to` (a no-op cast in fp32 steps; in
# bf16 its copy is a child event, not counted at the top)
KERNEL_FREE = {"aten::" + name for name in (
    "slice", "select", "unsqueeze", "squeeze", "transpose", "t", "permute", "view", "_unsafe_view", "reshape",
    "_reshape_alias", "expand", "as_strided", "chunk", "split", "unbind", "narrow", "alias", "detach", "detach_",
    "numpy_T", "flatten", "resolve_conj", "resolve_neg", "lift_fresh", "broadcast_tensors", "empty",
    "empty_strided", "to")}


def launched_ops(events: Any) -> int:
    """How many of a CPU profile's top-level events launch kernels (`torch.profiler.profile(...).events()`):
    aten and oneDNN ops that are not KERNEL_FREE, and compiled regions (one call each; how many kernels a
    region is on a GPU, a GPU profile's device events count). On a CPU what a step's graph would replay."""
    def launches(name: str) -> bool:
        if name.startswith("Torch-Compiled Region"):
            return True
        return name.startswith(("aten::", "mkldnn::")) and name not in KERNEL_FREE

    return sum(launches(e.name) for e in events if e.cpu_parent is None)


class StaleReplay(RuntimeError):
    """A step called again under a key would not compute what a replay of the key's graph computes."""


class ReplayCheck(TorchDispatchMode):
    """A CUDA graph's contract, checked where no graph is captured (a CPU: the tests, the GPU check's CPU run).

    A graph replays the ops its capture recorded, with the shapes, strides and scalars of that call, on the
    storages that call read. A step whose later calls under the same key would do anything else (read a
    buffer that was rebound since, take a branch on Python state the key does not name, use a shape or a
    scalar the key does not fix) computes, when replayed, something other than its eager self, silently.
    So each key's first call is recorded (every op, with each tensor argument as the storage it reads, or
    the earlier op of the call that made it) and every later call must record the same, else StaleReplay
    names the first difference. A later call's outputs are copied into the first call's tensors, which it
    returns, as a replay overwrites its graph's outputs: a caller that kept an earlier step's outputs sees
    them change, as it would on a GPU. A CPU's packed weight copies (oneDNN, which a GPU engine never
    makes) are opaque and recorded by shape alone."""

    def __init__(self):
        super().__init__()
        self._first: dict[Hashable, tuple[list[tuple], Any]] = {}
        self._trace: list[tuple] = []
        self._maker: dict[int, int] = {}  # storage address -> the op of this call that last made it
        self._read: set[int] = set()  # the storages this call read that it did not make
        # what this call made, held until it ends: a storage freed mid-call would free its address for a
        # tensor made outside the check's view (a kept constant), which would then pass as this op's
        self._made: list[torch.Tensor] = []
        self.checked = 0  # calls held to their key's first
        self.keys = 0  # calls that were their key's first: the graphs a GPU would have captured

    def forget(self) -> None:
        """The graphs were dropped: each key's next call is its first again."""
        self._first.clear()

    def run(self, key: Hashable, step: Callable[[], Any]) -> Any:
        self._trace, self._maker, self._read, self._made = [], {}, set(), []
        try:
            with self:
                out = step()
        finally:
            self._made = []
        trace = self._trace
        if key not in self._first:
            self._first[key] = (trace, out)
            self.keys += 1
            return out
        first, kept = self._first[key]
        if trace != first:
            raise StaleReplay(f"step {key}: {_first_difference(first, trace)}")
        with torch.inference_mode():
            _overwrite(kept, out)
        self.checked += 1
        return kept

    def _arg(self, x: Any) -> Any:
        """An op's argument as a replay would see it."""
        if not isinstance(x, torch.Tensor):
            return x
        address = _address(x)
        if address is None:
            return ("opaque", tuple(x.shape), x.dtype)
        layout = (tuple(x.shape), x.stride(), x.storage_offset(), x.dtype, x.device)
        if address in self._maker:
            return ("made by op", self._maker[address], *layout)
        self._read.add(address)
        return ("reads storage", address, *layout)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._trace.append((str(func), tuple(self._arg(x) for x in tree_flatten((args, kwargs))[0])))
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            # a new storage (or a view or in-place write of one this call made), not a persistent one
            if isinstance(t, torch.Tensor) and (address := _address(t)) is not None and address not in self._read:
                self._maker[address] = len(self._trace) - 1
                self._made.append(t)
        return out


def _address(t: torch.Tensor) -> int | None:
    """Where a tensor's storage lives; None for an opaque tensor (a CPU's packed weights)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _first_difference(first: list[tuple], now: list[tuple]) -> str:
    for i, (a, b) in enumerate(zip(first, now)):
        if a != b:
            return f"op {i} differs from the first call's (the captured one): {b} instead of {a}"
    return f"{len(now)} ops where the first call (the captured one) ran {len(first)}"


def _overwrite(kept: Any, new: Any) -> None:
    """Copy a step's outputs into the tensors of its key's first call (the same structure and shapes)."""
    if isinstance(kept, torch.Tensor):
        kept.copy_(new)
    elif dataclasses.is_dataclass(kept):
        for f in dataclasses.fields(kept):
            _overwrite(getattr(kept, f.name), getattr(new, f.name))
    elif isinstance(kept, (tuple, list)):
        for a, b in zip(kept, new, strict=True):
            _overwrite(a, b)
