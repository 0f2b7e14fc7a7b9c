"""Each model family's decoder layer, described as data: what the embedded engine holds and the draft
head trains (`models.families` says which families are supported).

What differs between Llama 3.x, Qwen2.5 and Qwen3 dense is which tensors a decoder layer holds, and
their sizes: Qwen2 adds biases to the q/k/v projections, Qwen3 an RMSNorm over each head of q and k
(before the rotation) and a head size of its own (`head_dim`, not hidden / heads). A `LayerLayout`
lists a layer's tensors as the engine keeps them (q/k/v fused into one matrix, gate/up into another:
fewer, larger matmuls) with the Hugging Face tensors each one holds, so loading, the weight push and
the forward all follow one table. The forward (layers.decoder_layer) uses a tensor when the layer has
it: a bias, a q/k norm.

Adding a family is an entry in FAMILIES: a function from the config and a layer's index to that
layer's layout (a mixture of experts may keep dense layers among its sparse ones). A mixture of
experts lists its router and expert tensors and names its MLP (`LayerLayout.mlp`: "moe"), which the
forward runs (layers.moe_mlp) in place of the dense SwiGLU one.

Experts are held stacked, one [E, rows, cols] tensor per kind (`LayerTensor.experts` = E): the
gate and up projections of every expert in one, the down projections in another, which is how
transformers 5 holds them (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`: the names its
state dict and so a trainer's push use). Checkpoints on disk (and transformers 4) name each
expert's own matrices (`mlp.experts.{j}.gate_proj.weight`, ...): those names are accepted too, as
views of the stacked tensor (`LayerLayout.hf_aliases`), so either layout loads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor
from transformers import PretrainedConfig

from fastgrpo.models.rope import head_dim


@dataclass(frozen=True)
class LayerTensor:
    """One tensor of the engine's decoder layer: `parts` are the Hugging Face tensors (named under
    `model.layers.{i}.`) it holds as consecutive blocks of rows, in order; `cols` its second dimension
    (None: a vector).

    Stacked experts (`experts` = E > 0): the tensor is [E, rows, cols], `stacked` the Hugging Face
    name of the whole (transformers 5's fused parameter) and `parts` the names of one expert's blocks
    of rows, with `{j}` for the expert's index (a checkpoint's per-expert tensors)."""

    key: str
    cols: int | None
    parts: tuple[tuple[str, int], ...]
    experts: int = 0
    stacked: str | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        rows = sum(n for _, n in self.parts)
        one = (rows,) if self.cols is None else (rows, self.cols)
        return (self.experts, *one) if self.experts else one


@dataclass(frozen=True)
class MoeRouting:
    """How a sparse MLP routes a token: a softmax over the router's logits (in fp32), the `top_k`
    largest kept, renormalised to sum to 1 when `norm_topk_prob`."""

    experts: int
    top_k: int
    norm_topk_prob: bool


@dataclass(frozen=True)
class LayerLayout:
    """A decoder layer of one family at one size: its tensors, and the sizes its forward needs."""

    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    tensors: tuple[LayerTensor, ...]
    mlp: str = "swiglu"  # which MLP the forward runs: swiglu (layers.swiglu_mlp) or moe (layers.moe_mlp)
    moe: MoeRouting | None = None  # the routing of a mixture-of-experts MLP

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {t.key: t.shape for t in self.tensors}

    @property
    def matrices(self) -> tuple[str, ...]:
        """The tensors the forward multiplies by (what the oneDNN kernel keeps packed copies of; stacked
        experts are multiplied as they are, grouped by expert)."""
        return tuple(t.key for t in self.tensors if t.cols is not None and not t.experts)

    def hf_views(self, layer: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
        """Hugging Face name (`prefix` + its name in the layer) -> the view of `layer`'s tensor holding
        it: the names of the installed transformers' state dict (stacked experts whole)."""
        views = {}
        for t in self.tensors:
            if t.experts:
                views[prefix + t.stacked] = layer[t.key]
                continue
            for (name, _), view in zip(t.parts, layer[t.key].split([n for _, n in t.parts])):
                views[prefix + name] = view
        return views

    def hf_aliases(self, layer: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
        """The other names a checkpoint may hold the same values under: each expert's own tensors."""
        views = {}
        for t in self.tensors:
            if not t.experts:
                continue
            for j in range(t.experts):
                for (name, _), view in zip(t.parts, layer[t.key][j].split([n for _, n in t.parts])):
                    views[prefix + name.format(j=j)] = view
        return views


def dense_layer(cfg: PretrainedConfig, qkv_bias: bool = False, o_bias: bool = False,
                qk_norm: bool = False) -> LayerLayout:
    """A Llama-style layer at `cfg`'s sizes: pre-norm attention (GQA, rotary) and a SwiGLU MLP, with
    the optional parts the families add."""
    h, ff, d = cfg.hidden_size, cfg.intermediate_size, head_dim(cfg)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    q, kv = heads * d, kv_heads * d
    a = "self_attn."
    tensors = [
        LayerTensor("wqkv", h, ((a + "q_proj.weight", q), (a + "k_proj.weight", kv), (a + "v_proj.weight", kv))),
        LayerTensor("wo", q, ((a + "o_proj.weight", h),)),
        LayerTensor("w_gate_up", h, (("mlp.gate_proj.weight", ff), ("mlp.up_proj.weight", ff))),
        LayerTensor("w_down", ff, (("mlp.down_proj.weight", h),)),
        LayerTensor("attn_norm", None, (("input_layernorm.weight", h),)),
        LayerTensor("mlp_norm", None, (("post_attention_layernorm.weight", h),)),
    ]
    if qkv_bias:
        tensors.append(LayerTensor("bqkv", None,
                                   ((a + "q_proj.bias", q), (a + "k_proj.bias", kv), (a + "v_proj.bias", kv))))
    if o_bias:
        tensors.append(LayerTensor("bo", None, ((a + "o_proj.bias", h),)))
    if qk_norm:  # one weight per head dimension, shared by all heads
        tensors += [LayerTensor("q_norm", None, ((a + "q_norm.weight", d),)),
                    LayerTensor("k_norm", None, ((a + "k_norm.weight", d),))]
    return LayerLayout(heads, kv_heads, d, cfg.rms_norm_eps, tuple(tensors))


def _llama(cfg: PretrainedConfig) -> LayerLayout:
    bias = bool(getattr(cfg, "attention_bias", False))  # q, k, v and o alike
    return dense_layer(cfg, qkv_bias=bias, o_bias=bias)


def _qwen2(cfg: PretrainedConfig) -> LayerLayout:
    return dense_layer(cfg, qkv_bias=True)  # always: Qwen2's config has no switch for it; o_proj has none


def _qwen3(cfg: PretrainedConfig) -> LayerLayout:
    bias = bool(getattr(cfg, "attention_bias", False))
    return dense_layer(cfg, qkv_bias=bias, o_bias=bias, qk_norm=True)


def moe_layer(cfg: PretrainedConfig, qkv_bias: bool = False, o_bias: bool = False, qk_norm: bool = False) -> LayerLayout:
    """A sparse layer: the dense layer's attention and norms, and in place of its MLP a router
    (`mlp.gate.weight` [E, h]) over E SwiGLU experts of width `moe_intermediate_size`, held stacked.
    (Qwen2-MoE's shared expert would add its own SwiGLU and a sigmoid gate here, and model.moe_mlp
    would add their output.)"""
    dense = dense_layer(cfg, qkv_bias, o_bias, qk_norm)
    h, ff, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    e = "mlp.experts."
    tensors = [t for t in dense.tensors if t.key not in ("w_gate_up", "w_down")] + [
        LayerTensor("router", h, (("mlp.gate.weight", E),)),
        LayerTensor("experts_gate_up", h, ((e + "{j}.gate_proj.weight", ff), (e + "{j}.up_proj.weight", ff)),
                    experts=E, stacked=e + "gate_up_proj"),
        LayerTensor("experts_down", ff, ((e + "{j}.down_proj.weight", h),), experts=E, stacked=e + "down_proj"),
    ]
    routing = MoeRouting(E, cfg.num_experts_per_tok, bool(cfg.norm_topk_prob))
    return LayerLayout(dense.heads, dense.kv_heads, dense.head_dim, dense.eps, tuple(tensors), mlp="moe", moe=routing)


def _qwen3_moe(cfg: PretrainedConfig, i: int) -> LayerLayout:
    bias = bool(getattr(cfg, "attention_bias", False))
    if getattr(cfg, "use_sliding_window", False):
        raise ValueError(f"{cfg.model_type}: sliding-window attention layers are not supported")
    # as transformers' Qwen3MoeDecoderLayer: sparse unless listed in mlp_only_layers, every
    # decoder_sparse_step-th layer (1: all); a dense layer's MLP has the width intermediate_size
    sparse = (i not in (cfg.mlp_only_layers or ()) and cfg.num_experts > 0
              and (i + 1) % cfg.decoder_sparse_step == 0)
    return (moe_layer if sparse else dense_layer)(cfg, qkv_bias=bias, o_bias=bias, qk_norm=True)


def _dense(family: Callable[[PretrainedConfig], LayerLayout]) -> Callable[[PretrainedConfig, int], LayerLayout]:
    return lambda cfg, i: family(cfg)  # every layer alike


# model_type -> the layout of its decoder layer of a given index
FAMILIES: dict[str, Callable[[PretrainedConfig, int], LayerLayout]] = {
    "llama": _dense(_llama), "qwen2": _dense(_qwen2), "qwen3": _dense(_qwen3), "qwen3_moe": _qwen3_moe}


def layer_layouts(cfg: PretrainedConfig) -> list[LayerLayout]:
    """The layout of each decoder layer of a checkpoint of config `cfg`, in order."""
    return [layer_layout(cfg, i) for i in range(cfg.num_hidden_layers)]


def layer_layout(cfg: PretrainedConfig, layer: int = 0) -> LayerLayout:
    """Decoder layer `layer` of a checkpoint of config `cfg`; a clear error for what the engine cannot compute."""
    family = FAMILIES.get(cfg.model_type)
    if family is None:
        raise ValueError(f"the embedded engine serves the model families {sorted(FAMILIES)}, "
                         f"not {cfg.model_type!r}")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"{cfg.model_type}: hidden_act {cfg.hidden_act!r} is not supported (silu)")
    if getattr(cfg, "mlp_bias", False):
        raise ValueError(f"{cfg.model_type}: biased MLP projections (mlp_bias) are not supported")
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
        raise ValueError(f"{cfg.model_type}: sliding-window attention layers are not supported")
    return family(cfg, layer)
