"""megatron-core's GPTModel for a Hugging Face policy of the families fastgrpo serves (Llama 3.x,
Qwen2.5, Qwen3, Qwen3-MoE) at any TP x PP (x EP for a mixture of experts): the parallel groups, the
model of this rank's pipeline stage, Hugging Face weights in, full Hugging Face tensors out.

Qwen3-MoE runs megatron-core's MoELayer (`moe_config`): softmax routing over the router's fp32
logits, the alltoall token dispatcher (what GPUs run; on CPU with `megatron_patches`), each expert a
SwiGLU of `moe_intermediate_size` (SequentialMLP: one matmul per expert; no grouped GEMM, which needs
a CUDA kernel), the experts split over `parallel.expert` ranks and each expert over the TP ranks
(expert tensor parallelism = TP), or with `parallel.expert_tensor=1` each expert whole on its EP rank
(megatron-core's expert grid, expert tensor x expert x expert-data x pipeline, then puts EP across the
TP ranks: the token all-to-all replaces the gathers over TP inside the experts). With TP > 1 the whole model runs sequence-parallel, as megatron
requires of MoE: without it each TP rank would put the same tokens through the experts and their
gradients would come out TP times too large.

Each family through megatron-core's own options (`transformer_config`, `layer_spec`): Qwen2's
`add_qkv_bias`; Qwen3's `qk_layernorm` with `kv_channels` its head_dim (the softmax scale defaults to
1/sqrt(kv_channels), transformer/dot_product_attention.py:84-85, as Hugging Face's head_dim**-0.5); tied or untied heads.
The rotary embedding's inverse frequencies are always Hugging Face's (`set_hf_rope`): megatron's own
llama3 scaling fixes original_max_position_embeddings at 8192 and the low/high frequency factors at
1 and 4 (`RotaryEmbedding.__init__` passes only the factor to `_apply_scaling`,
models/common/embeddings/rotary_pos_embedding.py:83-84, 92-98).

The same code runs on GPUs (NCCL, megatron-core unpatched but for its local spec's torch fallbacks)
and on CPU over gloo (with `megatron_patches`, applied here and only here).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from fastgrpo.models.rope import hf_inv_freq, rope_parameters
from fastgrpo.trainers.megatron.layout import EXPERT, LAYER, ROUTER, Layout, LayoutError
from fastgrpo.distributed import COLLECTIVE_TIMEOUT, init_world
from fastgrpo.safetensors_dir import SafetensorsDir
from fastgrpo.config import LAYER_SPECS


def _megatron():
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        from fastgrpo.protocols import BackendUnavailable

        raise BackendUnavailable(f"trainer.backend=megatron needs megatron-core ({e}); install it with "
                                 f"`pip install -e \".[megatron]\"`") from e
    import megatron_patches

    megatron_patches.apply()  # on CPU every patch; with CUDA only the local spec's (megatron_patches)


def initialize(tensor: int, pipeline: int, seed: int = 0, expert: int = 1, expert_tensor: int = 0) -> None:
    """Megatron's model-parallel groups over the torch.distributed world (torchrun's, or a world of
    one made here); every rank of the world must call this, in the same order (group creation is
    collective). `expert`: the expert-parallel size; `expert_tensor`: the experts' tensor-parallel size
    (0: TP). megatron-core lays the experts out on a grid of their own over the same ranks, expert
    tensor x expert x expert-data x pipeline (parallel_state.py, the expert RankGenerator), so the world
    must be a multiple of expert_tensor x EP x PP as well as of TP x PP: at expert_tensor = TP, EP splits
    the data-parallel ranks of each stage; at 1, EP spans the TP ranks too."""
    _megatron()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if torch.cuda.is_available():  # one GPU per rank, before any NCCL communicator exists (torchrun's LOCAL_RANK)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    init_world()  # torchrun's world, when launched by it
    if not dist.is_initialized():  # started alone: a world of one
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=COLLECTIVE_TIMEOUT)
    world = dist.get_world_size()
    etp = expert_tensor or tensor
    if world % (tensor * pipeline):
        raise LayoutError(f"a world of {world} ranks does not split into tensor {tensor} x pipeline {pipeline} groups")
    if world % (etp * expert * pipeline):
        if etp == tensor:
            raise LayoutError(f"parallel.expert={expert}: a world of {world} ranks at tensor {tensor} x pipeline "
                              f"{pipeline} has {world // (tensor * pipeline)} data-parallel ranks per stage, which "
                              f"{expert} expert-parallel ranks do not split")
        raise LayoutError(f"parallel.expert={expert} x parallel.expert_tensor={etp}: a world of {world} ranks at "
                          f"pipeline {pipeline} has {world // pipeline} ranks per stage, which megatron-core's expert "
                          f"grid (expert tensor {etp} x expert {expert} x expert-data) does not split")
    if parallel_state.model_parallel_is_initialized():
        if (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.get_expert_model_parallel_world_size(),
                parallel_state.get_expert_tensor_parallel_world_size()) != (tensor, pipeline, expert, etp):
            raise RuntimeError("megatron's parallel groups already exist with another layout")
        return
    parallel_state.initialize_model_parallel(tensor, pipeline, expert_model_parallel_size=expert,
                                             expert_tensor_parallel_size=etp,
                                             distributed_timeout_minutes=int(COLLECTIVE_TIMEOUT.seconds // 60))
    model_parallel_cuda_manual_seed(seed)


def ranks() -> tuple[int, int]:
    """(tensor-parallel rank, pipeline stage) of this process."""
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()


def expert_rank() -> int:
    """This process's rank in its expert-parallel group (which experts of each layer it holds)."""
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_rank()


