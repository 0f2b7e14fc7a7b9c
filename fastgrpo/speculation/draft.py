"""EAGLE-style draft head (DESIGN.md 5.4).

At position t the draft fuses the target's final hidden state h_t with the embedding of token t+1,
runs one decoder layer (attending over its own earlier positions), and predicts h_{t+1}; the target's
frozen LM head turns that prediction into a distribution over token t+2. Feeding its own predicted
state back in lets it draft several tokens ahead from a single target forward.

The embedding and LM head are the target's, shared and never trained or saved with the draft.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import LlamaConfig

from fastgrpo.engine.model import (MATRICES, KVFn, PackedWeight, decoder_layer, layer_shapes, linear, onednn_available,
                                   rms_norm, rope_tables)

DRAFT_WEIGHTS = "draft.safetensors"
DRAFT_CONFIG = "draft_config.json"


EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


class TargetTensors:
    """Collects the policy's embedding and LM head (which the draft shares) from a weight push, whose
    buckets may bring them in separate calls; `collect` returns copies once both are in."""

    def __init__(self, tied: bool):
        self.tied = tied  # the LM head is the embedding
        self.version: int | None = None
        self.found: dict[str, Tensor] = {}
        self.done = False

    def collect(self, named_tensors, version: int) -> tuple[Tensor, Tensor] | None:
        """(embedding, LM head) of `version` the first time both are in; None before and after."""
        if version != self.version:
            self.version, self.found, self.done = version, {}, False
        if self.done:
            return None
        for name, t in named_tensors:
            if name in (EMBED, LM_HEAD):
                self.found[name] = t.detach().clone()
        embed = self.found.get(EMBED)
        head = embed if self.tied else self.found.get(LM_HEAD)
        if embed is None or head is None:
            return None
        self.done = True
        return embed, head


class DraftHead(nn.Module):
    def __init__(self, target_cfg: LlamaConfig, max_len: int = 1024):
        super().__init__()
        self.cfg = target_cfg
        h = target_cfg.hidden_size
        self.n_heads, self.n_kv = target_cfg.num_attention_heads, target_cfg.num_key_value_heads
        self.eps = target_cfg.rms_norm_eps
        self.fc = nn.Parameter(torch.empty(h, 2 * h))
        self.layer = nn.ParameterDict({k: nn.Parameter(torch.empty(s)) for k, s in layer_shapes(target_cfg).items()})
        self.norm = nn.Parameter(torch.ones(h))
        cos, sin = rope_tables(target_cfg, max_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.embed: Tensor = torch.zeros(0)
        self.lm_head: Tensor = torch.zeros(0)
        self.packed: dict[str, PackedWeight] | None = None  # engine-side inference copies, see pack()
        self.reset_parameters()

    def reset_parameters(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in [("fc", self.fc), *self.layer.items()]:
                if p.dim() == 2:
                    p.normal_(0.0, 0.02, generator=g)
                else:
                    p.fill_(1.0)
            self.norm.fill_(1.0)

    def pack(self) -> None:
        """Freeze for inference and keep oneDNN-packed copies of the matrices (the engine's draft: its
        small per-level matmuls are what speculation pays for each step). load_named() repacks."""
        self.requires_grad_(False)
        if onednn_available():
            self.packed = {k: PackedWeight(w) for k, w in [("fc", self.fc), *self.layer.items()] if k in ("fc", *MATRICES)}

    def bind_target(self, embed: Tensor, lm_head: Tensor) -> None:
        """Share the target's (frozen) embedding and LM head."""
        if embed.shape[1] != self.cfg.hidden_size or lm_head.shape[1] != self.cfg.hidden_size:
            raise ValueError(f"draft hidden size {self.cfg.hidden_size} does not match the target's "
                             f"embedding {tuple(embed.shape)} / LM head {tuple(lm_head.shape)}")
        self.embed, self.lm_head = embed.detach(), lm_head.detach()

    def features(self, hidden: Tensor, next_tokens: Tensor, positions: Tensor, mask: Tensor | None,
                 kv: KVFn) -> Tensor:
        """hidden [B, n, H] at positions t, next_tokens [B, n] (token t+1) -> predicted h_{t+1} [B, n, H]."""
        weights = {"fc": self.fc, **self.layer} | (self.packed or {})
        x = linear(torch.cat([F.embedding(next_tokens, self.embed), hidden], dim=-1), weights["fc"])
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        return decoder_layer(x, weights, self.n_heads, self.n_kv, self.eps, cos, sin, mask, kv)

    def logits(self, features: Tensor) -> Tensor:
        return rms_norm(features, self.norm, self.eps) @ self.lm_head.T

    def forward(self, hidden: Tensor, next_tokens: Tensor) -> Tensor:
        """Teacher-forced training forward over whole sequences (causal, positions 0..n-1)."""
        positions = torch.arange(hidden.shape[1]).expand(hidden.shape[0], -1)
        return self.features(hidden, next_tokens, positions, None, lambda k, v: (k, v))

    # -- files: safetensors + a small config next to the policy --------------------------------
    def save(self, directory: str | Path, extra: dict | None = None) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous() for k, v in self.state_dict().items()}, str(d / DRAFT_WEIGHTS))
        meta = {"architecture": "eagle-1-layer", "hidden_size": self.cfg.hidden_size,
                "vocab_size": self.cfg.vocab_size} | (extra or {})
        (d / DRAFT_CONFIG).write_text(json.dumps(meta, indent=2))

    @classmethod
    def load(cls, directory: str | Path, target_cfg: LlamaConfig, max_len: int = 1024) -> DraftHead:
        d = Path(directory)
        if not (d / DRAFT_WEIGHTS).is_file():
            raise FileNotFoundError(f"no draft at {d} ({DRAFT_WEIGHTS} missing); build one with `fastgrpo draft-pretrain`")
        draft = cls(target_cfg, max_len)
        draft.load_named(load_file(str(d / DRAFT_WEIGHTS)).items())
        return draft

    def load_named(self, named_tensors) -> None:
        """Load weights by name, with a clear error when they belong to another target."""
        own = self.state_dict()
        for name, t in named_tensors:
            if name not in own:
                raise KeyError(f"draft weight {name!r} is unknown")
            if own[name].shape != t.shape:
                raise ValueError(f"draft weight {name!r}: shape {tuple(t.shape)} does not match the target's "
                                 f"{tuple(own[name].shape)} (a draft trained for another policy?)")
            own[name].copy_(t)
        if self.packed is not None:
            self.pack()


