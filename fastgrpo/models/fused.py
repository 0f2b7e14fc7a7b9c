"""A static step's pointwise regions as fused kernels, compiled by torch.compile (Inductor: Triton on a GPU,
C++ on a CPU), for the steps a GPU captures as CUDA graphs.

Why: a captured step runs its kernels back to back with no host in between, so what remains beside the
weights' bandwidth is each kernel's fixed cost. At a small batch most of a layer's kernels are pointwise
ops on a few rows each (RMSNorm alone is six to eight: a square, a mean, an add, a root, two products,
and in bf16 a cast each way). A plain step launches 28 a layer op by op (fp32, counted by the profiler in
tests/test_fused_steps.py), 12 fused: one per region (`layers.Pointwise`: the norm, the residual add with
the next norm, q/k's norms with the rotation, SwiGLU's gate) besides the matmuls, attention and cache
writes. The draft's layer runs the same regions in a speculative step, and the sampling noise, an integer
hash of (seed, request, position) of ~60 ops, is one region too (integer arithmetic and exact float64
steps: the same bits compiled or not).

gpt-fast compiles its whole decode step; SGLang compiles its model and captures the graphs itself
(CudaGraphRunner), as `graphs.StepGraphs` does. Only the regions are compiled here: a whole step would
compile once per captured shape (batch bucket x context bucket x tree), a region once for all of them
(dynamo's automatic dynamic shapes mark a size dynamic the first time it changes).

The same function as `layers.EAGER`: Inductor is told to round where the eager code casts
(`emulate_precision_casts`), so bf16 regions round as the eager ones do where its backend keeps those
casts (torch 2.13's C++ backend does, tested; torch 2.11's elides some, one rounding apart; Triton's is
for a GPU to show). A fused reduction may add in another order (RMSNorm's mean of squares): results
within rounding of the eager ones, so tokens match but where two are within rounding of a tie.

Under a TorchDispatchMode (`graphs.StepAudit`, `graphs.ReplayCheck`) dynamo does not trace, so a region
runs its eager function there: the same ops the compiled kernel fuses, which is what those checks read.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from fastgrpo.models.layers import EAGER, Pointwise

# Inductor options of every region: round at each cast the eager code makes (a bf16 region then rounds as
# the eager one does, which Inductor's default, keeping fused intermediates in fp32, would not)
OPTIONS = {"emulate_precision_casts": True}
# compiled variants a region may keep (dynamo's recompile limit, 8 by default, counts them per function):
# sizes 1 and >1 of the batch and of the tokens a row are compiled apart, and so are dtypes and a family
# with or without q/k norms, so one process (several engines, the tests) can need more than 8. Raised,
# never lowered, for the whole process, as SGLang's graph runner does
RECOMPILE_LIMIT = 64


def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    compiled = torch.compile(fn, fullgraph=True, options=OPTIONS)

    @functools.wraps(fn)
    def region(*args: Any) -> Any:
        if _get_current_dispatch_mode() is not None:  # dynamo does not trace under one: the eager ops
            return fn(*args)
        return compiled(*args)

    return region


@functools.cache
def fused_pointwise() -> Pointwise:
    """The regions compiled (once per process: every engine shares the compiled kernels and their
    shape guards)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return Pointwise(**{f.name: _compiled(getattr(EAGER, f.name)) for f in dataclasses.fields(Pointwise)})
