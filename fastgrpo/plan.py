"""`fastgrpo plan`: a run's layout checked before anyone spends GPU hours.

Three questions, answered from the config and the model's Hugging Face `config.json` alone (no
weights, no GPU): does the layout divide (heads, key/value groups and MLP width by TP, layers by PP,
the GPUs into TP x PP x DP replicas plus the draft slice, and into engines of `engine.tensor` GPUs
within a node); which GPU holds which rank, engine and
draft rank; and does each GPU's memory hold what that rank keeps there, in both phases of a
colocated step (rollout: the trainer's state stays while the engine holds its share; training:
the engine has released its memory and the micro-batch's activations need room).

Every memory figure is an estimate from the formula printed beside it, for the trainer as
fastgrpo builds it (`trainers/megatron`, megatron-core's own mixed precision): in fp32, 4 B of
weights, 4 B of gradient buffer and 8 B of Adam moments per parameter (the optimizer steps the
weights themselves); in bf16 (`trainer.precision`), 2 B of bf16 weights, 4 B of fp32 gradient
buffer (`grad_reduce_in_fp32`) and 12 B of fp32 main weights and Adam moments. The optimizer's part
(8 B or 12 B) is replicated over the data-parallel ranks, or divided by their number with
`trainer.distributed_optimizer` (megatron's DistributedOptimizer); the weights and the gradient
buffer are not (the gradients are reduce-scattered inside the full buffer). Activations are held in
the training dtype, the last stage's logits in fp32: a micro-batch's whole logits, or with
`trainer.logits_chunk_tokens` (when the micro-batch has more tokens) one chunk's and the output
weight's fp32 gradient summed over the chunks (`trainers/chunked_logprobs.py`), times the copies of
the logits the scoring holds at once (`LOGIT_COPIES`). The torch trainer keeps what megatron does
without a distributed optimizer; DeepSpeed's ZeRO is priced by the ZeRO paper's accounting
(`_deepspeed_state`). Nothing here is measured but `LOGIT_COPIES`.

`trainer.optimizer_offload` (megatron-core's optimizer CPU offload) moves the optimizer's part off the
GPU into host memory, which the Megatron trainer's plan prices per node (`_host_terms`): what each
trainer rank keeps there, times the trainer ranks of a node.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

from fastgrpo.config import Config, ConfigError, expert_tensor_size, layout_rules
from fastgrpo.models.families import UnsupportedModel, check_family
from fastgrpo.paths import HF_CONFIG
from fastgrpo.trainers.megatron.layout import VOCAB_DIVISIBLE_BY, Layout, LayoutError, padded_vocab
from fastgrpo.topology import EngineMap, Shape, WorldSize

GIB = 2**30
FP32, BF16 = 4, 2
# a fixed allowance per device for the runtime: on GPUs the CUDA context, communication buffers and the
# allocator's fragmentation; in a CPU process (the embedded engine) the interpreter and torch
RESERVE_GIB = {"sglang": 3.0, "embedded": 0.5}
# fp32 copies of the logits the last stage holds at once while scoring them, forward and backward (the
# logits, their scaled copy, log-softmax, its exp and the entropy's product, and the gradients back through
# them), measured on CPU with torch's profiler (peak bytes allocated: `python tools/logits_memory.py`, fp32
# and bf16; tests/test_chunked_logits.py holds the scoring to them): 5.0 (Megatron's vocab-parallel scoring)
# to 5.25 (torch's) x a micro-batch's whole logits, 5.8 to 6.3 x one chunk's beside the output weight's fp32
# gradient sum (the backward recomputes the chunk's logits beside their gradient); with top-k or top-p (a
# sort with its int64 indices, its softmax and masks) 9.25 to 9.35 x the whole, 9.3 x a chunk's. By what is
# held: the whole logits, or one chunk's
LOGIT_COPIES = {"whole": 5.25, "chunk": 6.5}
LOGIT_COPIES_CUT = {"whole": 9.5, "chunk": 9.5}


@dataclass
class Term:
    name: str
    gib: float
    formula: str


@dataclass
class Phase:
    """What one GPU holds at once in one phase of a step."""

    device: str
    phase: str
    terms: list[Term]
    capacity_gib: float

    @property
    def total_gib(self) -> float:
        return sum(t.gib for t in self.terms)

    @property
    def fits(self) -> bool:
        return self.total_gib <= self.capacity_gib


@dataclass
class Plan:
    checks: list[tuple[bool, str]] = field(default_factory=list)
    rank_map: list[str] = field(default_factory=list)
    phases: list[Phase] = field(default_factory=list)
    host: list[Term] = field(default_factory=list)  # host memory per node (the Megatron trainer's, `_host_terms`)
    notes: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return all(ok for ok, _ in self.checks) and all(p.fits for p in self.phases)


def model_config(cfg: Config) -> tuple[PretrainedConfig, str]:
    """The policy's shape and where it came from: `model.architecture` (a config.json), else
    `model.path`'s config.json, else (a policy `fastgrpo sft` has not built yet) the `model.size`
    recipe's. Only the families fastgrpo computes (`models.families.check_family`: no remote code)."""
    file = Path(cfg.model.architecture) if cfg.model.architecture else Path(cfg.model.path) / HF_CONFIG
    if not file.is_file():
        if cfg.model.architecture:
            raise ConfigError(f"model.architecture: no Hugging Face config at {file}")
        from fastgrpo.models.policy import policy_config
        from fastgrpo.models.tokenizer import MAX_VOCAB

        return (policy_config(cfg.model.size, MAX_VOCAB, cfg.model.max_context, 0, 1, 2),
                f"the model.size={cfg.model.size} recipe (no policy at {cfg.model.path} yet; vocabulary at most "
                f"{MAX_VOCAB})")
    raw = json.loads(file.read_text())
    try:
        check_family(raw, file)
    except UnsupportedModel as e:
        raise ConfigError(str(e)) from e
    return AutoConfig.for_model(**raw), str(file)


