"""Inference forward of a Llama-architecture policy (the families of families.py: Llama 3.x, Qwen2.5,
Qwen3 dense, Qwen3-MoE) over a static, slot-based KV cache.

Why not `transformers` here: its dynamic cache re-copies on every step and cannot take per-sequence
lengths or tree-shaped attention, which speculative verification needs. This module reads the same
Hugging Face weights (by their HF names) and computes the same function; a test holds its logits
to a full HF forward.

Matmuls: on x86 CPUs the frozen inference weights are kept a second time in oneDNN's blocked layout.
MKL's GEMM for a handful of rows (2-16 tokens: a verification tree, a small batch) streams the
weights at under half the speed of its one-row GEMV; oneDNN's packed kernel keeps 2-8 tokens about as
cheap as one, which is what makes verifying a draft tree pay on a CPU (numbers in BENCHMARKS.md).

Cache layout: rows are sequences, kept contiguous (rows 0..B-1 are the running batch), so a decode
step attends over plain views of the cache with no gather. Each row has its own length.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from fastgrpo.engines.embedded.families import LayerLayout, head_dim as head_dim_of, layer_layouts


class KVCache:
    def __init__(self, cfg: PretrainedConfig, rows: int, max_len: int, dtype: torch.dtype = torch.float32,
                 layers: int | None = None):
        shape = (layers or cfg.num_hidden_layers, rows, max_len, cfg.num_key_value_heads, head_dim_of(cfg))
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.lengths = torch.zeros(rows, dtype=torch.long)  # tokens cached per row
        # first position each row attends to: a row may keep only a recent window of its positions
        # (the draft, after skipping states it no longer needs); earlier slots are never read
        self.visible_from = torch.zeros(rows, dtype=torch.long)
        self.max_len = max_len

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    def move_row(self, src: int, dst: int) -> None:
        """Copy one sequence's cached tokens to another row (compaction when a sequence leaves)."""
        n = int(self.lengths[src])
        self.k[:, dst, :n] = self.k[:, src, :n]
        self.v[:, dst, :n] = self.v[:, src, :n]
        self.lengths[dst] = n
        self.visible_from[dst] = self.visible_from[src]


# rope types whose tables depend on the config alone (dynamic and longrope change with the sequence length)
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_tables(cfg: PretrainedConfig, max_len: int, device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
    """cos, sin [max_len, head_dim] in fp32 on `device` (None: the default device, or the enclosing
    device context's). A scaled rope (Llama 3.1's `llama3`, ...) takes its inverse frequencies and
    attention factor from transformers' own functions, as its rotary embedding does."""
    d = head_dim_of(cfg)
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"{cfg.model_type}: a partial rotary embedding (partial_rotary_factor) is not supported")
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(f"{cfg.model_type}: rope type {rope_type!r} is not supported ({', '.join(STATIC_ROPE_TYPES)})")
    scale = 1.0
    if rope_type == "default":
        theta = getattr(cfg, "rope_theta", None) or params.get("rope_theta", 10000.0)
        inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    else:
        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](cfg, device)
        inv_freq = inv_freq.to(device=device, dtype=torch.float32)
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32, device=device), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    if scale == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * scale, emb.sin() * scale  # yarn's attention factor, applied to cos and sin as HF does


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


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


def block_mask(start: Tensor, n: int, ctx: int, new_mask: Tensor | None, visible_from: Tensor | None = None) -> Tensor:
    """[B, 1, n, ctx] bool for n query tokens whose block of keys begins at `start` [B].

    Cached keys (< start; from `visible_from` [B] on, if given) are visible to all queries. Within
    the block, `new_mask` [B, n, E] decides (E block keys: the queries themselves, or a draft tree's
    earlier levels plus the queries); None means causal over the n queries.
    """
    kpos = torch.arange(ctx, device=start.device)
    if new_mask is None:
        mask = kpos[None, None, :] <= (start[:, None] + torch.arange(n, device=start.device))[:, :, None]
    else:
        B, E = start.shape[0], new_mask.shape[-1]
        rel = kpos[None, None, :] - start[:, None, None]  # key position relative to the block
        in_block = (rel >= 0) & (rel < E)
        seen = torch.gather(new_mask.expand(B, n, E), 2, rel.clamp(0, E - 1).expand(B, n, ctx))
        mask = (rel < 0) | (in_block & seen)
    if visible_from is not None:
        mask = mask & (kpos[None, None, :] >= visible_from[:, None, None])
    return mask[:, None]


KVFn = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


