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

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import PretrainedConfig

from fastgrpo.engines.embedded.constants import arange
from fastgrpo.models.layers import (EAGER, KVFn, PackedWeight, Pointwise, decoder_layer, group_mask, linear,
                                    onednn_available, unpack)
from fastgrpo.models.layouts import layer_layouts
from fastgrpo.models.rope import head_dim as head_dim_of, rope_tables


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


def block_mask(start: Tensor, n: int, ctx: int, new_mask: Tensor | None, visible_from: Tensor | None = None,
               static: bool = False) -> Tensor:
    """[B, 1, n, ctx] bool for n query tokens whose block of keys begins at `start` [B].

    Cached keys (< start; from `visible_from` [B] on, if given) are visible to all queries. Within
    the block, `new_mask` [B, n, E] decides (E block keys: the queries themselves, or a draft tree's
    earlier levels plus the queries); None means causal over the n queries. `static`: n and ctx are a
    static step's (its index ranges are kept constants).
    """
    kpos = arange(ctx, start.device, keep=static)
    if new_mask is None:
        mask = kpos[None, None, :] <= (start[:, None] + arange(n, start.device, keep=static))[:, :, None]
    else:
        B, E = start.shape[0], new_mask.shape[-1]
        rel = kpos[None, None, :] - start[:, None, None]  # key position relative to the block
        in_block = (rel >= 0) & (rel < E)
        seen = torch.gather(new_mask.expand(B, n, E), 2, rel.clamp(0, E - 1).expand(B, n, ctx))
        mask = (rel < 0) | (in_block & seen)
    if visible_from is not None:
        mask = mask & (kpos[None, None, :] >= visible_from[:, None, None])
    return mask[:, None]


def cache_kv(cache: KVCache, layer: int, rows: slice, slots: Tensor, ctx: int, row_idx: Tensor | None = None) -> KVFn:
    """Append a block's keys/values at `slots` [B, n] of `rows`, attend over the first `ctx` positions.
    `row_idx`: the rows' indices [B, 1], when the caller made them once for all its layers."""
    if row_idx is None:
        row_idx = arange(rows.stop - rows.start, cache.k.device, rows.start)[:, None]
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
        # how a static forward (one given `ctx`) runs the layers' pointwise regions: op by op, or fused
        # (`fused.fused_pointwise`, for graph-captured steps)
        self.static_ops: Pointwise = EAGER

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

    @property
    def sparse_layers(self) -> int:
        """How many layers route to experts (0: a dense model)."""
        return sum(layout.mlp == "moe" for layout in self.layouts)

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
        ctx: int | None = None,
        routing: list[Tensor] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Run `tokens` [B, n] for cache rows `rows`, appending their keys/values after each row's length.

        positions [B, n]: RoPE positions (default: consecutive after the cached length; a tree gives
        each node its depth). new_mask [B, n, n] bool: which new tokens each new token sees (default
        causal; a tree gives ancestors). The cache lengths are NOT advanced: the caller decides how
        many of the new tokens to keep (all for plain decoding, the accepted path for speculation).
        valid [B, n] bool: run only these tokens through the matmuls (a ragged block: each row verifies
        its own number of tree nodes); the others must be masked out as keys by new_mask, write
        keys/values the caller never keeps, and come back as zeros.
        ctx: how many cache positions attention reads, at least every row's length + n (default: the
        longest row's, read from the device: a host sync). A static step passes its context bucket, so
        that its shapes never depend on the cache's contents (positions past a row's block are masked, and a
        mixture of experts runs every expert: `layers.dense_experts`), and its pointwise regions run as
        `static_ops` says.
        routing: a mixture of experts' sparse layers each append their tokens' experts [B, n, k] (int16;
        -1 at tokens `valid` leaves out), in layer order.
        Returns logits [B, n, V] and final hidden states [B, n, H] (post-norm: the draft's input).
        """
        B, n = tokens.shape
        start = cache.lengths[rows]
        static = ctx is not None
        slots = start[:, None] + arange(n, start.device, keep=static)  # where the new keys/values are written
        if ctx is None:
            ctx = int(slots.max()) + 1
        if ctx > cache.max_len:
            raise ValueError(f"sequence would exceed the cache length {cache.max_len}")
        # the mask, once for every layer
        mask = group_mask(block_mask(start, n, ctx, new_mask, static=static), self.n_heads // self.n_kv)
        pos = slots if positions is None else positions
        cos, sin = self.cos[pos][:, :, None], self.sin[pos][:, :, None]  # [B, n, 1, D]
        x = F.embedding(tokens if valid is None else tokens[valid], self.embed)
        routed: list[Tensor] | None = [] if routing is not None else None
        ops = self.static_ops if static else EAGER
        row_idx = arange(B, start.device, rows.start)[:, None]
        for li, L in enumerate(self.matmul_layers):
            kv = cache_kv(cache, li, rows, slots, ctx, row_idx)
            x = decoder_layer(x, L, self.layouts[li], cos, sin, mask, kv, valid, static=static, routing=routed, ops=ops)
        if routing is not None:
            routing.extend(e.view(B, n, -1) if valid is None else unpack(e + 1, valid) - 1 for e in routed)
        hidden = ops.norm(x, self.norm, self.eps)
        logits = linear(hidden, self.head)
        return (logits, hidden) if valid is None else (unpack(logits, valid), unpack(hidden, valid))