def expert_params(s: Shape) -> int:
    """One layer's experts (SwiGLU: gate, up and down, each h x expert_ffn): what expert parallelism
    divides; 0 for a dense model."""
    return s.experts * 3 * s.hidden * s.expert_ffn


def layer_params(s: Shape, draft: bool = False, active: bool = False) -> int:
    """One decoder layer: q, k, v, o, the MLP, two RMSNorms, and the family's biases and q/k norms. The
    MLP is a SwiGLU of width ffn, or a mixture of experts: a router (experts x h) and the experts, of
    which a token runs top_k (`active`: the parameters one token computes with). `draft`: the draft
    head's plain Llama layer at the same sizes (a dense MLP of width ffn), without biases or norms."""
    h, q, kv = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    if s.moe and not draft:
        mlp = s.experts * h + (s.top_k * 3 * h * s.expert_ffn if active else expert_params(s))
    else:
        mlp = 3 * h * s.ffn
    n = h * (q + 2 * kv) + q * h + mlp + 2 * h
    if not draft:
        n += (q + 2 * kv if s.qkv_bias else 0) + (h if s.o_bias else 0) + (2 * s.head_dim if s.qk_norm else 0)
    return n


def parameters(s: Shape, active: bool = False) -> int:
    """All the policy's parameters (`active`: those one token computes with, a MoE's top_k experts)."""
    return s.layers * layer_params(s, active=active) + s.vocab * s.hidden * (1 if s.tied else 2) + s.hidden


def draft_parameters(s: Shape) -> int:
    """The draft head (`models/draft.py`): fc [h, 2h], one plain Llama decoder layer (no
    biases, no q/k norms) at the policy's sizes, a norm; the embedding and LM head are the policy's."""
    return 2 * s.hidden * s.hidden + layer_params(s, draft=True) + s.hidden


def kv_bytes_per_token(s: Shape, dtype_bytes: int) -> int:
    return 2 * s.layers * s.kv_heads * s.head_dim * dtype_bytes