def decoder_layer(x: Tensor, L: dict[str, Tensor | PackedWeight], layout: LayerLayout, cos: Tensor, sin: Tensor,
                  mask: Tensor | None, kv: KVFn, valid: Tensor | None = None) -> Tensor:
    """One decoder layer of `layout`'s family. `kv(k, v)` turns this block's keys/values [B, KV, n, D] into
    the keys/values to attend over: the cache after appending them (inference), or themselves (training).

    The layer's optional tensors are used where the family has them: q/k/v and o biases (`bqkv`, `bo`),
    an RMSNorm over each head of q and k before the rotation (`q_norm`, `k_norm`).

    Ragged blocks: with `valid` [B, n] bool, x holds only the valid tokens, packed [T, hidden]. The
    matmuls (nearly all the work) run on those T tokens; attention runs on the [B, n] layout with
    zeros in the gaps (their keys must be masked out; what their queries compute is dropped)."""
    H, KV, D, eps = layout.heads, layout.kv_heads, layout.head_dim, layout.eps
    h = rms_norm(x, L["attn_norm"], eps)
    qkv = linear(h, L["wqkv"], L.get("bqkv"))
    if valid is not None:
        qkv = unpack(qkv, valid)
    B, n, _ = qkv.shape
    q = qkv[..., : H * D].view(B, n, H, D)
    k = qkv[..., H * D : (H + KV) * D].view(B, n, KV, D)
    v = qkv[..., (H + KV) * D :].view(B, n, KV, D).transpose(1, 2)
    if "q_norm" in L:
        q, k = rms_norm(q, L["q_norm"], eps), rms_norm(k, L["k_norm"], eps)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    keys, values = kv(_rotate(k, cos, sin), v)
    q = _rotate(q, cos, sin)
    attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None,
                                          enable_gqa=KV != H)
    attn = attn.transpose(1, 2).reshape(B, n, H * D)
    x = x + linear(attn if valid is None else attn[valid], L["wo"], L.get("bo"))
    h = rms_norm(x, L["mlp_norm"], eps)
    return x + MLPS[layout.mlp](h, L, layout)


def swiglu_mlp(h: Tensor, L: dict[str, Tensor | PackedWeight], layout: LayerLayout | None = None) -> Tensor:
    gate, up = linear(h, L["w_gate_up"]).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, L["w_down"])


def moe_mlp(h: Tensor, L: dict[str, Tensor | PackedWeight], layout: LayerLayout) -> Tensor:
    """A sparse MLP as transformers' Qwen3MoeSparseMoeBlock: the router's logits, softmax in fp32, the
    top-k experts of each token (their weights renormalised when norm_topk_prob), each expert's
    SwiGLU on the tokens routed to it, summed with those weights."""
    r = layout.moe
    x = h.reshape(-1, h.shape[-1])
    probs = torch.softmax(linear(x, L["router"]).float(), dim=-1)
    weight, expert = probs.topk(r.top_k, dim=-1)  # [T, k], largest first
    if r.norm_topk_prob:
        weight = weight / weight.sum(dim=-1, keepdim=True)
    out = routed_experts(x, expert, weight.to(x.dtype), L["experts_gate_up"], L["experts_down"])
    return out.view(h.shape)


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


# the MLP a family's layer runs (LayerLayout.mlp): (normed hidden states, the layer's tensors, its layout)
MLPS: dict[str, Callable[[Tensor, dict[str, Tensor | PackedWeight], LayerLayout], Tensor]] = {
    "swiglu": swiglu_mlp, "moe": moe_mlp}


def unpack(packed: Tensor, valid: Tensor) -> Tensor:
    """[T, W] rows of the valid positions -> [B, n, W], zeros elsewhere."""
    out = packed.new_zeros(*valid.shape, packed.shape[-1])
    out[valid] = packed
    return out


