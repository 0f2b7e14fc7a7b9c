"""Hugging Face <-> Megatron-core parameter layout for Llama-family policies (Llama, Qwen2): names,
the grouped QKV, the per-shard gate/up of SwiGLU, vocabulary padding, and which slice of each tensor
a tensor- and pipeline-parallel rank holds.

One mapping, used by the Megatron trainer (loading the SFT policy, exporting weights to the bridge)
and by the conversion tools. Names are those of megatron-core's local layer spec
(`get_gpt_layer_local_spec`); its distributed checkpoints map them to the Transformer Engine spec's
fused-norm names, so checkpoints are interchangeable between the two specs.

A "full" Megatron tensor is the concatenation of its TP shards in rank order, so every shard is a
plain `chunk` of it: for QKV because Megatron orders rows by query group ([the group's q heads, k,
v] per group, and groups split evenly over TP), for fc1 because we define the full tensor as the
shards' [gate_i; up_i] blocks one after another.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

COLUMN_PARALLEL = ("embedding.word_embeddings.weight", "output_layer.weight", "self_attention.linear_qkv.weight",
                   "self_attention.linear_qkv.bias", "mlp.linear_fc1.weight")
ROW_PARALLEL = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class LayoutError(ValueError):
    """A model that cannot be laid out at the requested TP x PP, or a checkpoint of another model."""


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    padded_vocab: int  # a multiple of make_vocab_size_divisible_by * tp; the extra rows are zero and never sampled
    tied: bool  # the LM head is the embedding
    qkv_bias: bool  # Qwen2

    @classmethod
    def of(cls, hf_config, tp: int = 1, pp: int = 1, vocab_divisible_by: int = 128) -> Layout:
        c = hf_config
        if c.model_type not in ("llama", "qwen2"):
            raise LayoutError(f"model_type {c.model_type!r} is not supported (llama, qwen2)")
        heads, kv = c.num_attention_heads, c.num_key_value_heads or c.num_attention_heads
        if tp < 1 or pp < 1:
            raise LayoutError(f"parallel sizes must be >= 1, got tensor {tp}, pipeline {pp}")
        if heads % tp:
            raise LayoutError(f"parallel.tensor={tp} does not divide the {heads} attention heads")
        if kv % tp:
            raise LayoutError(f"parallel.tensor={tp} does not divide the {kv} key/value heads (query groups): "
                              f"grouped-query attention needs the KV heads split evenly over TP ranks")
        if c.num_hidden_layers % pp:
            raise LayoutError(f"parallel.pipeline={pp} does not divide the {c.num_hidden_layers} layers")
        if c.intermediate_size % tp:
            raise LayoutError(f"parallel.tensor={tp} does not divide the MLP width {c.intermediate_size}")
        multiple = vocab_divisible_by * tp
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        return cls(tp, pp, c.num_hidden_layers, c.hidden_size, heads, kv, head_dim, c.intermediate_size,
                   c.vocab_size, math.ceil(c.vocab_size / multiple) * multiple, bool(c.tie_word_embeddings),
                   c.model_type == "qwen2" or bool(getattr(c, "attention_bias", False)))

    def stage_layers(self, pp_rank: int) -> range:
        """The global indices of the layers pipeline stage `pp_rank` holds."""
        per = self.layers // self.pp
        return range(pp_rank * per, (pp_rank + 1) * per)

    # -- Hugging Face <-> full Megatron tensors ------------------------------------------------
    def to_megatron(self, hf: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Full Megatron tensors under global names, from a Hugging Face state dict."""
        d, ng = self.head_dim, self.kv_heads
        hpg = self.heads // ng
        out = {"embedding.word_embeddings.weight": self._pad(hf["model.embed_tokens.weight"]),
               "decoder.final_layernorm.weight": hf["model.norm.weight"]}
        if not self.tied:
            out["output_layer.weight"] = self._pad(hf["lm_head.weight"])
        for i in range(self.layers):
            p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
            out[m + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
            out[m + "pre_mlp_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
            for kind in ("weight", "bias") if self.qkv_bias else ("weight",):
                q, k, v = (hf[f"{p}self_attn.{x}_proj.{kind}"] for x in "qkv")
                rest = q.shape[1:]
                out[m + f"self_attention.linear_qkv.{kind}"] = torch.cat(
                    [q.reshape(ng, hpg * d, *rest), k.reshape(ng, d, *rest), v.reshape(ng, d, *rest)], 1
                ).reshape(-1, *rest)
            out[m + "self_attention.linear_proj.weight"] = hf[p + "self_attn.o_proj.weight"]
            gates, ups = hf[p + "mlp.gate_proj.weight"].chunk(self.tp), hf[p + "mlp.up_proj.weight"].chunk(self.tp)
            out[m + "mlp.linear_fc1.weight"] = torch.cat([t for g, u in zip(gates, ups) for t in (g, u)])
            out[m + "mlp.linear_fc2.weight"] = hf[p + "mlp.down_proj.weight"]
        return out

    def to_hf(self, name: str, full: Tensor) -> Iterator[tuple[str, Tensor]]:
        """The Hugging Face tensors of one full Megatron tensor (global name); one layer at a time is
        all the export ever holds."""
        if name == "embedding.word_embeddings.weight":
            yield "model.embed_tokens.weight", full[: self.vocab]
            if self.tied:
                yield "lm_head.weight", full[: self.vocab]
            return
        if name == "output_layer.weight":
            if not self.tied:  # tied models keep a copy on the last stage when PP > 1: not a tensor of their own
                yield "lm_head.weight", full[: self.vocab]
            return
        if name == "decoder.final_layernorm.weight":
            yield "model.norm.weight", full
            return
        match = LAYER.match(name)
        if not match:
            raise LayoutError(f"unknown Megatron parameter {name!r}")
        i, rest = match.groups()
        p = f"model.layers.{i}."
        if rest == "input_layernorm.weight":
            yield p + "input_layernorm.weight", full
        elif rest == "pre_mlp_layernorm.weight":
            yield p + "post_attention_layernorm.weight", full
        elif rest.startswith("self_attention.linear_qkv."):
            kind = rest.rsplit(".", 1)[1]
            d, ng = self.head_dim, self.kv_heads
            hpg = self.heads // ng
            tail = full.shape[1:]
            q, k, v = full.reshape(ng, (hpg + 2) * d, *tail).split([hpg * d, d, d], dim=1)
            for x, t in zip("qkv", (q, k, v)):
                yield f"{p}self_attn.{x}_proj.{kind}", t.reshape(-1, *tail)
        elif rest == "self_attention.linear_proj.weight":
            yield p + "self_attn.o_proj.weight", full
        elif rest == "mlp.linear_fc1.weight":
            blocks = [b.chunk(2) for b in full.chunk(self.tp)]
            yield p + "mlp.gate_proj.weight", torch.cat([g for g, _ in blocks])
            yield p + "mlp.up_proj.weight", torch.cat([u for _, u in blocks])
        elif rest == "mlp.linear_fc2.weight":
            yield p + "mlp.down_proj.weight", full
        else:
            raise LayoutError(f"unknown Megatron parameter {name!r}")

    def _pad(self, t: Tensor) -> Tensor:
        if t.shape[0] != self.vocab:
            raise LayoutError(f"embedding of {t.shape[0]} rows for a vocabulary of {self.vocab}")
        return torch.cat([t, t.new_zeros(self.padded_vocab - self.vocab, *t.shape[1:])])

    # -- full <-> one rank's tensors ---------------------------------------------------------
    @staticmethod
    def tp_dim(name: str) -> int | None:
        """The dimension a parameter is split along over TP ranks (None: replicated)."""
        if name.endswith(COLUMN_PARALLEL):
            return 0
        if name.endswith(ROW_PARALLEL):
            return 1
        return None

    def stage_name(self, name: str, pp_rank: int) -> str | None:
        """The stage-local name of a global parameter on pipeline stage `pp_rank`, or None if another
        stage holds it."""
        match = LAYER.match(name)
        if match:
            i = int(match.group(1))
            layers = self.stage_layers(pp_rank)
            return f"decoder.layers.{i - layers.start}.{match.group(2)}" if i in layers else None
        if name.startswith("embedding."):
            return name if pp_rank == 0 else None
        return name if pp_rank == self.pp - 1 else None  # final norm and output layer

    def global_name(self, local: str, pp_rank: int) -> str:
        match = LAYER.match(local)
        if not match:
            return local
        return f"decoder.layers.{int(match.group(1)) + self.stage_layers(pp_rank).start}.{match.group(2)}"

    def rank_tensors(self, full: Mapping[str, Tensor], tp_rank: int, pp_rank: int) -> dict[str, Tensor]:
        """What TP rank `tp_rank` of stage `pp_rank` holds, under stage-local names. A tied model with
        PP > 1 also gets `output_layer.weight` on its last stage: Megatron keeps a copy of the
        embedding there and keeps the two equal."""
        out = {}
        for name, t in full.items():
            local = self.stage_name(name, pp_rank)
            if local is not None:
                out[local] = self.shard(name, t, tp_rank)
        if self.tied and self.pp > 1 and pp_rank == self.pp - 1:
            out["output_layer.weight"] = self.shard("output_layer.weight", full["embedding.word_embeddings.weight"],
                                                    tp_rank)
        return out

    def shard(self, name: str, full: Tensor, tp_rank: int) -> Tensor:
        dim = self.tp_dim(name)
        return full if dim is None else full.chunk(self.tp, dim)[tp_rank].contiguous()

    def unshard(self, name: str, shards: list[Tensor]) -> Tensor:
        dim = self.tp_dim(name)
        return shards[0] if dim is None else torch.cat(shards, dim)
