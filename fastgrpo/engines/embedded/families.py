"""The model families the embedded engine serves, described as data.

What differs between Llama 3.x, Qwen2.5 and Qwen3 dense is which tensors a decoder layer holds, and
their sizes: Qwen2 adds biases to the q/k/v projections, Qwen3 an RMSNorm over each head of q and k
(before the rotation) and a head size of its own (`head_dim`, not hidden / heads). A `LayerLayout`
lists a layer's tensors as the engine keeps them (q/k/v fused into one matrix, gate/up into another:
fewer, larger matmuls) with the Hugging Face tensors each one holds, so loading, the weight push and
the forward all follow one table. The forward (model.decoder_layer) uses a tensor when the layer has
it: a bias, a q/k norm.

Adding a family is an entry in FAMILIES: a function from the config to its layer's layout. A mixture
of experts lists its router and expert tensors and names its MLP (`LayerLayout.mlp`, a key of
model.MLPS), which the forward calls in place of the dense SwiGLU one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor
from transformers import PretrainedConfig


@dataclass(frozen=True)
class LayerTensor:
    """One tensor of the engine's decoder layer: `parts` are the Hugging Face tensors (named under
    `model.layers.{i}.`) it holds as consecutive blocks of rows, in order; `cols` its second dimension
    (None: a vector)."""

    key: str
    cols: int | None
    parts: tuple[tuple[str, int], ...]

    @property
    def shape(self) -> tuple[int, ...]:
        rows = sum(n for _, n in self.parts)
        return (rows,) if self.cols is None else (rows, self.cols)


@dataclass(frozen=True)
class LayerLayout:
    """A decoder layer of one family at one size: its tensors, and the sizes its forward needs."""

    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    tensors: tuple[LayerTensor, ...]
    mlp: str = "swiglu"  # which MLP the forward runs (model.MLPS)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {t.key: t.shape for t in self.tensors}

    @property
    def matrices(self) -> tuple[str, ...]:
        """The tensors the forward multiplies by (what the oneDNN kernel keeps packed copies of)."""
        return tuple(t.key for t in self.tensors if t.cols is not None)

    def hf_views(self, layer: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
        """Hugging Face name (`prefix` + its name in the layer) -> the view of `layer`'s tensor holding it."""
        views = {}
        for t in self.tensors:
            for (name, _), view in zip(t.parts, layer[t.key].split([n for _, n in t.parts])):
                views[prefix + name] = view
        return views


def head_dim(cfg: PretrainedConfig) -> int:
    """The attention head size: the config's own (Qwen3's differs from hidden / heads), else hidden / heads."""
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


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


# model_type -> the layout of its decoder layers
FAMILIES: dict[str, Callable[[PretrainedConfig], LayerLayout]] = {"llama": _llama, "qwen2": _qwen2, "qwen3": _qwen3}


def layer_layout(cfg: PretrainedConfig) -> LayerLayout:
    """The decoder layer of a checkpoint of config `cfg`; a clear error for what the engine cannot compute."""
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
    return family(cfg)
