"""A run's topology, in plain numbers (no torch: `load_config` judges the layout with them): the world's
size, the map of engines over the policy ranks, and the model's shape the layout divides."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class WorldSize:
    """The ranks a run spans, and how many of them share a node."""

    ranks: int
    per_node: int


@dataclass(frozen=True)
class Shape:
    """What the layout divides and the plan prices of a policy, from its Hugging Face config: the sizes,
    and the parts a family adds to the Llama layer. Qwen3 has a head size of its own (`head_dim` x heads
    need not be the hidden size) and an RMSNorm weight of `head_dim` over q and one over k in every layer;
    Qwen2.5 biases on q, k and v; Llama's `attention_bias` puts biases on q, k, v and o (false in the real
    checkpoints). `tied`: the LM head is the embedding (small Qwen2.5s), else a matrix of its own.
    A mixture-of-experts layer (Qwen3-MoE) has `experts` SwiGLU experts of width `expert_ffn` and a
    router, of which each token runs `top_k`; `ffn` is then unused. Dense: experts = 0."""

    family: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    positions: int  # max_position_embeddings
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0

    @classmethod
    def of(cls, c: Any) -> Shape:
        """From a transformers PretrainedConfig (any family fastgrpo supports)."""
        heads = c.num_attention_heads
        attention_bias = bool(getattr(c, "attention_bias", False))
        experts = int(getattr(c, "num_experts", 0) or 0)
        return cls(family=c.model_type, layers=c.num_hidden_layers, hidden=c.hidden_size, heads=heads,
                   kv_heads=c.num_key_value_heads or heads,
                   head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads, ffn=c.intermediate_size,
                   vocab=c.vocab_size, tied=bool(c.tie_word_embeddings),
                   qkv_bias=c.model_type == "qwen2" or attention_bias,  # Qwen2's config has no switch: always
                   o_bias=c.model_type != "qwen2" and attention_bias,
                   qk_norm=c.model_type in ("qwen3", "qwen3_moe"), positions=c.max_position_embeddings,
                   experts=experts, top_k=int(getattr(c, "num_experts_per_tok", 0) or 0) if experts else 0,
                   expert_ffn=int(getattr(c, "moe_intermediate_size", 0) or 0) if experts else 0)

    @property
    def moe(self) -> bool:
        return self.experts > 0

    def describe(self) -> str:
        mlp = (f"{self.experts} experts of {self.expert_ffn}, top-{self.top_k}" if self.moe else f"MLP {self.ffn}")
        parts = [f"{self.layers} layers", f"hidden {self.hidden}", f"{self.heads} heads x head_dim {self.head_dim}",
                 f"{self.kv_heads} KV heads", mlp, f"vocab {self.vocab}"]
        parts += [x for x, on in (("q/k/v biases", self.qkv_bias), ("o bias", self.o_bias),
                                  ("q/k norms", self.qk_norm)) if on]
        parts.append("tied LM head" if self.tied else "untied LM head")
        return f"{self.family}: " + ", ".join(parts)


@dataclass(frozen=True)
class EngineMap:
    """Which policy ranks serve rollout, whatever the trainer's layout: engines of `tensor`
    consecutive policy ranks each (an engine's own tensor-parallel size; 1 for the embedded engine)
    tile all of them, so every policy GPU samples. Engine e runs on ranks e*tensor .. (e+1)*tensor - 1
    and is led (driven, fed weights and prompts) by the first of them. The draft slice, after the
    policy ranks, holds no engine."""

    policy_ranks: int = 1
    tensor: int = 1

    def __post_init__(self) -> None:
        if self.tensor < 1 or self.policy_ranks < 1 or self.policy_ranks % self.tensor:
            raise ValueError(f"engine.tensor={self.tensor} does not divide the {self.policy_ranks} policy ranks")

    @property
    def engines(self) -> int:
        return self.policy_ranks // self.tensor

    def engine_of(self, rank: int) -> int | None:
        """The engine rank `rank` belongs to (None: a draft rank)."""
        return rank // self.tensor if 0 <= rank < self.policy_ranks else None

    def leads(self, rank: int) -> bool:
        return 0 <= rank < self.policy_ranks and rank % self.tensor == 0

    def leaders(self) -> list[int]:
        """The ranks that lead an engine, in engine order."""
        return list(range(0, self.policy_ranks, self.tensor))

    def ranks(self, engine: int) -> range:
        return range(engine * self.tensor, (engine + 1) * self.tensor)

    def bounds(self, items: int, engine: int) -> tuple[int, int]:
        """Engine `engine`'s contiguous share [start, stop) of `items` whole prompts (a group never
        splits), as even as the count allows: shares differ by at most one prompt."""
        return engine * items // self.engines, (engine + 1) * items // self.engines