def draft_loss(draft: DraftHead, hidden: Tensor, tokens: Tensor, mask: Tensor,
               hidden_weight: float = 1.0, token_weight: float = 0.1) -> tuple[Tensor, dict[str, float]]:
    """EAGLE's loss on target states: SmoothL1 to h_{t+1} plus cross-entropy to the target's distribution.

    hidden [B, T, H]: the target's final hidden states; tokens [B, T]; mask [B, T]: positions to learn
    from. Position t predicts h_{t+1} (and so token t+2); it is trained when t and t+1 are both masked in.
    """
    pred = draft(hidden[:, :-1], tokens[:, 1:])
    target = hidden[:, 1:]
    m = (mask[:, :-1] & mask[:, 1:]).float()
    n = m.sum().clamp(min=1)
    reg = (F.smooth_l1_loss(pred, target, reduction="none").mean(-1) * m).sum() / n
    with torch.no_grad():
        target_logp = torch.log_softmax(target @ draft.lm_head.T, dim=-1)
    draft_logp = torch.log_softmax(draft.logits(pred), dim=-1)
    ce = (-(target_logp.exp() * draft_logp).sum(-1) * m).sum() / n
    top1 = ((draft_logp.argmax(-1) == target_logp.argmax(-1)).float() * m).sum() / n
    loss = hidden_weight * reg + token_weight * ce
    return loss, {"draft_loss": loss.item(), "draft_hidden_l1": reg.item(), "draft_ce": ce.item(),
                  "draft_top1": top1.item()}