def expert_tensor_rank() -> int:
    """This process's rank in its expert-tensor-parallel group (which piece of each of its experts it
    holds; 0 at `parallel.expert_tensor=1`, the expert whole)."""
    from megatron.core import parallel_state

    return parallel_state.get_expert_tensor_parallel_rank()


def moe_config(layout: Layout, router_aux_loss: float = 0.0, router_z_loss: float = 0.0) -> dict:
    """megatron's TransformerConfig options for the layout's mixture of experts ({} for a dense model).

    Routing as Hugging Face's Qwen3MoeTopKRouter: softmax over every expert's fp32 logit, the top k,
    renormalised over the k when `norm_topk_prob`. megatron's softmax routing without `pre_softmax`
    takes the top k logits and softmaxes over them, the same numbers (the softmax's denominator
    cancels); with `pre_softmax` it softmaxes over all experts and keeps the top k as they are (no
    renormalisation). No scaling factor on the weights, no capacity (no token dropped), no shared
    expert. The experts' tensor-parallel size is the layout's (`Layout.expert_tp`: TP, or 1 with
    each expert whole); the dense part stays sequence-parallel over TP either way (megatron asks it of
    a MoE at TP > 1). The load-balancing loss and the z-loss are the trainer's `router_aux_loss` and
    `router_z_loss` (0: none, the default for RL fine-tuning, where the policy's routing is already
    trained; "none" balancing then, and no z-loss)."""
    if not layout.experts:
        return {}
    return dict(
        num_moe_experts=layout.experts, moe_router_topk=layout.top_k, moe_ffn_hidden_size=layout.expert_ffn,
        moe_router_score_function="softmax", moe_router_pre_softmax=not layout.norm_topk,
        moe_router_topk_scaling_factor=None, moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss" if router_aux_loss > 0 else "none",
        moe_aux_loss_coeff=float(router_aux_loss), moe_z_loss_coeff=float(router_z_loss) if router_z_loss > 0 else None,
        moe_token_dispatcher_type="alltoall", moe_shared_expert_intermediate_size=None,
        # CUDA kernels (Transformer Engine's fused permute / router, the grouped GEMM): off, the same mathematics
        moe_grouped_gemm=False, moe_permute_fusion=False, moe_router_fusion=False,
        expert_model_parallel_size=layout.expert, expert_tensor_parallel_size=layout.expert_tp,
        sequence_parallel=layout.tensor > 1)


