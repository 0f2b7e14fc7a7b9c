"""A checkpoint's rotary embedding as Hugging Face computes it: the inverse frequencies and the factor
its cos/sin are scaled by, from the config alone.

What a trainer that does not run Hugging Face's modules (Megatron) needs to rotate exactly as the
checkpoint was trained and as the engine samples: Llama 3.1's `llama3` scaling (its
original_max_position_embeddings, low/high frequency factors) and the rest come from transformers' own
`ROPE_INIT_FUNCTIONS` (modeling_rope_utils.py), the default rope from the same formula as its
modelling files (`compute_default_rope_parameters`, e.g. modeling_llama.py). Only rope types whose
tables depend on the config alone are served (dynamic and longrope change with the sequence length).
"""

from __future__ import annotations

import torch
from torch import Tensor

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedRope(ValueError):
    """A rotary embedding fastgrpo does not compute (dynamic scaling, partial rotary, ...)."""


def head_dim(config) -> int:
    """The attention head size: the config's own (Qwen3's differs from hidden / heads), else hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_parameters(config) -> dict:
    """The config's rope settings (transformers 5's `rope_parameters`, or an older `rope_scaling`
    with `rope_theta` beside it), with its rope_type."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.get("type", "default"))
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    return params


def hf_inv_freq(config) -> tuple[Tensor, float]:
    """(inverse frequencies [head_dim / 2] in fp32 on the CPU, the factor cos and sin are scaled by)
    as the checkpoint's Hugging Face rotary embedding computes them."""
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if partial not in (None, 1.0):
        raise UnsupportedRope(f"{config.model_type}: a partial rotary embedding (partial_rotary_factor {partial}) "
                              f"is not supported")
    if rope_type not in STATIC_ROPE_TYPES:
        raise UnsupportedRope(f"{config.model_type}: rope type {rope_type!r} is not supported "
                              f"({', '.join(STATIC_ROPE_TYPES)})")
    with torch.device("cpu"):  # whatever device context the caller is in (an engine's, `plan`'s meta)
        if rope_type == "default":
            d = head_dim(config)
            return 1.0 / (float(params["rope_theta"]) ** (torch.arange(0, d, 2, dtype=torch.float) / d)), 1.0
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.to(dtype=torch.float32), float(scale)


def rope_tables(config, max_len: int, device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
    """cos, sin [max_len, head_dim] in fp32 on `device` (None: the default device, or the enclosing
    device context's), from `hf_inv_freq`: what the engine and the draft head rotate by. A scaled rope's
    attention factor (yarn's) multiplies cos and sin, as Hugging Face applies it."""
    inv_freq, scale = hf_inv_freq(config)
    device = torch.empty(0, device=device).device  # the given device, else the enclosing context's
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32, device=device), inv_freq.to(device))
    emb = torch.cat([freqs, freqs], dim=-1)
    if scale == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * scale, emb.sin() * scale