def _check_layout(plan: Plan, cfg: Config, config: PretrainedConfig, s: Shape, world: int, gpus_per_node: int) -> int:
    """Every layout rule of the run (`layout_rules`, the ones `load_config` and a launched rank judge too),
    the Megatron layout's own and the vocabulary's padding; returns the data-parallel size (0 when the
    world does not divide)."""
    t, p, d_ranks = cfg.parallel.tensor, cfg.parallel.pipeline, cfg.parallel.draft_ranks
    plan.checks += [(r.ok, r.text) for r in layout_rules(cfg, WorldSize(world, gpus_per_node), s)]
    padded = padded_vocab(s.vocab, t)
    plan.checks.append((True, f"vocabulary {s.vocab} padded to {padded} (a multiple of {VOCAB_DIVISIBLE_BY} x tensor {t})"))
    if cfg.trainer.backend == "megatron":
        try:  # the trainer's own rule, in case it asks more than the rules above
            Layout.of(config, t, p, cfg.parallel.expert, expert_tensor=cfg.parallel.expert_tensor)
            ep = f" x expert {cfg.parallel.expert}" if cfg.parallel.expert > 1 else ""
            if s.moe and expert_tensor_size(cfg.parallel) != t:
                ep += f" x expert tensor {expert_tensor_size(cfg.parallel)}"
            plan.checks.append((True, f"the Megatron layout accepts tensor {t} x pipeline {p}{ep}"))
        except LayoutError as e:
            plan.checks.append((False, f"the Megatron layout refuses it: {e}"))
    policy = world - d_ranks
    if policy < t * p or policy % (t * p):
        return 0
    dp = policy // (t * p)
    engines = EngineMap(policy, cfg.engine.tensor).engines if policy % cfg.engine.tensor == 0 else 0
    r = cfg.rollout
    if 0 < engines and r.prompts_per_step < engines:
        plan.notes.append(f"{engines - r.prompts_per_step} of the {engines} engines get no prompt in a step "
                          f"({r.prompts_per_step} prompts per step): a larger engine.tensor or more prompts use them")
    return dp if engines else 0


def coordinates(rank: int, tensor: int, data: int) -> tuple[int, int, int]:
    """(tensor rank, pipeline stage, data replica) of a policy rank in megatron's default order
    ("tp-cp-ep-dp-pp": tensor fastest, then data, then pipeline)."""
    return rank % tensor, rank // (tensor * data), (rank // tensor) % data


def _rank_map(plan: Plan, cfg: Config, nodes: int, per_node: int, dp: int) -> None:
    """Megatron's default order (tensor fastest, then data, then pipeline); the draft slice last;
    engines of `engine.tensor` consecutive policy ranks tile them, each led by its first rank."""
    t, p = cfg.parallel.tensor, cfg.parallel.pipeline
    policy = t * p * dp
    engines = EngineMap(policy, cfg.engine.tensor)
    for node in range(nodes):
        cells = []
        for gpu in range(per_node):
            rank = node * per_node + gpu
            if rank >= policy:
                cells.append(f"draft{rank - policy}")
                continue
            tp, stage, replica = coordinates(rank, t, dp)
            cells.append(f"t{tp}p{stage}d{replica}{'*' if engines.leads(rank) else ''}")
        plan.rank_map.append(f"node {node:>3}: " + " ".join(f"{c:<10}" for c in cells).rstrip())
    r = cfg.rollout
    for e in range(engines.engines):
        ranks = list(engines.ranks(e))
        first, last = engines.bounds(r.prompts_per_step, e)
        plan.rank_map.append(f"engine {e}: ranks {_ranges(ranks)} on node {ranks[0] // per_node}, led by rank "
                             f"{ranks[0]}; {last - first} prompt(s) x {r.group_size} per step")


def _ranges(xs: list[int]) -> str:
    runs, start = [], xs[0]
    for a, b in zip(xs, xs[1:] + [None]):
        if b != a + 1:
            runs.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ",".join(runs)


def _gib(n_bytes: float) -> float:
    return n_bytes / GIB


def planned_precision(cfg: Config) -> str:
    """`trainer.precision` as the planned machines resolve it (`fastgrpo.device.resolve`, which the plan
    does not call: it plans GPU clusters from a login node): auto is bf16 on CUDA (device=cuda, or auto
    with SGLang engines, which run on GPUs only, or with `trainer.optimizer_offload`, which needs CUDA) and
    fp32 on a CPU (the embedded engine's worlds)."""
    if cfg.trainer.precision != "auto":
        return cfg.trainer.precision
    # (trainer.optimizer_offload runs on CUDA only: config validation refuses device=cpu with it)
    cuda = (cfg.device == "cuda" or (cfg.device == "auto" and cfg.engine.backend == "sglang")
            or cfg.trainer.optimizer_offload)
    return "bf16" if cuda else "fp32"