def transformer_config(hf_config, layout: Layout, recompute: bool = False, dtype: torch.dtype = torch.float32,
                       router_aux_loss: float = 0.0, router_z_loss: float = 0.0):
    """`recompute`: keep only each layer's input for the backward and run the layer's forward again
    there (megatron's full, uniform, one-layer recompute): what long reasoning sequences need.
    `dtype`: the weights' and activations' (bf16: megatron's `bf16`, the model wrapped in its
    `Float16Module` by the trainer; softmax and the rotary tables stay fp32 as megatron keeps them).
    A mixture of experts adds `moe_config`'s options. `calculate_per_token_loss` stays False here:
    the router reads it when built, and with it megatron scales the auxiliary losses by the token
    count for a division the trainer never makes (`trainer._finalize_model_grads`)."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=layout.layers, hidden_size=layout.hidden, num_attention_heads=layout.heads,
        num_query_groups=layout.kv_heads, kv_channels=layout.head_dim, ffn_hidden_size=layout.ffn,
        normalization="RMSNorm", layernorm_epsilon=hf_config.rms_norm_eps, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=layout.qkv_bias, qk_layernorm=layout.qk_norm,
        tensor_model_parallel_size=layout.tensor, pipeline_model_parallel_size=layout.pipeline,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not torch.cuda.is_available(),
        # fused kernels are CUDA-only; with them off the mathematics is the same
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, attention_softmax_in_fp32=True,
        calculate_per_token_loss=False, **moe_config(layout, router_aux_loss, router_z_loss),
        **(dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}))


def set_hf_rope(model, hf_config) -> None:
    """Give `model`'s rotary embedding Hugging Face's inverse frequencies (`fastgrpo.models.rope`): for
    Llama 3.1's `llama3` scaling megatron computes others (see the module docstring), and for the
    default rope the same ones. Called after every build, before the first forward: `inv_freq` is a
    plain attribute, not in the state dict (its loader drops it, rotary_pos_embedding.py:208-210), and
    `RotaryEmbedding.forward` is lru-cached by sequence length (rotary_pos_embedding.py:177), so a
    table computed before would be served stale; the cache is cleared here all the same. Kept on the
    device megatron put it (on CUDA, `get_emb` moves a CPU one to the current GPU at first use)."""
    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is None:
        raise LayoutError("the Megatron model has no rotary embedding to set")
    inv_freq, _ = hf_inv_freq(hf_config)  # Layout.of refused a rope with a cos/sin factor
    if inv_freq.shape != rotary.inv_freq.shape:
        raise LayoutError(f"Hugging Face's rotary embedding has {inv_freq.numel()} frequencies, megatron's "
                          f"{rotary.inv_freq.numel()} (kv_channels {model.config.kv_channels})")
    rotary.inv_freq = inv_freq.to(device=rotary.inv_freq.device, dtype=rotary.inv_freq.dtype)
    type(rotary).forward.cache_clear()


def layer_spec(name: str, qk_norm: bool = False, experts: int = 0):
    """megatron's layer spec for `trainer.layer_spec`, and how its parameter names differ from the
    local spec's (the names `Layout` speaks). `auto`: Transformer Engine's when it is importable
    (fused norm + linear kernels on GPUs), else the local spec (plain torch, what runs here).
    `qk_norm`: Qwen3's per-head q/k norms (both specs' `qk_layernorm`, named alike in both).
    `experts`: a MoELayer of that many experts as every layer's MLP (SequentialMLP experts, named
    alike in both specs; its norm before the MLP is a norm of its own in both, not fused)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if name not in LAYER_SPECS:
        raise LayoutError(f"trainer.layer_spec={name!r}: must be one of {', '.join(LAYER_SPECS)}")
    moe = dict(num_experts=experts, moe_grouped_gemm=False) if experts else {}
    local = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_norm, **moe)
    has_te = importlib.util.find_spec("transformer_engine") is not None
    if name == "local" or (name == "auto" and not has_te):
        return local, {}
    if not has_te:
        from fastgrpo.protocols import BackendUnavailable

        raise BackendUnavailable("trainer.layer_spec=transformer_engine needs transformer-engine, which is not "
                                 "installed (it builds on CUDA machines only); use auto or local")
    # Transformer Engine fuses each pre-attention and pre-MLP norm into the linear layer after it;
    # megatron's local spec records the correspondence (for its checkpoints), and so do we. Before a
    # MoELayer there is no linear layer to fuse into: the TE spec keeps `pre_mlp_layernorm`
    renames = {k: v for k, v in local.submodules.sharded_state_dict_keys_map.items()
               if not (experts and k == "pre_mlp_layernorm.")}
    return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_norm, **moe), renames


