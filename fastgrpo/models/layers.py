"""The decoder layer's maths, shared by the embedded engine's forward and the draft head (which the
draft learners train and the engine runs): RMSNorm, the rotation, matmuls through oneDNN's packed
kernel where a weight has one, attention over a key/value function the caller supplies (a cache, or the
block itself), and the MLPs a family's layer runs (SwiGLU, or routed experts as grouped matmuls).

Each family's layer is data (`layouts.py`); the same function computes every family, and tests hold its
outputs to Hugging Face's forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from fastgrpo.models.layouts import LayerLayout
from fastgrpo.models.sampling import sampling_uniforms


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedWeight:
    """A frozen [out, in] weight in oneDNN's packed layout: a copy, rebuilt whenever the weight changes."""

    PACK_BATCH = 64  # oneDNN's layout hint: rows per matmul it should be tuned for

    def __init__(self, dense: Tensor):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(dense, self.PACK_BATCH)

    def __call__(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


def linear(x: Tensor, w: Tensor | PackedWeight, bias: Tensor | None = None) -> Tensor:
    """x @ w.T (+ bias), through the packed kernel when the weight has one."""
    if isinstance(w, PackedWeight):
        return w(x, bias)
    return x @ w.T if bias is None else F.linear(x, w, bias)  # biased: the kernel nn.Linear uses


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """Normalised in fp32 whatever x's dtype, then scaled in it, as Hugging Face's Llama does (bf16
    engine and bf16 trainer then round alike)."""
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm(x: Tensor, r: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The residual stream after adding r, and its norm."""
    x = x + r
    return x, rms_norm(x, w, eps)


def rotate_qk(qk: Tensor, cos: Tensor, sin: Tensor, heads: int, q_norm: Tensor | None, k_norm: Tensor | None,
              eps: float) -> Tensor:
    """q's and k's heads side by side [B, n, H + KV, D] (q's first `heads`), each head normed first where the
    family norms them (Qwen3), then rotated by cos, sin [B, n, 1, D]."""
    if q_norm is not None and k_norm is not None:
        qk = torch.cat([rms_norm(qk[:, :, :heads], q_norm, eps), rms_norm(qk[:, :, heads:], k_norm, eps)], 2)
    half = qk.shape[-1] // 2
    rotated = torch.cat([-qk[..., half:], qk[..., :half]], dim=-1)
    return qk * cos + rotated * sin


def silu_mul(gate_up: Tensor) -> Tensor:
    """SwiGLU's gate: silu(gate) * up, of the gate and up projections side by side."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class Pointwise:
    """A static step's pointwise regions: the decoder layer's, between its matmuls and attention, the ops
    that read and write a few rows each; and the sampling noise's integer hash. `EAGER` runs them op by
    op; `fused.fused_pointwise()` runs each as one compiled kernel, for graph-captured steps, where each
    kernel's fixed cost counts."""

    norm: Callable[[Tensor, Tensor, float], Tensor]
    add_norm: Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
    rotate_qk: Callable[..., Tensor]
    silu_mul: Callable[[Tensor], Tensor]
    uniforms: Callable[[Tensor, Tensor, Tensor], Tensor]  # sampling.sampling_uniforms, the seed a tensor


EAGER = Pointwise(rms_norm, add_rms_norm, rotate_qk, silu_mul, sampling_uniforms)


KVFn = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


def decoder_layer(x: Tensor, L: dict[str, Tensor | PackedWeight], layout: LayerLayout, cos: Tensor, sin: Tensor,
                  mask: Tensor | None, kv: KVFn, valid: Tensor | None = None, static: bool = False,
                  routing: list[Tensor] | None = None, ops: Pointwise = EAGER) -> Tensor:
    """One decoder layer of `layout`'s family. `kv(k, v)` turns this block's keys/values [B, KV, n, D] into
    the keys/values to attend over: the cache after appending them (inference), or themselves (training).
    cos, sin [B, n, 1, D]: the rotation at each token's position.

    The layer's optional tensors are used where the family has them: q/k/v and o biases (`bqkv`, `bo`),
    an RMSNorm over each head of q and k before the rotation (`q_norm`, `k_norm`).

    Ragged blocks: with `valid` [B, n] bool, x holds only the valid tokens, packed [T, hidden]. The
    matmuls (nearly all the work) run on those T tokens; attention runs on the [B, n] layout with
    zeros in the gaps (their keys must be masked out; what their queries compute is dropped).

    `static`: no shape may depend on the values (a graph-captured step): routed experts run as
    `dense_experts`. `routing`: a sparse layer appends its tokens' experts to it (`moe_mlp`). `ops`: how
    the pointwise regions run (`Pointwise`)."""
    H, KV, D, eps = layout.heads, layout.kv_heads, layout.head_dim, layout.eps
    h = ops.norm(x, L["attn_norm"], eps)
    qkv = linear(h, L["wqkv"], L.get("bqkv"))
    if valid is not None:
        qkv = unpack(qkv, valid)
    B, n, _ = qkv.shape
    # q's and k's heads side by side [B, n, H + KV, D], rotated in one pass (the same arithmetic per
    # element, half the kernels of rotating each)
    qk = qkv[..., : (H + KV) * D].view(B, n, H + KV, D)
    v = qkv[..., (H + KV) * D :].view(B, n, KV, D).transpose(1, 2)
    qk = ops.rotate_qk(qk, cos, sin, H, L.get("q_norm"), L.get("k_norm"), eps)
    keys, values = kv(qk[:, :, H:].transpose(1, 2), v)
    attn = attention(qk[:, :, :H], keys, values, mask)
    x, h = ops.add_norm(x, linear(attn if valid is None else attn[valid], L["wo"], L.get("bo")), L["mlp_norm"], eps)
    if layout.mlp == "moe":
        return x + moe_mlp(h, L, layout, experts=dense_experts if static else None, routing=routing)
    return x + swiglu_mlp(h, L, layout, ops)


def group_mask(mask: Tensor, groups: int) -> Tensor:
    """A block's mask [B, 1, n, ctx] as `attention` applies it with `groups` query heads a key head:
    [B, 1, groups n, ctx], the mask repeated for each (views alone at n = 1). A forward that attends with one
    mask in every layer groups it once."""
    B, _, n, ctx = mask.shape
    if groups == 1:
        return mask
    return mask[:, :, None].expand(B, 1, groups, n, ctx).reshape(B, 1, groups * n, ctx)


def attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
    """q [B, n, H, D] over keys and values [B, KV, ctx, D] -> [B, n, H * D]; query head h reads key head
    h // (H / KV), as Hugging Face's repeat_kv pairs them. mask [B, 1, n, ctx] bool, or the same already
    grouped (`group_mask`, [B, 1, H / KV n, ctx]), or None: causal over the block itself (training).

    With a mask and fewer key heads than query heads, the G = H / KV query heads that share a key head
    attend as one sequence of G n queries to that head, under the mask repeated for each: attention with
    equal head counts, which every SDPA backend takes. SDPA's own grouped-query attention (enable_gqa) is
    taken by its flash kernel, which takes no mask; masked, it falls to the math backend, which first
    copies the keys and values once per query head (repeat_interleave; torch 2.11's memory-efficient
    kernel takes no GQA). A plain step (n = 1) packs by views alone."""
    B, n, H, D = q.shape
    G = H // keys.shape[1]
    if mask is None or G == 1:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, is_causal=mask is None,
                                             enable_gqa=G > 1)
        return out.transpose(1, 2).reshape(B, n, H * D)
    KV = H // G
    grouped = q.view(B, n, KV, G, D).permute(0, 2, 3, 1, 4).reshape(B, KV, G * n, D)
    if mask.shape[-2] == n:
        mask = group_mask(mask, G)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask)  # [B, KV, G n, D]
    return out.view(B, KV, G, n, D).permute(0, 3, 1, 2, 4).reshape(B, n, H * D)


def swiglu_mlp(h: Tensor, L: dict[str, Tensor | PackedWeight], layout: LayerLayout | None = None,
               ops: Pointwise = EAGER) -> Tensor:
    return linear(ops.silu_mul(linear(h, L["w_gate_up"])), L["w_down"])


def moe_mlp(h: Tensor, L: dict[str, Tensor | PackedWeight], layout: LayerLayout,
            experts: Callable[..., Tensor] | None = None, routing: list[Tensor] | None = None) -> Tensor:
    """A sparse MLP as transformers' Qwen3MoeSparseMoeBlock: the router's logits, softmax in fp32, the
    top-k experts of each token (their weights renormalised when norm_topk_prob), each expert's
    SwiGLU on the tokens routed to it, summed with those weights (by `experts`: `routed_experts`
    unless given). `routing`: the tokens' experts [tokens, k] (int16) are appended to it (the record
    routing replay imposes on the trainer, models/routing.py)."""
    r = layout.moe
    x = h.reshape(-1, h.shape[-1])
    probs = torch.softmax(linear(x, L["router"]).float(), dim=-1)
    weight, expert = probs.topk(r.top_k, dim=-1)  # [T, k], largest first
    if r.norm_topk_prob:
        weight = weight / weight.sum(dim=-1, keepdim=True)
    if routing is not None:
        routing.append(expert.to(torch.int16))
    out = (experts or routed_experts)(x, expert, weight.to(x.dtype), L["experts_gate_up"], L["experts_down"])
    return out.view(h.shape)


def dense_experts(x: Tensor, expert: Tensor, weight: Tensor, w_gate_up: Tensor, w_down: Tensor) -> Tensor:
    """`routed_experts`' function with shapes that never depend on the routing: every expert runs on
    every token and a token's unrouted experts weigh 0 (an exact 0: adding it changes no sum). It reads
    every expert once, as a decode step of a few tokens does anyway, and computes E/k times the routed
    FLOPs: the price of a step that can be captured as a graph."""
    E = w_gate_up.shape[0]
    gates = x.new_zeros(x.shape[0], E).scatter(1, expert, weight)  # [T, E]
    gate, up = torch.einsum("th,efh->etf", x, w_gate_up).chunk(2, dim=-1)
    y = torch.bmm(F.silu(gate) * up, w_down.transpose(1, 2))  # [E, T, h]
    return (y * gates.T[:, :, None]).sum(0)


def routed_experts(x: Tensor, expert: Tensor, weight: Tensor, w_gate_up: Tensor, w_down: Tensor) -> Tensor:
    """sum over j of weight[t, j] * SwiGLU_{expert[t, j]}(x[t]), for x [T, h], expert and weight [T, k],
    w_gate_up [E, 2 ff, h], w_down [E, h, ff].

    The T*k (token, expert) assignments are sorted by expert, so each expert's tokens are one
    contiguous block of rows; each of the two matmuls is then one grouped matmul over those blocks
    (torch._grouped_mm: one matmul per expert that has tokens, none for the others), and each token's
    k results are summed back into its row (index_add_, in the experts' order, as transformers does)."""
    T, k = expert.shape
    flat = expert.reshape(-1)
    order = flat.argsort(stable=True)  # assignment indices grouped by expert
    token = order // k  # the token of each sorted assignment
    ends = torch.bincount(flat, minlength=w_gate_up.shape[0]).cumsum(0).to(torch.int32)  # each block's end row
    gate, up = grouped_mm(x[token], w_gate_up.transpose(1, 2), ends).chunk(2, dim=-1)
    y = grouped_mm(F.silu(gate) * up, w_down.transpose(1, 2), ends) * weight.reshape(-1)[order, None]
    return x.new_zeros(T, x.shape[-1]).index_add_(0, token, y)


def grouped_mm(x: Tensor, w: Tensor, ends: Tensor) -> Tensor:
    """Rows [ends[e-1], ends[e]) of x [N, a] times w[e] [a, b], for each e: [N, b]. On a CPU through
    torch._grouped_mm (as fast as a matmul per expert there, in one call); elsewhere a matmul per expert
    (one host round trip for the block ends): CUDA's grouped kernel has dtype, alignment and
    architecture conditions of its own, not yet checked here on a GPU."""
    if x.device.type == "cpu" and hasattr(torch, "_grouped_mm") and x.dtype == w.dtype:
        return torch._grouped_mm(x, w, offs=ends)
    out = x.new_empty(x.shape[0], w.shape[-1])  # without it: a matmul per expert that has rows
    start = 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ w[e]
        start = end
    return out


def unpack(packed: Tensor, valid: Tensor) -> Tensor:
    """[T, W] rows of the valid positions -> [B, n, W], zeros elsewhere."""
    out = packed.new_zeros(*valid.shape, packed.shape[-1])
    out[valid] = packed
    return out
