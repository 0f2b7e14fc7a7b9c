"""EAGLE-style draft head (docs/speculation.md).

At position t the draft fuses the target's final hidden state h_t with the embedding of token t+1,
runs one decoder layer (attending over its own earlier positions), and predicts h_{t+1}; the target's
frozen LM head turns that prediction into a distribution over token t+2. Feeding its own predicted
state back in lets it draft several tokens ahead from a single target forward.

The embedding and LM head are the target's, shared and never trained or saved with the draft.

Its files' names and place are `fastgrpo.paths`; what of the draft needs no kernel (the target tensors it
collects from a weight push, the SGLang EAGLE export) is `fastgrpo.models.draft`. The head stays here,
beside the decoder layer it runs (model.py, families.py), which the engine's forward shares.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import PretrainedConfig

from fastgrpo.engines.embedded.families import dense_layer
from fastgrpo.engines.embedded.model import (KVFn, PackedWeight, decoder_layer, linear, onednn_available, rms_norm,
                                             rope_tables)
from fastgrpo.paths import DRAFT_CONFIG, DRAFT_WEIGHTS


class DraftHead(nn.Module):
    def __init__(self, target_cfg: PretrainedConfig, max_len: int = 1024, device: torch.device | str | None = None):
        """On `device` (None: the default device, or the enclosing device context's, as torch's own
        modules: an engine builds its draft inside its device's context, `fastgrpo plan` on meta);
        the initial values are drawn on the CPU wherever it is (reset_parameters).

        Its layer is a plain Llama one (no biases, no q/k norms: what SGLang's EAGLE Llama holds) at the
        target's sizes (heads, KV heads, head size, MLP width), rotating by the target's rope (scaled
        as the target's is)."""
        super().__init__()
        self.cfg = target_cfg
        h = target_cfg.hidden_size
        self.layout = dense_layer(target_cfg)
        self.eps = target_cfg.rms_norm_eps
        self.fc = nn.Parameter(torch.empty(h, 2 * h, device=device))
        self.layer = nn.ParameterDict({k: nn.Parameter(torch.empty(s, device=device))
                                       for k, s in self.layout.shapes().items()})
        self.norm = nn.Parameter(torch.ones(h, device=device))
        cos, sin = rope_tables(target_cfg, max_len, device=device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.embed: Tensor = torch.zeros(0, device=device)
        self.lm_head: Tensor = torch.zeros(0, device=device)
        self.packed: dict[str, PackedWeight] | None = None  # engine-side inference copies, see pack()
        self.reset_parameters()

    def reset_parameters(self, seed: int = 0) -> None:
        if self.fc.is_meta:  # shapes only (no values to draw)
            return
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in [("fc", self.fc), *self.layer.items()]:
                if p.dim() == 2:  # drawn on the CPU (the generator's device) wherever p is: an engine's draft is
                    # made inside its device's context, and a CUDA tensor refuses a CPU generator
                    p.copy_(torch.empty(p.shape, dtype=p.dtype, device="cpu").normal_(0.0, 0.02, generator=g))
                else:
                    p.fill_(1.0)
            self.norm.fill_(1.0)

    def pack(self) -> None:
        """Freeze for inference and keep oneDNN-packed copies of the matrices (the engine's draft: its
        small per-level matmuls are what speculation pays for each step). load_named() repacks."""
        self.requires_grad_(False)
        if onednn_available() and self.fc.device.type == "cpu" and self.fc.dtype == torch.float32:
            self.packed = {k: PackedWeight(w) for k, w in [("fc", self.fc), *self.layer.items()]
                           if k in ("fc", *self.layout.matrices)}

    def bind_target(self, embed: Tensor, lm_head: Tensor) -> None:
        """Share the target's (frozen) embedding and LM head."""
        if embed.shape[1] != self.cfg.hidden_size or lm_head.shape[1] != self.cfg.hidden_size:
            raise ValueError(f"draft hidden size {self.cfg.hidden_size} does not match the target's "
                             f"embedding {tuple(embed.shape)} / LM head {tuple(lm_head.shape)}")
        # in the draft's own dtype and device: the engine's draft shares its target's tensors (the same
        # dtype and device, so `to` returns them and a push updates them in place); a learner's fp32
        # draft gets fp32 copies of a bf16 policy's
        self.embed, self.lm_head = (t.detach().to(self.fc.device, self.fc.dtype) for t in (embed, lm_head))

    def features(self, hidden: Tensor, next_tokens: Tensor, positions: Tensor, mask: Tensor | None,
                 kv: KVFn) -> Tensor:
        """hidden [B, n, H] at positions t, next_tokens [B, n] (token t+1) -> predicted h_{t+1} [B, n, H]."""
        weights = {"fc": self.fc, **self.layer} | (self.packed or {})
        x = linear(torch.cat([F.embedding(next_tokens, self.embed), hidden], dim=-1), weights["fc"])
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        return decoder_layer(x, weights, self.layout, cos, sin, mask, kv)

    def logits(self, features: Tensor) -> Tensor:
        return rms_norm(features, self.norm, self.eps) @ self.lm_head.T

    def forward(self, hidden: Tensor, next_tokens: Tensor) -> Tensor:
        """Teacher-forced training forward over whole sequences (causal, positions 0..n-1)."""
        positions = torch.arange(hidden.shape[1], device=hidden.device).expand(hidden.shape[0], -1)
        return self.features(hidden, next_tokens, positions, None, lambda k, v: (k, v))

    # -- files: safetensors + a small config next to the policy --------------------------------
    def save(self, directory: str | Path, extra: dict | None = None) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}, str(d / DRAFT_WEIGHTS))
        meta = {"architecture": "eagle-1-layer", "hidden_size": self.cfg.hidden_size,
                "vocab_size": self.cfg.vocab_size} | (extra or {})
        (d / DRAFT_CONFIG).write_text(json.dumps(meta, indent=2))

    @classmethod
    def load(cls, directory: str | Path, target_cfg: PretrainedConfig, max_len: int = 1024) -> DraftHead:
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