def _module_name(model, local_name: str) -> str:
    """A parameter's name in `model` from its local-spec name."""
    for ours, theirs in getattr(model, "local_to_spec_names", {}).items():
        if f".{ours}" in local_name:
            return local_name.replace(f".{ours}", f".{theirs}", 1)
    return local_name


def build_model(hf_config, layout: Layout, spec: str = "auto", recompute: bool = False,
                dtype: torch.dtype = torch.float32, router_aux_loss: float = 0.0, router_z_loss: float = 0.0):
    """This rank's pipeline stage of the policy (of a mixture of experts, this EP rank's experts), on
    the CPU or the current GPU, with megatron's layer spec `spec` (`layer_spec`), its weights in
    `dtype`; weights uninitialised in meaning: load them with `load_hf_state`. Its rotary embedding
    rotates as Hugging Face's (`set_hf_rope`). `router_aux_loss`, `router_z_loss`: `moe_config`'s."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    module_spec, renames = layer_spec(spec, layout.qk_norm, layout.experts)
    model = GPTModel(
        transformer_config(hf_config, layout, recompute, dtype, router_aux_loss, router_z_loss), module_spec,
        vocab_size=layout.padded_vocab, max_sequence_length=hf_config.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=layout.tied, position_embedding_type="rope",
        rotary_base=float(rope_parameters(hf_config)["rope_theta"]))  # its table is replaced by set_hf_rope
    model.local_to_spec_names = renames
    model = model.cuda() if torch.cuda.is_available() else model
    set_hf_rope(model, hf_config)
    freeze_padding_row(model, getattr(hf_config, "pad_token_id", None), layout.vocab)
    return model


def freeze_padding_row(model, pad_id: int | None, vocab: int) -> None:
    """Hugging Face's embedding of these families is `nn.Embedding(..., padding_idx=pad_token_id)`
    (transformers 5.24 modeling_llama.py:343, modeling_qwen2.py:320, modeling_qwen3.py:345): a lookup of the pad token sends no
    gradient to its row. megatron's VocabParallelEmbedding has no padding_idx
    (models/common/embeddings/language_model_embedding.py:111 looks every id up alike), so without
    this the Megatron trainer would train a row the torch trainer never moves, and a zero row (as
    Hugging Face initialises it) takes a gradient of 1/sqrt(rms_norm_eps) through the first norm
    (measured: 1285 against a whole-model gradient norm of 1.9 on the Qwen3 test checkpoint). The
    lookups of the pad token are detached here, on the first stage: the same values, and the
    gradient Hugging Face computes (the tied LM head's gradient to that row still flows, as there).
    Under sequence parallelism (a MoE at TP > 1) the lookup's output is already reduce-scattered over
    the sequence, [s / tp, b, h]: its pad positions are this TP rank's share of the sequence."""
    embedding = getattr(getattr(model, "embedding", None), "word_embeddings", None)
    if embedding is None or pad_id is None or not 0 <= pad_id < vocab:
        return

    def detach_pad_lookups(module, inputs, output):
        if not torch.is_grad_enabled():
            return output
        pad = inputs[0] == pad_id  # [b, s]
        if module.reduce_scatter_embeddings:  # sequence parallel: this TP rank's [s / tp, b, h] share
            from megatron.core import parallel_state

            tp = parallel_state.get_tensor_model_parallel_world_size()
            pad = pad.transpose(0, 1).chunk(tp)[parallel_state.get_tensor_model_parallel_rank()]
        return torch.where(pad[..., None], output.detach(), output)

    embedding.register_forward_hook(detach_pad_lookups)


def load_hf_state(model, hf_state: Mapping[str, Tensor], layout: Layout) -> None:
    """Load this rank's slice of a Hugging Face state dict (names checked both ways): a model's state
    dict or a checkpoint's tensors (experts stacked or each its own, `Layout`)."""
    _load_pieces(model, layout, lambda name: layout.megatron_tensor(name, hf_state))


def load_hf_checkpoint(model, policy_dir: Path, layout: Layout) -> None:
    """Load this rank's slice of a Hugging Face checkpoint on disk (its safetensors, each read when a
    Megatron tensor made of it is, manifest checksums checked where there is one), one Megatron tensor
    at a time: only the tensors this rank holds a piece of are read, and no rank holds more than one
    full tensor beyond its own shards: loading the whole model on every rank would cost each rank the
    full fp32 model in host memory (122 GB for Qwen3-30B-A3B, eight times over on a node of eight)."""
    load_hf_state(model, SafetensorsDir(policy_dir), layout)


def _load_pieces(model, layout: Layout, full_tensor: Callable[[str], Tensor]) -> None:
    """Each Megatron tensor this rank holds a piece of, made by `full_tensor(name)` and cut into the
    rank's pieces, copied into the model's parameters; every parameter loaded exactly once (the names
    are checked both ways before any tensor is made)."""
    tp_rank, pp_rank = ranks()
    ep_rank, etp_rank = (expert_rank(), expert_tensor_rank()) if layout.experts else (0, 0)
    held = {n: layout.local_names(n, pp_rank, ep_rank) for n in layout.megatron_names()}
    names = [n for n, local in held.items() if local]
    planned = {_module_name(model, local) for n in names for local in held[n]}
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    if planned != set(state):
        raise LayoutError(f"the checkpoint does not match the model: missing {sorted(set(state) - planned)[:5]}, "
                          f"unexpected {sorted(planned - set(state))[:5]}")
    with torch.no_grad():
        for name in names:
            pieces = layout.rank_pieces(name, full_tensor(name), tp_rank, pp_rank, ep_rank, etp_rank)
            for local, piece in pieces.items():
                target = state[_module_name(model, local)]
                if target.shape != piece.shape:
                    raise LayoutError(f"{name}: the checkpoint's piece is {tuple(piece.shape)}, the model's "
                                      f"{local} {tuple(target.shape)}")
                target.copy_(piece)


def export_hf(model, layout: Layout, grads: bool = False) -> Iterator[tuple[str, Tensor]]:
    """Full Hugging Face tensors, one Megatron parameter at a time, on every rank of the model-parallel
    group: TP shards are all-gathered, each expert is broadcast from the expert-parallel rank that
    holds it to the others of its EP group (its shards gathered over megatron's expert-tensor group
    there first; at `parallel.expert_tensor=1` it is whole already), and each pipeline
    stage broadcasts its own layers to the other stages. No rank ever holds more than one full tensor
    beyond its own shards. Experts come out as each expert's own matrices, expert by expert
    (`Layout.to_hf`). `grads`: the parameters' gradients instead (zeros where there is none), under
    the same names. In the parameters' dtype and on their device, as held (every parameter of a model
    has the same dtype)."""
    from megatron.core import parallel_state

    tp_group = parallel_state.get_tensor_model_parallel_group()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    pp_ranks = dist.get_process_group_ranks(pp_group)
    _, pp_rank = ranks()
    if layout.experts:
        etp_group = parallel_state.get_expert_tensor_parallel_group()
        ep_group = parallel_state.get_expert_model_parallel_group()
        ep_ranks, ep_rank = dist.get_process_group_ranks(ep_group), expert_rank()
    params = dict(model.named_parameters())
    first = next(iter(params.values()))
    dtype, device = first.dtype, first.device
    for stage in range(layout.pipeline):
        for name in _stage_parameter_names(layout, stage):
            if layout.tied and name == "output_layer.weight":
                continue  # the last stage's copy of the embedding
            expert = EXPERT.match(name.split(".", 3)[-1]) if layout.experts and LAYER.match(name) else None
            owner = layout.expert_owner(int(expert.group(1)))[0] if expert else None
            if stage == pp_rank and (owner is None or owner == ep_rank):
                param = params[_module_name(model, layout.stage_name(name, stage, owner or 0))]
                shard = (param.grad if param.grad is not None else torch.zeros_like(param)) if grads else param.detach()
                if layout.pieces(name) > 1:
                    shards = [torch.empty_like(shard) for _ in range(layout.pieces(name))]
                    dist.all_gather(shards, shard.contiguous(), group=etp_group if expert else tp_group)
                    full = layout.unshard(name, shards)
                else:
                    full = shard.clone()
            else:
                full = torch.empty(_full_shape(layout, name), dtype=dtype, device=device)
            if expert and stage == pp_rank and layout.expert > 1:
                dist.broadcast(full, src=ep_ranks[owner], group=ep_group)
            if layout.pipeline > 1:
                dist.broadcast(full, src=pp_ranks[stage], group=pp_group)
            yield from layout.to_hf(name, full)


def _stage_parameter_names(layout: Layout, stage: int) -> list[str]:
    """The global names of pipeline stage `stage`'s parameters (experts under their global index), in
    a fixed order every rank agrees on."""
    names = [f"decoder.layers.{i}.{p}" for i in layout.stage_layers(stage) for p in layout.layer_parameters()]
    if stage == 0:
        names.insert(0, "embedding.word_embeddings.weight")
    if stage == layout.pipeline - 1:
        names.append("decoder.final_layernorm.weight")
        if not layout.tied:
            names.append("output_layer.weight")
    return names


def _full_shape(layout: Layout, name: str) -> tuple[int, ...]:
    """The full (TP-gathered) shape of a parameter, known to every stage from the layout alone."""
    h, d, ffn = layout.hidden, layout.head_dim, layout.ffn
    qkv_rows = (layout.heads + 2 * layout.kv_heads) * d
    rest = name.split(".", 3)[-1] if name.startswith("decoder.layers.") else name
    expert = EXPERT.match(rest)
    if expert:
        return (2 * layout.expert_ffn, h) if expert.group(2) == "linear_fc1.weight" else (h, layout.expert_ffn)
    shapes = {"embedding.word_embeddings.weight": (layout.padded_vocab, h), "output_layer.weight": (layout.padded_vocab, h),
              "decoder.final_layernorm.weight": (h,), "input_layernorm.weight": (h,), "pre_mlp_layernorm.weight": (h,),
              "self_attention.linear_qkv.weight": (qkv_rows, h), "self_attention.linear_qkv.bias": (qkv_rows,),
              "self_attention.linear_proj.weight": (h, layout.heads * d), "mlp.linear_fc1.weight": (2 * ffn, h),
              "self_attention.q_layernorm.weight": (d,), "self_attention.k_layernorm.weight": (d,),
              "mlp.linear_fc2.weight": (h, ffn), ROUTER: (layout.experts, h)}
    return shapes[rest]
