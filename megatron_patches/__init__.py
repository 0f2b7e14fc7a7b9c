"""What megatron-core 0.16.1 needs to train on a CPU build of torch over gloo.

megatron-core assumes CUDA in a few places that have nothing to do with the mathematics: it asks
`torch.cuda` for the current device, stream and RNG state, keeps per-TP-rank RNG states for CUDA
generators, and allocates a few bookkeeping tensors with `device="cuda"`. On a CPU build each of
those raises. The patches below give each one its CPU meaning and nothing more.

Rules:
- Applied by `fastgrpo.trainers.megatron` only, never at import, and only when CUDA is absent: on
  GPUs megatron-core runs unpatched, except for what its local spec's torch fallbacks need whatever
  the device (`LOCAL_SPEC_PATCHES` and `TE_NAMES_UNSET`: a MoE router's Transformer Engine names
  left undefined, the torch norms under sequence parallelism), where Transformer Engine is absent or
  the local spec is asked for; with Transformer Engine's spec neither is reached.
- Each patch names what it replaces, why, and the megatron-core version it was written for; it
  carries a fingerprint of the source it replaces (and of the source it reaches into, where a
  wrapper changes what a function it calls sees), and `apply()` refuses (with the list of what
  changed) to patch a megatron-core whose source no longer matches, instead of silently patching
  the wrong thing.

The distributed optimizer (`trainer.distributed_optimizer`) and bf16 (`Float16Module`, the bf16
optimizer with fp32 main parameters) need two more: both optimizers' constructors sort parameters
by `Tensor.type()` names that only CUDA tensors have. What else they need on CPU is not a patch:
tensors megatron allocates on "cuda" go to the CPU under `cpu_device_literals` (the trainer builds
the optimizer inside it), and the checkpoint format is the trainer's choice: `dp_reshardable` (the
default `fully_sharded_model_space` fails on any device in 0.16.1, "flattened_range is not
supported"), which never reaches the `.cuda()` of the state gather over data-parallel ranks
(`DistributedOptimizer.get_parameter_state_dp_zero`, the other formats'). The distributed
optimizer's Adam step count on load, wrong with torch's Adam on any device, is mended by the
trainer (`MegatronPolicyTrainer._restore_adam_steps`), not here.

Mixture-of-experts layers (`MoELayer` with the alltoall token dispatcher, `SequentialMLP` experts)
need five more, each found by running megatron-core 0.16.1's MoE on CPU/gloo: the dispatcher's CUDA
side stream, its split sizes handed to the all-to-all as tensors, gloo's lack of an uneven all-gather
(TP > 1) (`MOE_PATCHES`, CPU only), and two that are no device matter (`TE_NAMES_UNSET`,
`LOCAL_SPEC_PATCHES`, applied on GPUs too): the router's Transformer Engine names left undefined
without Transformer Engine, and the torch norms' refusal of sequence parallelism (which megatron
requires of MoE with TP > 1: without it every TP rank runs the same tokens through the experts and
their gradients come out TP times too large).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

MEGATRON_CORE_VERSION = "0.16.1"


class PatchMismatch(RuntimeError):
    """megatron-core is not the version these patches were written for."""


@dataclass(frozen=True)
class Patch:
    module: str  # where the replaced function lives
    name: str
    why: str
    fingerprint: str  # sha256 prefix of the replaced function's source in MEGATRON_CORE_VERSION
    make: Callable[[Any], Callable]  # original -> replacement
    # functions of the same module the replacement's effect reaches (it runs inside them), with the
    # fingerprints of their source: what the patch relies on them doing
    reaches: tuple[tuple[str, str], ...] = ()


def _fingerprint(fn: Callable) -> str:
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]


def _cpu_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _set_cpu_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _clip_grad_by_total_norm_cpu(parameters, max_norm: float, total_norm: float, use_decoupled_grad: bool = False) -> None:
    """Scale the gradients in place by max_norm / total_norm when that is below 1, as megatron's
    version does (same coefficient, same epsilon), without its CUDA-only multi-tensor kernel."""
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff >= 1.0:
        return
    for param in ([parameters] if isinstance(parameters, torch.Tensor) else parameters):
        grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
        if grad is not None:
            grad.detach().mul_(clip_coeff)


def _tensor_cuda_is_identity(original: Callable) -> Callable:
    """`Tensor.cuda()`: the tensor itself (it stays where it is)."""
    return lambda self, *args, **kwargs: self


# what megatron-core's optimizers expect `Tensor.type()` to say of a parameter they may hold
_CUDA_TYPE_NAMES = {torch.float32: "torch.cuda.FloatTensor", torch.float16: "torch.cuda.HalfTensor",
                    torch.bfloat16: "torch.cuda.BFloat16Tensor"}


def _tensor_type_names_cuda(original: Callable) -> Callable:
    """`Tensor.type()` (no argument: the name) of a CPU float tensor says the CUDA name of its dtype;
    `type(dtype)` (a conversion) is untouched."""
    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu" and self.dtype in _CUDA_TYPE_NAMES:
            return _CUDA_TYPE_NAMES[self.dtype]
        return original(self, dtype, non_blocking, **kwargs) if dtype is not None or kwargs else original(self)
    return type_


def _with_tensor_method(name: str, replacement: Callable[[Callable], Callable]) -> Callable[[Callable], Callable]:
    """A patch that runs the original function with `torch.Tensor.<name>` replaced by
    `replacement(original method)` for the duration of the call, and restored after."""
    def patch(original: Callable) -> Callable:
        @functools.wraps(original)
        def run(*args, **kwargs):
            method = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, replacement(method))
            try:
                return original(*args, **kwargs)
            finally:
                setattr(torch.Tensor, name, method)
        return run
    return patch


_without_tensor_cuda = _with_tensor_method("cuda", _tensor_cuda_is_identity)
_with_cuda_type_names = _with_tensor_method("type", _tensor_type_names_cuda)


PATCHES = (
    Patch("megatron.core.tensor_parallel.random", "_get_cuda_rng_state",
          "the TP RNG tracker saves and restores the CUDA generator around dropout and initialisation; on "
          "CPU the generator is the CPU one", "aa26caaa069c5c4f", lambda original: _cpu_rng_state),
    Patch("megatron.core.tensor_parallel.random", "_set_cuda_rng_state",
          "restores what _get_cuda_rng_state saved", "b179c9d95438b61c", lambda original: _set_cpu_rng_state),
    Patch("megatron.core.models.common.language_module.language_module",
          "LanguageModule.setup_embeddings_and_output_layer",
          "with tied embeddings and PP > 1 it moves the last stage's copy of the embedding to the GPU "
          "(`weight.data.cuda()`) before the all-reduce that makes it equal to the first stage's; on CPU "
          "the tensor stays where it is", "005bdd3315b0611b", _without_tensor_cuda),
    Patch("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.__init__",
          "the distributed optimizer sorts the parameters it shards into fp32 and bf16/fp16 ones by "
          "`param.type()` in ('torch.cuda.FloatTensor', 'torch.cuda.BFloat16Tensor', ...) and refuses any "
          "other name (a CPU tensor's is 'torch.FloatTensor'); while it is built, a CPU tensor's type name "
          "is its dtype's CUDA name", "3275f640fc1b7377", _with_cuda_type_names,
          reaches=(("DistributedOptimizer._build_model_and_main_param_groups", "1b9f0ec06718f817"),)),
    Patch("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__",
          "the bf16 optimizer (fp32 main copies of bf16 parameters) sorts its parameters by the same CUDA "
          "type names", "1d470dedcf8e2f0e", _with_cuda_type_names),
    Patch("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32",
          "gradient clipping asserts CUDA gradients and scales them with a CUDA multi-tensor kernel; on CPU "
          "the same coefficient scales them in place (the total norm, `get_grad_norm_fp32`, already works "
          "under `cpu_device_literals`)", "8edb9da5365045a5", lambda original: _clip_grad_by_total_norm_cpu),
)


class _Event:
    """A recorded point of a `_Stream`: on CPU it has always happened."""

    def synchronize(self) -> None: ...
    def wait(self, stream: Any = None) -> None: ...
    def query(self) -> bool:
        return True


class _Stream:
    """What megatron asks of a CUDA stream (`torch.cuda.current_stream()`, the MoE dispatcher's side
    stream): on CPU, work is synchronous. `torch.cuda.stream(s)` of one is a no-op on a CPU build
    (torch's StreamContext returns at once without a CUDA device)."""

    def synchronize(self) -> None: ...
    def wait_stream(self, other: Any) -> None: ...
    def record_event(self, event: Any = None) -> _Event:
        return _Event()


# -- mixture of experts -------------------------------------------------------------------------

@dataclass(frozen=True)
class UnsetNames:
    """Names a module imports from Transformer Engine in a `try` and never defines when the import
    fails; the functions in `reaches` test them `is None` to take their torch path."""
    module: str
    names: tuple[str, ...]
    why: str
    reaches: tuple[tuple[str, str], ...]  # (function of the module, fingerprint of its source)


TE_NAMES_UNSET = UnsetNames(
    "megatron.core.transformer.moe.moe_utils",
    ("fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute", "fused_permute_with_probs",
     "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs", "fused_topk_with_score_function",
     "fused_unpermute", "te_general_gemm"),
    "moe_utils imports nine Transformer Engine functions in a try block and leaves them undefined when "
    "the import fails (HAVE_TE False); the router's gating matmul reads `te_general_gemm` and takes its "
    "torch.mm path when it is None, but an undefined name raises NameError on every MoE forward. Set "
    "to None (the other eight are read only behind `not HAVE_TE or name is None` checks, under fusion "
    "options the trainer leaves off)",
    (("RouterGatingLinearFunction.forward", "dcba4f9f02b30a36"),
     ("RouterGatingLinearFunction.backward", "222f6d592730bd28")))


def _dispatcher_with_cpu_side_stream(original: Callable) -> Callable:
    """`MoEAlltoAllTokenDispatcher.__init__` with its class-wide side stream (for the device-to-host
    copies of the split sizes) already set to a `_Stream`: its own `torch.cuda.Stream()` raises on a
    CPU build."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        if MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None:
            MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _Stream()
        original(self, *args, **kwargs)
    return __init__


def _split_sizes_as_numpy(original: Callable) -> Callable:
    """`maybe_move_tensor_to_cpu` as the dispatcher calls it: `as_numpy=True` gives a numpy array for a
    CPU tensor too (megatron converts only CUDA tensors, and gloo's all_to_all_single refuses split
    sizes given as a tensor)."""
    @functools.wraps(original)
    def move(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)
    return move


def _gather_uneven_on_gloo(original: Callable) -> Callable:
    """`_gather_along_first_dim` with `output_split_sizes` (uneven pieces; the MoE dispatcher's gather
    of the tokens routed to this rank's experts over TP) on a gloo group: gloo's all_gather wants every
    piece the same size, so each rank's piece is padded with zeros to the largest, gathered, and cut
    back. The same result as the uneven gather NCCL does; every other call unchanged."""
    @functools.wraps(original)
    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1 or dist.get_backend(group) != "gloo":
            return original(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(s) for s in output_split_sizes]
        padded = input_.new_zeros(max(sizes), *input_.shape[1:])
        padded[: input_.shape[0]] = input_
        pieces = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(pieces, padded, group=group)
        return torch.cat([piece[:size] for piece, size in zip(pieces, sizes)])
    return gather


def _norm_under_sequence_parallel(original: Callable) -> Callable:
    """`WrappedTorchNorm.__new__` (the local spec's norms) under sequence parallelism: it asserts SP is
    off, though a norm is per token and computes the same on a sequence shard. Built with SP masked
    (a shallow copy of the config), its weights then tagged `sequence_parallel` as megatron's own SP
    norms are, so that `finalize_model_grads` sums their gradients over the TP ranks (each saw only
    its shard of the sequence)."""
    def __new__(cls, config, *args, **kwargs):
        if not config.sequence_parallel:
            return original(cls, config, *args, **kwargs)
        masked = copy.copy(config)
        masked.sequence_parallel = False
        norm = original(cls, masked, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm
    return staticmethod(__new__)


MOE_PATCHES = (
    Patch("megatron.core.transformer.moe.token_dispatcher", "MoEAlltoAllTokenDispatcher.__init__",
          "the alltoall dispatcher makes a torch.cuda.Stream for its device-to-host copies of the split "
          "sizes; on CPU a synchronous stand-in (its event has always happened)", "dfafd17183db3f0c",
          _dispatcher_with_cpu_side_stream,
          reaches=(("MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize", "306811df71072b74"),)),
    Patch("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu",
          "the split sizes of the dispatcher's all-to-all become numpy arrays only when they were on "
          "CUDA; on CPU they stay tensors, which gloo's all_to_all_single refuses (EP > 1)",
          "8fc5847a887d7319", _split_sizes_as_numpy,
          reaches=(("MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize", "306811df71072b74"),)),
    Patch("megatron.core.tensor_parallel.mappings", "_gather_along_first_dim",
          "the dispatcher gathers the tokens for this rank's experts over TP in uneven pieces; gloo has "
          "no uneven all_gather (TP > 1)", "44633fe36d60a51f", _gather_uneven_on_gloo),
)

# what the local spec (torch norms, no Transformer Engine) needs for MoE on any device
LOCAL_SPEC_PATCHES = (
    Patch("megatron.core.transformer.torch_norm", "WrappedTorchNorm.__new__",
          "MoE with TP > 1 needs sequence parallelism, which the local spec's torch norms refuse by "
          "assertion", "6cb54a06fa41bf78", _norm_under_sequence_parallel),
)


# torch.cuda functions megatron-core calls outside the mathematics; on a CPU build each raises
TORCH_CUDA = {
    "current_device": lambda: torch.device("cpu"),  # used as `device=` for buffers and P2P shapes
    "synchronize": lambda device=None: None,
    "current_stream": lambda device=None: _Stream(),
    "get_rng_state": lambda device="cuda": torch.get_rng_state(),
    "set_rng_state": lambda new_state, device="cuda": torch.set_rng_state(new_state),
    "manual_seed": lambda seed: None,  # the CPU generator is seeded by the caller (torch.manual_seed)
}


class _CudaLiteralsToCpu(TorchFunctionMode):
    """`pipeline_parallel/schedules.py` allocates its token counter with the literal device="cuda"
    (three places in 0.16.1): send those tensor factories to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda"):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


_applied: dict[tuple[str, str], Callable] = {}
_torch_cuda_originals: dict[str, Callable] = {}


def _owner(p: Patch | UnsetNames, name: str | None = None) -> tuple[Any, str]:
    """The object holding the patched attribute (the module, or a class in it) and the attribute's
    name; of `name` (a function the patch reaches) instead of the patched one if given."""
    owner: Any = importlib.import_module(p.module)
    *path, attr = (name or p.name).split(".")
    for part in path:
        owner = getattr(owner, part, None)
    return owner, attr


def needed() -> bool:
    return not torch.cuda.is_available()


def mismatches() -> list[str]:
    """What in the installed megatron-core differs from what the patches were written for."""
    import megatron.core

    problems = []
    version = getattr(megatron.core, "__version__", "unknown")
    if version != MEGATRON_CORE_VERSION:
        problems.append(f"megatron-core {version} is installed; the patches are for {MEGATRON_CORE_VERSION}")
    for p in PATCHES + MOE_PATCHES + LOCAL_SPEC_PATCHES:
        owner, attr = _owner(p)
        target = _applied.get((p.module, p.name), getattr(owner, attr, None) if owner is not None else None)
        if target is None:
            problems.append(f"{p.module}.{p.name} no longer exists")
        elif _fingerprint(target) != p.fingerprint:
            problems.append(f"{p.module}.{p.name} changed (source fingerprint {_fingerprint(target)}, "
                            f"the patch was written for {p.fingerprint})")
        problems += _reached_problems(p, f"which the patch of {p.name} relies on",
                                      f"the patch of {p.name} was written for")
    u = TE_NAMES_UNSET
    module = importlib.import_module(u.module)
    problems += _reached_problems(u, "which reads the unset Transformer Engine names",
                                  "the unset Transformer Engine names were patched for")
    if not hasattr(module, "HAVE_TE"):
        problems.append(f"{u.module}.HAVE_TE no longer exists")
    return problems


def _reached_problems(p: Patch | UnsetNames, relies: str, written_for: str) -> list[str]:
    """The functions `p` relies on (`p.reaches`) that are gone or whose source changed."""
    problems = []
    for name, fingerprint in p.reaches:
        owner, attr = _owner(p, name)
        reached = getattr(owner, attr, None) if owner is not None else None
        if reached is None:
            problems.append(f"{p.module}.{name} ({relies}) no longer exists")
        elif _fingerprint(reached) != fingerprint:
            problems.append(f"{p.module}.{name} changed (source fingerprint {_fingerprint(reached)}, "
                            f"{written_for} {fingerprint})")
    return problems


def apply() -> list[str]:
    """Patch megatron-core for CPU/gloo; with CUDA only for the local spec's torch fallbacks
    (`LOCAL_SPEC_PATCHES`, `TE_NAMES_UNSET`). A no-op for what is already applied; returns what was
    patched. Raises PatchMismatch on a megatron-core the patches were not written for."""
    problems = mismatches()
    if problems:
        raise PatchMismatch("megatron_patches cannot be applied: " + "; ".join(problems))
    done = []
    for p in (PATCHES + MOE_PATCHES + LOCAL_SPEC_PATCHES if needed() else LOCAL_SPEC_PATCHES):
        if (p.module, p.name) in _applied:
            continue
        owner, attr = _owner(p)
        original = getattr(owner, attr)
        _applied[(p.module, p.name)] = original
        setattr(owner, attr, p.make(original))
        done.append(f"{p.module}.{p.name}")
    module = importlib.import_module(TE_NAMES_UNSET.module)
    if not module.HAVE_TE:
        for name in TE_NAMES_UNSET.names:
            if not hasattr(module, name):
                setattr(module, name, None)
                done.append(f"{TE_NAMES_UNSET.module}.{name} = None")
    if not needed():
        return done
    for name, replacement in TORCH_CUDA.items():
        if name not in _torch_cuda_originals:
            _torch_cuda_originals[name] = getattr(torch.cuda, name)
            setattr(torch.cuda, name, replacement)
            done.append(f"torch.cuda.{name}")
    return done


@contextlib.contextmanager
def cpu_device_literals() -> Iterator[None]:
    """Around megatron's pipeline schedules on CPU: tensors it asks for on "cuda" are made on the CPU."""
    if not needed():
        yield
        return
    with _CudaLiteralsToCpu():
        yield