def cache_kv(cache: KVCache, layer: int, rows: slice, slots: Tensor, ctx: int) -> KVFn:
    """Append a block's keys/values at `slots` [B, n] of `rows`, attend over the first `ctx` positions."""
    row_idx = torch.arange(rows.start, rows.stop, device=cache.k.device)[:, None]
    ck, cv = cache.k[layer], cache.v[layer]

    def kv(k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        ck[row_idx, slots] = k.transpose(1, 2)
        cv[row_idx, slots] = v.transpose(1, 2)
        return ck[rows, :ctx].transpose(1, 2), cv[rows, :ctx].transpose(1, 2)

    return kv


MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")  # the matrices every dense family's layer has


class InferenceModel:
    """Weights in fused layouts (qkv, gate+up) for fewer, larger matmuls; HF names map to views.

    kernel "onednn" (default where available) runs the matmuls on packed copies of the weights,
    "dense" on the weights as loaded; both compute the same function."""

    def __init__(self, cfg: PretrainedConfig, max_len: int, dtype: torch.dtype = torch.float32, kernel: str = "auto"):
        if kernel not in ("auto", "onednn", "dense"):
            raise ValueError(f"kernel must be auto, onednn or dense, not {kernel!r}")
        if kernel == "onednn" and not onednn_available():
            raise ValueError("kernel 'onednn' is not available in this torch build")
        self.kernel = ("onednn" if onednn_available() and dtype == torch.float32 else "dense") if kernel == "auto" else kernel
        self.cfg = cfg
        self.layouts = layer_layouts(cfg)  # the family's decoder layers: their tensors and HF names
        self.layout = self.layouts[0]  # attention's sizes, which every layer shares
        self.n_heads, self.n_kv, self.head_dim = self.layout.heads, self.layout.kv_heads, self.layout.head_dim
        self.eps = cfg.rms_norm_eps
        h = cfg.hidden_size
        z = lambda *s: torch.zeros(*s, dtype=dtype)  # noqa: E731
        self.embed = z(cfg.vocab_size, h)
        self.norm = z(h)
        self.lm_head = self.embed if cfg.tie_word_embeddings else z(cfg.vocab_size, h)
        self.layers = [{k: z(*shape) for k, shape in layout.shapes().items()} for layout in self.layouts]
        self.views: dict[str, Tensor] = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.norm}
        if not cfg.tie_word_embeddings:
            self.views["lm_head.weight"] = self.lm_head
        self.aliases: dict[str, Tensor] = {}  # names load() also takes: a checkpoint's per-expert tensors
        for i, (L, layout) in enumerate(zip(self.layers, self.layouts)):
            self.views |= layout.hf_views(L, f"model.layers.{i}.")
            self.aliases |= layout.hf_aliases(L, f"model.layers.{i}.")
        self.cos, self.sin = (t.to(dtype) for t in rope_tables(cfg, max_len))  # computed in fp32, as HF's
        # what forward() multiplies by: the weights themselves, or their packed copies
        self.matmul_layers: list[dict[str, Tensor | PackedWeight]] = list(self.layers)
        self.head: Tensor | PackedWeight = self.lm_head
        self._repack(range(len(self.layers)), head=True)

    def _repack(self, layers: Iterable[int], head: bool) -> None:
        if self.kernel != "onednn":
            return
        for i in layers:
            self.matmul_layers[i] = {k: PackedWeight(w) if k in self.layouts[i].matrices else w
                                     for k, w in self.layers[i].items()}
        if head:
            self.head = PackedWeight(self.lm_head)

    def load(self, named_tensors: Iterable[tuple[str, Tensor]]) -> int:
        """Copy HF-named tensors into place; unknown names and shape mismatches are errors. Experts may
        come stacked (transformers 5's state dict) or one tensor per expert (a checkpoint on disk).
        Returns how many tensors were written."""
        n, layers, head = 0, set(), False
        for name, t in named_tensors:
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue  # tied: the embedding is the head
            dst = self.views.get(name, self.aliases.get(name))
            if dst is None:
                raise KeyError(f"weight {name!r} is not part of this {self.cfg.model_type} model")
            if dst.shape != t.shape:
                raise ValueError(f"weight {name!r}: shape {tuple(t.shape)} does not match {tuple(dst.shape)}")
            dst.copy_(t)
            n += 1
            if name.startswith("model.layers."):
                layers.add(int(name.split(".")[2]))
            head |= name in ("model.embed_tokens.weight", "lm_head.weight")
        self._repack(layers, head)  # a bucket of a weight push repacks only what it wrote
        return n

    def named_weights(self) -> Iterable[tuple[str, Tensor]]:
        """Every tensor once, under the installed transformers' names (experts stacked)."""
        return self.views.items()

    @torch.inference_mode()
    def forward(
        self,
        tokens: Tensor,
        cache: KVCache,
        rows: slice,
        positions: Tensor | None = None,
        new_mask: Tensor | None = None,
        valid: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Run `tokens` [B, n] for cache rows `rows`, appending their keys/values after each row's length.

        positions [B, n]: RoPE positions (default: consecutive after the cached length; a tree gives
        each node its depth). new_mask [B, n, n] bool: which new tokens each new token sees (default
        causal; a tree gives ancestors). The cache lengths are NOT advanced: the caller decides how
        many of the new tokens to keep (all for plain decoding, the accepted path for speculation).
        valid [B, n] bool: run only these tokens through the matmuls (a ragged block: each row verifies
        its own number of tree nodes); the others must be masked out as keys by new_mask, write
        keys/values the caller never keeps, and come back as zeros.
        Returns logits [B, n, V] and final hidden states [B, n, H] (post-norm: the draft's input).
        """
        B, n = tokens.shape
        start = cache.lengths[rows]
        slots = start[:, None] + torch.arange(n, device=start.device)  # where the new keys/values are written
        ctx = int(slots.max()) + 1
        if ctx > cache.max_len:
            raise ValueError(f"sequence would exceed the cache length {cache.max_len}")
        mask = block_mask(start, n, ctx, new_mask)
        pos = slots if positions is None else positions
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # [B, 1, n, D]
        x = F.embedding(tokens if valid is None else tokens[valid], self.embed)
        for li, L in enumerate(self.matmul_layers):
            x = decoder_layer(x, L, self.layouts[li], cos, sin, mask, cache_kv(cache, li, rows, slots, ctx), valid)
        hidden = rms_norm(x, self.norm, self.eps)
        logits = linear(hidden, self.head)
        return (logits, hidden) if valid is None else (unpack(logits, valid), unpack(hidden, valid))
