"""Hugging Face <-> Megatron-core parameter layout for the families fastgrpo serves
(`fastgrpo.models.families`: Llama 3.x, Qwen2.5, Qwen3, Qwen3-MoE): names, the grouped QKV (and
Qwen2's QKV bias, packed as the weight), Qwen3's per-head q/k norms, the per-shard gate/up of
SwiGLU, vocabulary padding, and which slice of each tensor a tensor-, pipeline- and expert-parallel
rank holds.

Qwen3-MoE (every layer sparse): the router `mlp.gate.weight` [E, h] is megatron's
`mlp.router.weight` (replicated over TP: megatron sums its gradient over the TP ranks, each of which
routes its own shard of the sequence under sequence parallelism). Expert e's SwiGLU is megatron's
`mlp.experts.local_experts.{j}.linear_fc1.weight` ([gate; up], sharded over the experts' own
tensor-parallel ranks as the dense fc1 is over TP) and `linear_fc2.weight`, on the expert-parallel rank
e // (E / EP) as its local expert j = e % (E / EP) (`MoELayer.local_expert_indices`). Here a "full"
Megatron tensor of an expert is named by its global index e (the names of the model at EP 1);
`rank_tensors` and `global_name` translate to and from an EP rank's local indices. The experts'
tensor-parallel size (`expert_tensor`, megatron-core's expert_tensor_parallel_size) is TP by default
or 1 (`parallel.expert_tensor=1`): each expert whole on its EP rank, every "full" expert tensor one
piece (fc1 a plain [gate; up]), and the EP ranks then span the TP ranks too (megatron-core's expert
grid: expert tensor x expert x expert-data x pipeline). On the Hugging
Face side the experts are read from either form transformers uses: each expert's own matrices (what
checkpoints on disk hold: `mlp.experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`) or the
stacked tensors transformers 5 holds in memory (`mlp.experts.gate_up_proj` [E, 2f, h], gate rows
first, and `mlp.experts.down_proj` [E, h, f]); they are written out in the first form, one expert
at a time, which is what checkpoints, SGLang's `load_weights` and the embedded engine take.

Qwen3's `self_attn.q_norm.weight` / `k_norm.weight` are megatron's
`self_attention.q_layernorm.weight` / `k_layernorm.weight` (the local spec's names,
megatron/core/models/gpt/gpt_layer_specs.py:405-410; Transformer Engine's spec uses the same ones).
One [head_dim] weight shared by every head, applied per head before RoPE (attention.py:1477-1481):
every TP rank holds all of it (replicated), and megatron sums its gradient over the TP ranks, each of
which saw only its own heads (distributed/finalize_model_grads.py:353-356).

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
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from fastgrpo.config import broken, shape_rules
from fastgrpo.models.families import UnsupportedModel, check_family
from fastgrpo.topology import Shape
from fastgrpo.models.rope import UnsupportedRope, hf_inv_freq, rope_parameters

COLUMN_PARALLEL = ("embedding.word_embeddings.weight", "output_layer.weight", "self_attention.linear_qkv.weight",
                   "self_attention.linear_qkv.bias", "mlp.linear_fc1.weight")
ROW_PARALLEL = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
# Qwen3's per-head norms: megatron's name (in a layer) -> Hugging Face's
QK_NORMS = {"self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
            "self_attention.k_layernorm.weight": "self_attn.k_norm.weight"}
# a routed expert's parameter within a layer: (expert index, which matrix)
EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1\.weight|linear_fc2\.weight)$")
ROUTER = "mlp.router.weight"
LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
VOCAB_DIVISIBLE_BY = 128  # megatron pads the vocabulary to a multiple of this x TP


def padded_vocab(vocab: int, tensor: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    multiple = divisible_by * tensor
    return math.ceil(vocab / multiple) * multiple


class LayoutError(ValueError):
    """A model that cannot be laid out at the requested TP x PP, or a checkpoint of another model."""


@dataclass(frozen=True)
class Layout(Shape):
    """A policy's shape (`topology.Shape`: its sizes and family parts, not repeated here) laid out for
    megatron-core at the config's parallel sizes: `tensor` (`parallel.tensor`), `pipeline`
    (`parallel.pipeline`) and `expert` (`parallel.expert`: each rank of an expert-parallel group
    holds experts / expert of every layer's experts). A mixture of experts (every layer sparse)
    renormalises its top-k weights over the k (`norm_topk`) or keeps the softmax's."""

    tensor: int = 1
    pipeline: int = 1
    expert: int = 1
    norm_topk: bool = False
    vocab_divisible_by: int = VOCAB_DIVISIBLE_BY
    expert_tensor: int = 0  # the experts' tensor-parallel size (`parallel.expert_tensor`); 0: `tensor`

    @classmethod
    def of(cls, hf_config, tensor: int = 1, pipeline: int = 1, expert: int = 1,
           vocab_divisible_by: int = VOCAB_DIVISIBLE_BY, expert_tensor: int = 0) -> Layout:
        """`expert_tensor`: the experts' tensor-parallel size, 0 (the same as `tensor`), 1 or `tensor`:
        megatron-core splits an expert over its own expert-tensor ranks, and these are the two layouts
        slime and megatron's recipes run (any other value is refused naming parallel.expert_tensor)."""
        c = hf_config
        try:
            check_family(c.to_dict(), f"the {c.model_type} config")
        except UnsupportedModel as e:
            raise LayoutError(str(e)) from e
        _check_megatron_features(c)  # o_proj's bias alone refused: qkv_bias is Qwen2's
        if tensor < 1 or pipeline < 1 or expert < 1:
            raise LayoutError(f"parallel sizes must be >= 1, got tensor {tensor}, pipeline {pipeline}, "
                              f"expert {expert}")
        if expert_tensor not in (0, 1, tensor):
            raise LayoutError(f"parallel.expert_tensor={expert_tensor}: must be 0 (the same as parallel.tensor), 1 "
                              f"(each expert whole on one rank) or parallel.tensor={tensor}")
        shape = Shape.of(c)
        refused = broken(shape_rules(shape, tensor, pipeline, expert, expert_tensor))
        if refused is not None:
            raise LayoutError(f"{refused.key} breaks a layout rule: {refused.text}")
        return cls(**{f.name: getattr(shape, f.name) for f in fields(Shape)}, tensor=tensor, pipeline=pipeline,
                   expert=expert, norm_topk=bool(shape.experts and c.norm_topk_prob),
                   vocab_divisible_by=vocab_divisible_by, expert_tensor=expert_tensor or tensor)

    @property
    def expert_tp(self) -> int:
        """The experts' tensor-parallel size: `expert_tensor`, or TP where it was left 0."""
        return self.expert_tensor or self.tensor

    def pieces(self, name: str) -> int:
        """How many tensor-parallel pieces a parameter (global or local name) is cut into: an expert's
        matrices over the expert-tensor ranks (`expert_tp`), every other split parameter over TP; 1 for a
        replicated one."""
        if self.tp_dim(name) is None:
            return 1
        return self.expert_tp if _is_expert(name) else self.tensor

    @property
    def padded_vocab(self) -> int:
        """A multiple of `vocab_divisible_by` x tensor; the extra rows are zero and never sampled."""
        return padded_vocab(self.vocab, self.tensor, self.vocab_divisible_by)

    def stage_layers(self, pp_rank: int) -> range:
        """The global indices of the layers pipeline stage `pp_rank` holds."""
        per = self.layers // self.pipeline
        return range(pp_rank * per, (pp_rank + 1) * per)

    @property
    def local_experts(self) -> int:
        """The experts of each layer one expert-parallel rank holds."""
        return self.experts // self.expert

    def expert_owner(self, e: int) -> tuple[int, int]:
        """(the expert-parallel rank holding global expert e, its local index there)."""
        return e // self.local_experts, e % self.local_experts

    def _mlp_parameters(self) -> list[str]:
        """A layer's MLP parameter names (within the layer); experts under their global index."""
        if not self.experts:
            return ["mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
        return [ROUTER] + [f"mlp.experts.local_experts.{e}.{m}" for e in range(self.experts)
                           for m in ("linear_fc1.weight", "linear_fc2.weight")]

    def layer_parameters(self) -> list[str]:
        """One decoder layer's parameter names (within the layer) in the order the model holds them;
        experts under their global index."""
        return ["input_layernorm.weight", "self_attention.linear_qkv.weight",
                *(["self_attention.linear_qkv.bias"] if self.qkv_bias else []), *(QK_NORMS if self.qk_norm else []),
                "self_attention.linear_proj.weight", "pre_mlp_layernorm.weight", *self._mlp_parameters()]

    # -- Hugging Face <-> full Megatron tensors ------------------------------------------------
    def megatron_names(self) -> list[str]:
        """Every full Megatron tensor's global name, in `to_megatron`'s order."""
        names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight"]
        if not self.tied:
            names.append("output_layer.weight")
        per_layer = ["input_layernorm.weight", "pre_mlp_layernorm.weight", "self_attention.linear_qkv.weight",
                     *(["self_attention.linear_qkv.bias"] if self.qkv_bias else []),
                     *(QK_NORMS if self.qk_norm else []), "self_attention.linear_proj.weight", *self._mlp_parameters()]
        return names + [f"decoder.layers.{i}.{p}" for i in range(self.layers) for p in per_layer]

    def hf_sources(self, name: str) -> list[str]:
        """The Hugging Face tensors one full Megatron tensor is made of (what a streaming converter
        reads to build it); `to_hf` yields the same names back."""
        if name == "embedding.word_embeddings.weight":
            return ["model.embed_tokens.weight"]  # a tied model's lm_head is the same tensor, often not stored
        if name == "output_layer.weight":
            return ["lm_head.weight"]
        return [hf for hf, _ in self.to_hf(name, torch.empty(self._meta_shape(name), device="meta"))]

    def _meta_shape(self, name: str) -> tuple[int, ...]:
        """A 1-d shape `to_hf` can split (only the names it yields matter to `hf_sources`)."""
        rest = LAYER.match(name).group(2) if LAYER.match(name) else name
        if rest.startswith("self_attention.linear_qkv."):
            return ((self.heads + 2 * self.kv_heads) * self.head_dim,)
        if EXPERT.match(rest):
            return (2 * self.expert_ffn,)
        return (2 * self.ffn,) if rest == "mlp.linear_fc1.weight" else (1,)

    def megatron_tensor(self, name: str, hf: Mapping[str, Tensor]) -> Tensor:
        """One full Megatron tensor (global name) from the Hugging Face tensors it is made of."""
        if name == "embedding.word_embeddings.weight":
            return self._pad(hf["model.embed_tokens.weight"])
        if name == "output_layer.weight":
            return self._pad(hf["lm_head.weight"])
        if name == "decoder.final_layernorm.weight":
            return hf["model.norm.weight"]
        p, rest = _layer(name)
        if rest == "input_layernorm.weight":
            return hf[p + "input_layernorm.weight"]
        if rest == "pre_mlp_layernorm.weight":
            return hf[p + "post_attention_layernorm.weight"]
        if rest.startswith("self_attention.linear_qkv."):
            kind = rest.rsplit(".", 1)[1]
            d, ng = self.head_dim, self.kv_heads
            hpg = self.heads // ng
            q, k, v = (hf[f"{p}self_attn.{x}_proj.{kind}"] for x in "qkv")
            tail = q.shape[1:]
            return torch.cat([q.reshape(ng, hpg * d, *tail), k.reshape(ng, d, *tail), v.reshape(ng, d, *tail)],
                             1).reshape(-1, *tail)
        if rest == "self_attention.linear_proj.weight":
            return hf[p + "self_attn.o_proj.weight"]
        if rest in QK_NORMS and self.qk_norm:
            return hf[p + QK_NORMS[rest]]
        if rest == "mlp.linear_fc1.weight":
            gates, ups = hf[p + "mlp.gate_proj.weight"].chunk(self.tensor), hf[p + "mlp.up_proj.weight"].chunk(self.tensor)
            return torch.cat([t for g, u in zip(gates, ups) for t in (g, u)])
        if rest == "mlp.linear_fc2.weight":
            return hf[p + "mlp.down_proj.weight"]
        if rest == ROUTER and self.experts:
            return hf[p + "mlp.gate.weight"]
        expert = EXPERT.match(rest) if self.experts else None
        if expert:
            e, matrix = int(expert.group(1)), expert.group(2)
            if matrix == "linear_fc2.weight":
                return _hf_expert(hf, p, e, "down")
            n = self.expert_tp
            gates, ups = _hf_expert(hf, p, e, "gate").chunk(n), _hf_expert(hf, p, e, "up").chunk(n)
            return torch.cat([t for g, u in zip(gates, ups) for t in (g, u)])
        raise LayoutError(f"unknown Megatron parameter {name!r}")

    def to_megatron(self, hf: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Full Megatron tensors under global names, from a Hugging Face state dict."""
        return {name: self.megatron_tensor(name, hf) for name in self.megatron_names()}

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
        p, rest = _layer(name)
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
        elif rest in QK_NORMS and self.qk_norm:
            yield p + QK_NORMS[rest], full
        elif rest == "mlp.linear_fc1.weight":
            blocks = [b.chunk(2) for b in full.chunk(self.tensor)]
            yield p + "mlp.gate_proj.weight", torch.cat([g for g, _ in blocks])
            yield p + "mlp.up_proj.weight", torch.cat([u for _, u in blocks])
        elif rest == "mlp.linear_fc2.weight":
            yield p + "mlp.down_proj.weight", full
        elif rest == ROUTER and self.experts:
            yield p + "mlp.gate.weight", full
        elif self.experts and EXPERT.match(rest):
            e, matrix = EXPERT.match(rest).groups()
            if matrix == "linear_fc2.weight":
                yield f"{p}mlp.experts.{e}.down_proj.weight", full
            else:
                blocks = [b.chunk(2) for b in full.chunk(self.expert_tp)]
                yield f"{p}mlp.experts.{e}.gate_proj.weight", torch.cat([g for g, _ in blocks])
                yield f"{p}mlp.experts.{e}.up_proj.weight", torch.cat([u for _, u in blocks])
        else:
            raise LayoutError(f"unknown Megatron parameter {name!r}")

    def _pad(self, t: Tensor) -> Tensor:
        if t.shape[0] != self.vocab:
            raise LayoutError(f"embedding of {t.shape[0]} rows for a vocabulary of {self.vocab}")
        return torch.cat([t, t.new_zeros(self.padded_vocab - self.vocab, *t.shape[1:])])

    # -- full <-> one rank's tensors ---------------------------------------------------------
    @staticmethod
    def tp_dim(name: str) -> int | None:
        """The dimension a parameter is split along over TP ranks (None: replicated). An expert's fc1
        and fc2 split as the dense MLP's, over the experts' own tensor-parallel ranks (`pieces`: how many;
        at `expert_tensor` 1 one, the expert whole)."""
        if name.endswith(COLUMN_PARALLEL):
            return 0
        if name.endswith(ROW_PARALLEL):
            return 1
        expert = EXPERT.match(name.split(".", 3)[-1]) if name.startswith("decoder.layers.") else None
        if expert:
            return 0 if expert.group(2) == "linear_fc1.weight" else 1
        return None

    def stage_name(self, name: str, pp_rank: int, ep_rank: int = 0) -> str | None:
        """The local name of a global parameter on pipeline stage `pp_rank` and expert-parallel rank
        `ep_rank` (its layer's index within the stage, an expert's index within the rank), or None if
        another stage or EP rank holds it."""
        match = LAYER.match(name)
        if match:
            i, rest = int(match.group(1)), match.group(2)
            layers = self.stage_layers(pp_rank)
            if i not in layers:
                return None
            expert = EXPERT.match(rest) if self.experts else None
            if expert:
                owner, j = self.expert_owner(int(expert.group(1)))
                if owner != ep_rank:
                    return None
                rest = f"mlp.experts.local_experts.{j}.{expert.group(2)}"
            return f"decoder.layers.{i - layers.start}.{rest}"
        if name.startswith("embedding."):
            return name if pp_rank == 0 else None
        return name if pp_rank == self.pipeline - 1 else None  # final norm and output layer

    def global_name(self, local: str, pp_rank: int, ep_rank: int = 0) -> str:
        """`stage_name`'s inverse."""
        match = LAYER.match(local)
        if not match:
            return local
        rest = match.group(2)
        expert = EXPERT.match(rest) if self.experts else None
        if expert:
            rest = f"mlp.experts.local_experts.{ep_rank * self.local_experts + int(expert.group(1))}.{expert.group(2)}"
        return f"decoder.layers.{int(match.group(1)) + self.stage_layers(pp_rank).start}.{rest}"

    def rank_tensors(self, full: Mapping[str, Tensor], tp_rank: int, pp_rank: int,
                     ep_rank: int = 0, etp_rank: int | None = None) -> dict[str, Tensor]:
        """What TP rank `tp_rank` of stage `pp_rank` (and EP rank `ep_rank`: its experts only, their
        pieces of expert-tensor rank `etp_rank`) holds of the full tensors `full`, under local names
        (`rank_pieces`, tensor by tensor)."""
        out = {}
        for name, t in full.items():
            out |= self.rank_pieces(name, t, tp_rank, pp_rank, ep_rank, etp_rank)
        return out

    def local_names(self, name: str, pp_rank: int, ep_rank: int = 0) -> list[str]:
        """The local names under which stage `pp_rank`'s EP rank `ep_rank` holds a piece of global tensor
        `name`: none, one, or (the embedding of a tied model at PP > 1, on the last stage) the output
        layer too, as Megatron keeps a copy of the embedding there and keeps the two equal."""
        local = self.stage_name(name, pp_rank, ep_rank)
        out = [] if local is None else [local]
        if (self.tied and self.pipeline > 1 and pp_rank == self.pipeline - 1
                and name == "embedding.word_embeddings.weight"):
            out.append("output_layer.weight")
        return out

    def rank_pieces(self, name: str, full: Tensor, tp_rank: int, pp_rank: int, ep_rank: int = 0,
                    etp_rank: int | None = None) -> dict[str, Tensor]:
        """This rank's pieces of one full tensor, under its local names (`local_names`). `etp_rank`
        defaults to what megatron-core's default rank order gives: the TP rank when the experts'
        tensor-parallel size is TP, 0 at `expert_tensor` 1 (every expert whole)."""
        etp_rank = tp_rank % self.expert_tp if etp_rank is None else etp_rank
        rank = etp_rank if _is_expert(name) else tp_rank
        return {local: self.shard(name, full, rank) for local in self.local_names(name, pp_rank, ep_rank)}

    def shard(self, name: str, full: Tensor, tp_rank: int) -> Tensor:
        """Piece `tp_rank` of a full tensor (of an expert: `tp_rank` is its expert-tensor rank)."""
        n = self.pieces(name)
        return full if n == 1 else full.chunk(n, self.tp_dim(name))[tp_rank].contiguous()

    def unshard(self, name: str, shards: list[Tensor]) -> Tensor:
        """The full tensor from its pieces in rank order (`pieces(name)` of them; a whole expert, or a
        replicated parameter, is its first)."""
        n = self.pieces(name)
        return shards[0] if n == 1 else torch.cat(shards[:n], self.tp_dim(name))

    # -- megatron's distributed checkpoints (dist_checkpointing, torch_dist) ----------------------
    # There a layer's tensor is one slice of a tensor stacked over all layers (key without the layer
    # index, leading axis = layer), an expert's matrix one slice of a tensor stacked over layers and
    # then experts (`mlp.experts.experts.linear_fc1.weight` [layers, E, ...]: megatron's SequentialMLP
    # saves local expert j of EP rank r at global index r * E/EP + j, so the stored form is the same at
    # every EP size), the local spec's norms are saved under Transformer Engine's fused names
    # (`keys_map`: megatron's `sharded_state_dict_keys_map`; the norm before a MoE layer too), and
    # SwiGLU's fc1 (dense or an expert's) is [gate; up] whatever the TP size (megatron's swiglu
    # sharded factory saves each rank's gate and up halves at their offsets in the two halves); every
    # other tensor is its full tensor (padded rows too).
    def dist_key(self, name: str, keys_map: Mapping[str, str]) -> tuple[str, tuple[int, ...]]:
        """The distributed-checkpoint key of a global parameter and its index in the stack that key
        holds: () not stacked, (layer,) stacked over layers, (layer, expert) an expert's matrix."""
        match = LAYER.match(name)
        if not match:
            return name, ()
        i, rest = match.groups()
        expert = EXPERT.match(rest) if self.experts else None
        if expert:
            return f"decoder.layers.mlp.experts.experts.{expert.group(2)}", (int(i), int(expert.group(1)))
        for ours, theirs in keys_map.items():
            if rest.startswith(ours):
                rest = theirs + rest[len(ours):]
                break
        return f"decoder.layers.{rest}", (int(i),)

    def dist_stack(self, index: tuple[int, ...]) -> tuple[int, ...]:
        """The leading sizes of the stack a `dist_key` index points into: (), (layers,) or (layers, E)."""
        return (self.layers, self.experts)[: len(index)]

    def extra_state_keys(self) -> list[str]:
        """The keys of the (empty) extra state megatron saves for each linear layer of the local spec:
        per layer for attention's and the dense MLP's, per layer and expert for each expert's."""
        L, E = self.layers, self.experts
        modules = ["self_attention.linear_proj", "self_attention.linear_qkv"]
        if not E:
            modules += ["mlp.linear_fc1", "mlp.linear_fc2"]
        keys = [f"decoder.layers.{m}._extra_state/shard_{i}_{L}" for i in range(L) for m in modules]
        return keys + [f"decoder.layers.mlp.experts.experts.{m}._extra_state/shard_{i}.{e}_{L}.{E}"
                       for i in range(L) for m in ("linear_fc1", "linear_fc2") for e in range(E)]

    @staticmethod
    def _swiglu_fc1(name: str) -> bool:
        return name.endswith("mlp.linear_fc1.weight") or (
            name.endswith(".linear_fc1.weight") and ".local_experts." in name)

    def to_dist(self, name: str, full: Tensor) -> Tensor:
        """A full Megatron tensor as the distributed checkpoint stores it (fc1: [gate; up])."""
        if not self._swiglu_fc1(name):
            return full
        blocks = [b.chunk(2) for b in full.chunk(self.pieces(name))]
        return torch.cat([g for g, _ in blocks] + [u for _, u in blocks])

    def from_dist(self, name: str, stored: Tensor) -> Tensor:
        """`to_dist`'s inverse: the full Megatron tensor of this layout."""
        if not self._swiglu_fc1(name):
            return stored
        gate, up = stored.chunk(2)
        n = self.pieces(name)
        return torch.cat([t for g, u in zip(gate.chunk(n), up.chunk(n)) for t in (g, u)])

    def dist_chunks(self, name: str, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """(offsets, sizes) of the pieces the TP ranks of this layout save of a tensor in its stored
        (`to_dist`) form: fc1's gate and up halves each split over TP (an expert's over its expert-tensor
        ranks: at `expert_tensor` 1 one piece, the whole expert), others along `tp_dim`."""
        dim, n = self.tp_dim(name), self.pieces(name)
        if dim is None or n == 1:
            return [((0,) * len(shape), tuple(shape))]
        pieces = 2 * n if self._swiglu_fc1(name) else n
        step = shape[dim] // pieces
        out = []
        for k in range(pieces):
            offsets = [0] * len(shape)
            sizes = list(shape)
            offsets[dim], sizes[dim] = k * step, step
            out.append((tuple(offsets), tuple(sizes)))
        return out


def _check_megatron_features(c) -> None:
    """What a supported family's config may switch on that the Megatron layout does not represent:
    refused by name rather than dropped. megatron's `add_bias_linear` gives every linear layer a
    bias (o_proj and the MLP's alike), so o_proj's bias alone (Llama's and Qwen3's `attention_bias`,
    which also biases o_proj) has no place in its model; no released Llama 3.x or Qwen3 checkpoint
    sets it."""
    family = c.model_type
    if family == "qwen3_moe":
        _check_moe(c)
    if family in ("llama", "qwen3", "qwen3_moe") and getattr(c, "attention_bias", False):
        raise LayoutError(f"{family}: attention_bias=True (biases on q/k/v and o_proj) is not supported by the "
                          f"Megatron trainer: megatron-core has no bias for the output projection alone")
    if getattr(c, "mlp_bias", False):
        raise LayoutError(f"{family}: biased MLP projections (mlp_bias) are not supported")
    if getattr(c, "hidden_act", "silu") != "silu":
        raise LayoutError(f"{family}: hidden_act {c.hidden_act!r} is not supported (silu)")
    if "sliding_attention" in (getattr(c, "layer_types", None) or ()) or getattr(c, "use_sliding_window", False):
        raise LayoutError(f"{family}: sliding-window attention layers are not supported")
    try:
        _, scale = hf_inv_freq(c)
    except UnsupportedRope as e:
        raise LayoutError(str(e)) from e
    if scale != 1.0:  # megatron's RotaryEmbedding has no factor on cos/sin
        raise LayoutError(f"{family}: rope type {rope_parameters(c)['rope_type']!r} scales cos/sin by {scale:g}, "
                          f"which megatron's RotaryEmbedding does not")


def _check_moe(c) -> None:
    """What of a Qwen3-MoE config the Megatron model does not represent, refused by its key: dense
    layers among the sparse ones (megatron's `moe_layer_freq` could place them, but the layout maps
    every layer as sparse), a shared expert (Qwen3-MoE has none; a config that asks for one is of
    another model), more experts per token than experts."""
    if getattr(c, "decoder_sparse_step", 1) != 1:
        raise LayoutError(f"qwen3_moe: decoder_sparse_step={c.decoder_sparse_step} (dense layers between sparse "
                          f"ones) is not supported by the Megatron trainer: every layer must be sparse "
                          f"(decoder_sparse_step 1)")
    if getattr(c, "mlp_only_layers", None):
        raise LayoutError(f"qwen3_moe: mlp_only_layers={list(c.mlp_only_layers)} (dense layers among the sparse "
                          f"ones) is not supported by the Megatron trainer: every layer must be sparse")
    if getattr(c, "shared_expert_intermediate_size", 0):
        raise LayoutError(f"qwen3_moe: shared_expert_intermediate_size={c.shared_expert_intermediate_size} (a "
                          f"shared expert) is not supported by the Megatron trainer")
    if not 0 < c.num_experts_per_tok <= c.num_experts:
        raise LayoutError(f"qwen3_moe: num_experts_per_tok={c.num_experts_per_tok} must be in 1..num_experts "
                          f"({c.num_experts})")


def _is_expert(name: str) -> bool:
    """A routed expert's matrix (a layer's parameter, global or local name)."""
    match = LAYER.match(name)
    return bool(match and EXPERT.match(match.group(2)))


def _hf_expert(hf: Mapping[str, Tensor], p: str, e: int, matrix: str) -> Tensor:
    """Expert e's `gate`, `up` or `down` matrix of the layer with Hugging Face prefix `p`, from its own
    tensor (checkpoints on disk) or from transformers 5's stacked ones (a model's state dict)."""
    own = f"{p}mlp.experts.{e}.{matrix}_proj.weight"
    if own in hf:
        return hf[own]
    if matrix == "down":
        return hf[f"{p}mlp.experts.down_proj"][e]
    gate, up = hf[f"{p}mlp.experts.gate_up_proj"][e].chunk(2)
    return gate if matrix == "gate" else up


def _layer(name: str) -> tuple[str, str]:
    """A decoder layer's Megatron parameter name as (its Hugging Face prefix, the rest of the name)."""
    match = LAYER.match(name)
    if not match:
        raise LayoutError(f"unknown Megatron parameter {name!r}")
    i, rest = match.groups()
    return f"model.layers.{i}.", rest