def optimizer_share(cfg: Config, P: float, dp: int, expert_P: float = 0.0) -> tuple[float, str]:
    """The parameters whose optimizer state one Megatron rank keeps, of `P` parameters of its shard
    (`expert_P` of them its experts), and how they are divided: all of them (replicated over the data
    ranks), or with the distributed optimizer the rest / data and the experts / expert-data (the ranks
    holding the same experts: megatron-core's expert grid splits a stage's tensor x data ranks into
    expert tensor x expert x expert-data, so tensor x data / (expert tensor x expert); at
    `parallel.expert_tensor` = TP that is data / parallel.expert)."""
    if not cfg.trainer.distributed_optimizer:
        return P, "replicated over data ranks"
    t, etp = cfg.parallel.tensor, expert_tensor_size(cfg.parallel)
    expert_dp = max(t * dp // (etp * cfg.parallel.expert), 1)
    where = f"/ data {dp}" + (f", experts / expert-data {expert_dp}" if expert_P else "") + \
        " (trainer.distributed_optimizer)"
    return (P - expert_P) / dp + expert_P / expert_dp, where


def _megatron_state(cfg: Config, P: float, dp: int, expert_P: float = 0.0) -> list[Term]:
    """What megatron's DDP and optimizer keep per GPU for `P` parameters of this rank's shard, `expert_P`
    of them its experts (`optimizer_share`: what the distributed optimizer divides). With
    `trainer.optimizer_offload` the optimizer's part is in host memory (`_host_terms`), 0 on the GPU:
    megatron-core's precision-aware distributed optimizer allocates no fp32 main-weight shard on the GPU
    and its HybridDeviceOptimizer keeps main weights and moments on the host (the trainer's
    `_offload_fields` cites the lines)."""
    bf16 = planned_precision(cfg) == "bf16"
    P_opt, where = optimizer_share(cfg, P, dp, expert_P)
    offload = cfg.trainer.optimizer_offload
    weights = (Term("weights (bf16)", _gib(BF16 * P), f"2 B x {P / 1e9:.2f}B parameters (largest stage / TP)") if bf16
               else Term("weights (fp32)", _gib(FP32 * P), f"4 B x {P / 1e9:.2f}B parameters (largest stage / TP)"))
    grads = Term("gradients (fp32)", _gib(FP32 * P), "4 B x parameters (megatron's fp32 gradient buffer"
                 + (", grad_reduce_in_fp32)" if bf16 else ")"))
    name, width = ("main weights + Adam moments (fp32)", 3 * FP32) if bf16 else ("Adam moments (fp32)", 2 * FP32)
    if offload:
        optimizer = Term(name, 0.0, f"in host memory (trainer.optimizer_offload): {width} B x {P_opt / 1e9:.2f}B "
                                    f"parameters {where}")
    else:
        optimizer = Term(name, _gib(width * P_opt), f"{width} B x parameters {where}")
    return [weights, grads, optimizer]


# host bytes per parameter of a rank's optimizer share under trainer.optimizer_offload, megatron-core 0.16.1's
# HybridDeviceOptimizer (megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py): the fp32 main weight
# (a host copy of the shard, lines 273-279), Adam's two fp32 moments (its host AdamW's state), and a pinned
# fp32 host copy of the shard's gradient, which the host step reads (lines 108-112)
OFFLOAD_HOST_BYTES = FP32 + 2 * FP32 + FP32


def _host_terms(cfg: Config, s: Shape, P: float, P_opt: float, ranks: int) -> list[Term]:
    """What a node's host memory holds for the Megatron trainer's `ranks` ranks on it (at most the node's
    GPUs), each a process with `P` parameters of its shard and the optimizer state of `P_opt` (the
    largest stage's, as on the GPU), and when:

    - training, with `trainer.optimizer_offload`: 16 B per parameter of the optimizer share
      (`OFFLOAD_HOST_BYTES`) x ranks;
    - at a checkpoint (`MegatronPolicyTrainer.save`): rank 0 gathers the whole policy to the host in
      the training dtype (`export_weights`, copied to the CPU) and writes it; the other ranks take part
      in the gathers and drop each tensor: 2 B (bf16) or 4 B (fp32) x all parameters, on rank 0's node,
      on top of the training term;
    - at the start (`MegatronPolicyTrainer.__init__`): every rank reads the Hugging Face checkpoint one
      Megatron tensor at a time (`load_hf_checkpoint`), holding the tensors it is read from and the full
      tensor made of them, then its piece on the device: 2 x 4 B (fp32 at most) x the largest such tensor
      (the embedding or LM head, a layer's fused QKV or fc1, an expert's fc1) x ranks. (With the offload,
      megatron-core's first offloading optimizer then copies the rank's weights to the host in fp32 before
      the distributed optimizer replaces it: 4 B x `P`, freed by the trainer right after.)

    The peak is the larger of the start and the training state with a checkpoint. Not counted: each
    process's runtime (interpreter, libraries, CUDA's host side), pinned staging memory the CUDA host
    allocator keeps cached, the engines' host memory, page cache."""
    n, total = ranks, parameters(s)
    width = BF16 if planned_precision(cfg) == "bf16" else FP32
    terms = []
    if cfg.trainer.optimizer_offload:
        terms.append(Term("training: optimizer offload", _gib(OFFLOAD_HOST_BYTES * P_opt * n),
                          f"16 B x {P_opt / 1e9:.2f}B parameters (a rank's optimizer share) x {n} rank(s): fp32 main "
                          f"weights 4 + Adam moments 8 + pinned gradient copy 4 (trainer.optimizer_offload)"))
    terms.append(Term(f"checkpoint: exported policy ({'bf16' if width == BF16 else 'fp32'})",
                      _gib(width * total), f"{width} B x {total / 1e9:.2f}B parameters (rank 0 gathers the whole "
                                           f"policy to the host to save it; rank 0's node)"))
    training = sum(t.gib for t in terms)  # the offload and a checkpoint's export, held together
    largest = max(padded_vocab(s.vocab, cfg.parallel.tensor) * s.hidden, (s.heads + 2 * s.kv_heads) * s.head_dim * s.hidden,
                  2 * s.ffn * s.hidden, 2 * s.expert_ffn * s.hidden)
    start = Term("start: loading the policy", _gib(2 * FP32 * largest * n),
                 f"2 x 4 B x {largest / 1e6:.1f}M parameters (the largest Megatron tensor, and what it is read from) "
                 f"x {n} rank(s), one tensor at a time")
    terms += [start, Term("peak", max(start.gib, training), "the larger of the start and training with a checkpoint")]
    return terms


def _deepspeed_state(cfg: Config, P: float, dp: int) -> list[Term]:
    """What DeepSpeed's ZeRO keeps per GPU for `P` parameters: stage 1 shards the optimizer over data
    ranks, 2 also the gradients, 3 also the weights. fp32: 4 B weights, 4 B gradients, 8 B Adam
    moments. bf16 (DeepSpeed's mixed precision): 2 B weights, 2 B gradients and 12 B of fp32 master
    weights and moments, the ZeRO paper's accounting (Rajbhandari et al. 2020, section 3: 2 + 2 + K,
    K = 12). `deepspeed.offload_optimizer` keeps the optimizer's part (master weights and moments) in
    CPU memory."""
    z, ds = cfg.deepspeed.zero_stage, cfg.deepspeed
    bf16 = planned_precision(cfg) == "bf16"
    width, name = (BF16, "bf16") if bf16 else (FP32, "fp32")
    optimizer_name = "main weights + Adam moments (fp32)" if bf16 else "Adam moments (fp32)"
    optimizer_bytes = (3 if bf16 else 2) * FP32
    return [Term(f"weights ({name})", _gib(width * P / (dp if z == 3 else 1)),
                 f"{width} B x {P / 1e9:.2f}B parameters" + (f" / data {dp} (ZeRO-3)" if z == 3 else "")),
            Term(f"gradients ({name})", _gib(width * P / (dp if z >= 2 else 1)),
                 f"{width} B x parameters" + (f" / data {dp} (ZeRO-{z})" if z >= 2 else "")),
            Term(optimizer_name, 0.0 if ds.offload_optimizer else _gib(optimizer_bytes * P / dp),
                 "in CPU memory (deepspeed.offload_optimizer)" if ds.offload_optimizer
                 else f"{optimizer_bytes} B x parameters / data {dp} (ZeRO)")]


def _policy_phases(plan: Plan, cfg: Config, s: Shape, dp: int, capacity: float, gpus_per_node: int) -> None:
    t, p = cfg.parallel.tensor, cfg.parallel.pipeline
    stage_layers = s.layers // p
    embed = s.vocab * s.hidden
    # the largest stage: the first holds the embedding, the last the LM head (and the final norm)
    stages = [stage_layers * layer_params(s) + (embed if i == 0 else 0) +
              ((0 if s.tied and p == 1 else embed) + s.hidden if i == p - 1 else 0) for i in range(p)]
    # a stage's experts are split over parallel.expert ranks (each expert whole on one), then each over the
    # experts' tensor-parallel ranks: TP, or at parallel.expert_tensor=1 none (each rank holds its experts whole)
    etp = expert_tensor_size(cfg.parallel) if s.moe else t
    experts = stage_layers * expert_params(s) / (etp * cfg.parallel.expert)
    P = (max(stages) - stage_layers * expert_params(s)) / t + experts
    ref = cfg.grpo.kl_coef > 0
    if cfg.trainer.backend == "deepspeed":
        resident = _deepspeed_state(cfg, P, dp)
    else:
        resident = _megatron_state(cfg, P, dp, experts)
    if cfg.trainer.backend == "megatron":
        plan.host = _host_terms(cfg, s, P, optimizer_share(cfg, P, dp, experts)[0],
                                min(gpus_per_node, t * p * dp))
    dtype = planned_precision(cfg)  # of activations, and of the reference policy but under DeepSpeed (fp32 there)
    width = BF16 if dtype == "bf16" else FP32
    if ref:
        ref_dtype, ref_width = ("fp32", FP32) if cfg.trainer.backend == "deepspeed" else (dtype, width)
        resident.append(Term(f"reference policy ({ref_dtype})", _gib(ref_width * P),
                             f"{ref_width} B x parameters (grpo.kl_coef > 0)"))
    reserve = Term("runtime allowance", RESERVE_GIB[cfg.engine.backend], "fixed (CUDA context, buffers, fragmentation)")

    # rollout: the engine holds its share while the trainer's state stays
    r, et = cfg.rollout, cfg.engine.tensor
    engines = t * p * dp // et
    seqs = math.ceil(r.prompts_per_step / engines) * r.group_size  # sequences the busiest engine samples per step
    L = cfg.model.max_context
    if cfg.engine.backend == "sglang":
        f = cfg.engine.mem_fraction
        engine_w = BF16 * (parameters(s) + draft_parameters(s)) / et
        per_token = kv_bytes_per_token(s, BF16) / et
        kv_tokens = (f * capacity * GIB - engine_w) / per_token
        engine = [Term("engine: weights + draft (bf16)", _gib(engine_w),
                       f"2 B x {(parameters(s) + draft_parameters(s)) / 1e9:.1f}B / engine.tensor {et}; inside its "
                       f"fraction"),
                  Term("engine: KV cache pool", f * capacity - _gib(engine_w),
                       f"engine.mem_fraction {f} x {capacity:g} GiB - weights = {kv_tokens / 1e6:.2f}M tokens "
                       f"at {per_token / 1024:.1f} KiB/token/GPU")]
    else:  # the embedded engine: the whole policy on every policy rank, a static fp32 cache
        per_token = kv_bytes_per_token(s, FP32)
        kv_tokens = r.max_batch * L
        engine = [Term("engine: weights (fp32)", _gib(FP32 * parameters(s)), "4 B x all parameters"),
                  Term("engine: KV cache (fp32)", _gib(per_token * kv_tokens),
                       f"{r.max_batch} slots x {L} tokens x {per_token / 1024:.1f} KiB/token")]
    full_seqs = int(kv_tokens // L) if kv_tokens > 0 else 0
    plan.checks.append((full_seqs >= 1, f"the engine's KV cache holds {max(full_seqs, 0)} full-length sequences "
                                        f"({L} tokens) at once"))
    if 0 < full_seqs < min(seqs, r.max_batch):
        plan.notes.append(f"an engine runs at most {full_seqs} of its {seqs} sequences at once (the rest wait); a "
                          f"larger engine.mem_fraction or engine.tensor runs more at once")
    plan.phases.append(Phase("policy GPU", "rollout", resident + engine + [reserve], capacity))

    # training: the engine has released its memory; activations of the micro-batches in flight
    b = cfg.grpo.micro_batch_size
    rows = math.ceil(r.prompts_per_step * r.group_size / dp / cfg.grpo.minibatches)  # a replica's minibatch
    in_flight = min(p, math.ceil(rows / b))  # 1F1B: stage 0 holds up to PP micro-batches
    h, q, kv = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    # the MLP's by the active parameters: a token runs top_k experts (balanced routing keeps a rank's
    # dispatched tokens at its own on average), beside the router's logits
    ff = s.top_k * s.expert_ffn if s.moe else s.ffn
    layer_elems = b * L * (4 * h + (3 * q + 3 * kv) // t + 4 * ff // t + s.experts)
    formula = (f"{width} B x b{b} x s{L} x (4h + (3q + 3kv)/TP + 4 top_k expert_ffn/TP + experts)" if s.moe
               else f"{width} B x b{b} x s{L} x (4h + (3q + 3kv)/TP + 4 ffn/TP)")
    scores = 0
    if cfg.trainer.layer_spec == "local":  # unfused attention keeps the s x s scores and probabilities
        scores = 2 * b * (s.heads // t) * L * L
        formula += " + 2 b heads/TP s^2 (local spec: unfused attention)"
    if cfg.trainer.recompute:
        act = width * (b * L * h * stage_layers * in_flight + layer_elems + scores)
        what = f"recompute: {width} B x b s h x {stage_layers} layers x {in_flight} in flight + one layer: {formula}"
    else:
        act = width * (layer_elems + scores) * stage_layers * in_flight
        what = f"{stage_layers} layers x {in_flight} in flight x {formula}"
    train = resident + [Term(f"activations ({dtype})", _gib(act), what), _logits_term(cfg, s, b * L, t), reserve]
    plan.phases.append(Phase("policy GPU", "training", train, capacity))
    if not plan.phases[-1].fits and not cfg.trainer.recompute:
        plan.advice.append("trainer.recompute=true keeps one input per layer instead of every activation")


def _logits_term(cfg: Config, s: Shape, tokens: int, t: int) -> Term:
    """The last stage's scoring of a micro-batch of `tokens` tokens: `LOGIT_COPIES` fp32 copies of its
    logits over this TP rank's vocabulary, or with `trainer.logits_chunk_tokens` (fewer than `tokens`)
    of one chunk's, plus the output weight's gradient summed over the chunks in fp32 (4 B x vocab/TP x h)."""
    r = cfg.rollout
    cut = r.temperature > 0 and (r.top_k > 0 or r.top_p < 1.0)
    copies = LOGIT_COPIES_CUT if cut else LOGIT_COPIES
    what = "fp32 logits, scaled, log-softmax, exp, gradients" + (", top-k/top-p sort and masks" if cut else "")
    padded = padded_vocab(s.vocab, t) // t  # per TP rank
    chunk = cfg.trainer.logits_chunk_tokens
    if 0 < chunk < tokens:
        k = copies["chunk"]
        return Term("logits (last stage, one chunk)", _gib(k * FP32 * chunk * padded + FP32 * padded * s.hidden),
                    f"{k:g} x 4 B x {chunk} tokens (trainer.logits_chunk_tokens) x {padded} vocab/TP ({what}) "
                    f"+ 4 B x {padded} vocab/TP x h (output weight's gradient over chunks)")
    k = copies["whole"]
    return Term("logits (last stage)", _gib(k * FP32 * tokens * padded),
                f"{k:g} x 4 B x {tokens} tokens (micro-batch) x {padded} vocab/TP ({what})")


def _draft_phase(plan: Plan, cfg: Config, s: Shape, capacity: float) -> None:
    d, L = cfg.draft, cfg.model.max_context
    P = draft_parameters(s)
    terms = [Term("draft weights, gradients, Adam (fp32)", _gib(4 * FP32 * P), f"16 B x {P / 1e9:.2f}B parameters"),
             Term("policy embedding + LM head (fp32)", _gib(FP32 * 2 * s.vocab * s.hidden),
                  "4 B x 2 x vocab x h (what the draft trains against)"),
             Term("state buffer", _gib(d.online_buffer_tokens * (FP32 * s.hidden + 9)),
                  f"draft.online_buffer_tokens {d.online_buffer_tokens} x (4 h + 9) B"),
             Term("activations + logits", _gib(FP32 * d.batch_size * L * (12 * s.hidden + 3 * s.vocab)),
                  f"4 B x draft.batch_size {d.batch_size} x s{L} x (12 h + 3 vocab)"),
             Term("runtime allowance", RESERVE_GIB[cfg.engine.backend], "fixed (CUDA context, buffers, fragmentation)")]
    plan.phases.append(Phase("draft GPU", "training", terms, capacity))
    if not plan.phases[-1].fits:
        plan.advice.append("a smaller draft.batch_size shrinks the draft's logits (sequences x vocab)")


def make_plan(cfg: Config, nodes: int, gpus_per_node: int, gpu_memory_gb: float) -> Plan:
    """The layout of `cfg` on `nodes` x `gpus_per_node` devices of `gpu_memory_gb` GiB each."""
    config, source = model_config(cfg)
    s = Shape.of(config)
    plan = Plan()
    dp = _check_layout(plan, cfg, config, s, nodes * gpus_per_node, gpus_per_node)
    if not dp:
        t, p = cfg.parallel.tensor, cfg.parallel.pipeline
        plan.advice.append(f"the policy needs a multiple of {t * p} GPUs (tensor x pipeline) after the "
                           f"{cfg.parallel.draft_ranks} draft rank(s): change --nodes, parallel.* or parallel.draft_ranks")
        return plan
    active = f", {parameters(s, active=True) / 1e9:.2f}B active" if s.moe else ""
    plan.notes.append(f"{parameters(s) / 1e9:.2f}B parameters{active} ({s.describe()}) from {source}; draft head "
                      f"{draft_parameters(s) / 1e9:.2f}B")
    _rank_map(plan, cfg, nodes, gpus_per_node, dp)
    _policy_phases(plan, cfg, s, dp, gpu_memory_gb, gpus_per_node)
    if cfg.parallel.draft_ranks:
        _draft_phase(plan, cfg, s, gpu_memory_gb)
    for phase in plan.phases:
        if not phase.fits:
            big = max(phase.terms, key=lambda x: x.gib)
            plan.advice.append(f"{phase.device}, {phase.phase}: {phase.total_gib:.1f} GiB > {phase.capacity_gib:g} GiB; "
                               f"the largest term is {big.name} ({big.gib:.1f} GiB)")
    if any(not p.fits and p.device == "policy GPU" for p in plan.phases):
        plan.advice.append("more tensor or pipeline ranks divide the weights, gradients and Adam moments")
    return plan


def _expert_label(cfg: Config) -> str:
    """The plan's header: the expert-parallel sizes where they are set (expert, and the experts' tensor
    size when it is not TP's)."""
    par = cfg.parallel
    label = f", expert {par.expert}" if par.expert > 1 else ""
    if expert_tensor_size(par) != par.tensor:
        label += f", expert tensor {expert_tensor_size(par)} (experts whole)"
    return label


def render(plan: Plan, cfg: Config, nodes: int, gpus_per_node: int, gpu_memory_gb: float) -> str:
    lines = [f"plan: {nodes} node(s) x {gpus_per_node} GPU(s) of {gpu_memory_gb:g} GiB; tensor {cfg.parallel.tensor}, "
             f"pipeline {cfg.parallel.pipeline}{_expert_label(cfg)}, {cfg.parallel.draft_ranks} draft rank(s); trainer "
             f"{cfg.trainer.backend}, engine {cfg.engine.backend}", ""]
    lines += [f"  [{'ok' if ok else 'NO'}] {text}" for ok, text in plan.checks]
    if plan.rank_map:
        lines += ["", "rank map (t<tensor>p<pipeline stage>d<data replica>; * leads a rollout engine):"]
        lines += ["  " + row for row in plan.rank_map]
    for phase in plan.phases:
        lines += ["", f"{phase.device}, {phase.phase} (estimates, GiB):"]
        lines += [f"  {t.name:<38} {t.gib:8.2f}   {t.formula}" for t in phase.terms]
        lines.append(f"  {'total':<38} {phase.total_gib:8.2f}   of {phase.capacity_gib:g}: "
                     f"{'fits' if phase.fits else 'DOES NOT FIT'}")
    if plan.host:
        lines += ["", "host memory per node (estimates, GiB; the Megatron trainer's ranks):"]
        lines += [f"  {t.name:<38} {t.gib:8.2f}   {t.formula}" for t in plan.host]
    lines += [""] + [f"note: {n}" for n in plan.notes]
    lines += [f"to change: {a}" for a in plan.advice]
    lines.append("verdict: fits" if plan.fits else "verdict: does not fit")
    return "\n".join(lines)
