"""The EAGLE-style draft head (docs/speculation.md), every side of it: the head and its loss
(`DraftHead`, `draft_loss`), the policy tensors it shares and collects from a weight push
(`TargetTensors`), and its export as SGLang's EAGLE draft (names, config, files).

At position t the draft fuses the target's final hidden state h_t with the embedding of token t+1,
runs one decoder layer (attending over its own earlier positions), and predicts h_{t+1}; the target's
frozen LM head turns that prediction into a distribution over token t+2. Feeding its own predicted
state back in lets it draft several tokens ahead from a single target forward.

The embedding and LM head are the target's, shared and never trained or saved with the draft. Its
layer is computed by the decoder layer the embedded engine runs too (`layers.py`), so the draft
learners, the SGLang adapter and checkpoint conversion use the draft without importing an engine. Its
files' names and place are `fastgrpo.paths` (DRAFT_WEIGHTS, draft_dir).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import PretrainedConfig

from fastgrpo.models.layers import EAGER, KVFn, PackedWeight, Pointwise, decoder_layer, linear, onednn_available
from fastgrpo.models.layouts import dense_layer
from fastgrpo.models.rope import rope_tables
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
                 kv: KVFn, ops: Pointwise = EAGER) -> Tensor:
        """hidden [B, n, H] at positions t, next_tokens [B, n] (token t+1) -> predicted h_{t+1} [B, n, H].
        `ops`: how the layer's pointwise regions run (fused in an engine's static steps)."""
        weights = {"fc": self.fc, **self.layer} | (self.packed or {})
        x = linear(torch.cat([F.embedding(next_tokens, self.embed), hidden], dim=-1), weights["fc"])
        cos, sin = self.cos[positions][:, :, None], self.sin[positions][:, :, None]  # [B, n, 1, D]
        return decoder_layer(x, weights, self.layout, cos, sin, mask, kv, ops=ops)

    def logits(self, features: Tensor, ops: Pointwise = EAGER) -> Tensor:
        return ops.norm(features, self.norm, self.eps) @ self.lm_head.T

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


def draft_loss(draft: DraftHead, hidden: Tensor, tokens: Tensor, mask: Tensor, hidden_weight: float = 1.0,
               token_weight: float = 0.1, unroll: int = 1) -> tuple[Tensor, dict[str, float]]:
    """EAGLE's loss on target states: SmoothL1 to h_{t+1} plus cross-entropy to the target's distribution.

    hidden [B, T, H]: the target's final hidden states; tokens [B, T]; mask [B, T]: positions to learn
    from. Position t predicts h_{t+1} (and so token t+2); it is trained when t and t+1 are both masked in.

    `unroll` > 1 trains what a depth-j tree node sees (training-time test: EAGLE-3, arXiv 2503.01840;
    HASS, arXiv 2408.15766). A node at depth j >= 2 is fed the state its parent predicted, not the
    target's, and attends over the target-fed positions before its chain plus its own ancestors, which
    were fed predictions too. Step j does the same for every position at once: its input at position p is
    step j-1's prediction there (made at p - 1), and it attends over step 1's keys up to p - j + 1 and step
    i's key at p - (j - i) for each i in 2..j (`unroll_mask`). The tokens stay the sampled ones: a drafted
    token counts only where it equals them. The loss is the mean of the steps' losses, gradients flowing
    through the chain; the metrics without a suffix are step 1's (the teacher-forced figures), and
    `draft_top1_<j>` is step j's top-1.
    """
    if unroll < 1:
        raise ValueError(f"unroll must be >= 1, got {unroll}")
    target, m = hidden[:, 1:], (mask[:, :-1] & mask[:, 1:]).float()
    with torch.no_grad():
        target_logp = torch.log_softmax(target @ draft.lm_head.T, dim=-1)
    total, metrics = hidden.new_zeros(()), {}
    for j, pred in enumerate(unrolled_states(draft, hidden, tokens, unroll), start=1):
        mj = m if j == 1 else m * (torch.arange(m.shape[1], device=m.device) >= j - 1)  # a whole chain inside
        count = mj.sum().clamp(min=1)
        reg = (F.smooth_l1_loss(pred, target, reduction="none").mean(-1) * mj).sum() / count
        draft_logp = torch.log_softmax(draft.logits(pred), dim=-1)
        ce = (-(target_logp.exp() * draft_logp).sum(-1) * mj).sum() / count
        top1 = ((draft_logp.argmax(-1) == target_logp.argmax(-1)).float() * mj).sum() / count
        total = total + (hidden_weight * reg + token_weight * ce) / unroll
        if j == 1:
            metrics = {"draft_hidden_l1": reg.item(), "draft_ce": ce.item(), "draft_top1": top1.item()}
        else:
            metrics[f"draft_top1_{j}"] = top1.item()
    return total, metrics | {"draft_loss": total.item()}


def unrolled_states(draft: DraftHead, hidden: Tensor, tokens: Tensor, unroll: int) -> list[Tensor]:
    """The draft's predicted states [B, T - 1, H] at steps 1..unroll (`draft_loss`): step 1 teacher-forced
    (position p fed h_p and token p + 1), step j fed step j - 1's prediction made at p - 1. A step's
    positions before j - 1 have no whole chain (their inputs include a placeholder) and mean nothing."""
    inputs, next_tokens = hidden[:, :-1], tokens[:, 1:]
    n = inputs.shape[1]
    positions = torch.arange(n, device=hidden.device).expand(hidden.shape[0], -1)
    keys: list[Tensor] = []
    values: list[Tensor] = []

    def kv(k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:  # every step's keys side by side
        keys.append(k)
        values.append(v)
        return torch.cat(keys, dim=2), torch.cat(values, dim=2)

    states = []
    for j in range(1, unroll + 1):
        pred = draft.features(inputs, next_tokens, positions, None if j == 1 else unroll_mask(n, j, hidden.device), kv)
        states.append(pred)
        inputs = torch.cat([inputs[:, :1], pred[:, :-1]], dim=1)  # position 0's placeholder: its own input
    return states


def unroll_mask(n: int, step: int, device: torch.device | str) -> Tensor:
    """Unrolled step `step`'s attention [1, 1, n, step n] (True: attended) over the keys of steps 1..step
    side by side: query p reads step 1's keys up to p - step + 1 and step i's key at p - (step - i)."""
    p = torch.arange(n, device=device)[:, None]
    c = torch.arange(n, device=device)[None, :]
    blocks = [c <= p - step + 1] + [c == p - (step - i) for i in range(2, step + 1)]
    return torch.cat(blocks, dim=1)[None, None]


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



# The EAGLE draft SGLang loads (`speculative_algorithm=EAGLE`, `speculative_draft_model_path`, and a draft
# swap through `update_weights_from_tensor(selector="draft")`): `LlamaForCausalLMEagle` of
# python/sglang/srt/models/llama_eagle.py, read in sglang 0.5.23 (the version pyproject pins). Its
# `load_weights` prefixes every name without "lm_head" with "model." and hands it to SGLang's Llama loader
# (which stacks q/k/v and gate/up itself); its model is `fc` (nn.Linear(2 * hidden, hidden), with a bias)
# over [embedding; target hidden state], then Llama decoder layers of which layer 0 has no input norm, and
# no final norm. The embedding and LM head are the target's, as here.
SGLANG_EAGLE_ARCHITECTURE = "LlamaForCausalLMEagle"
SGLANG_DROPPED_NORMS = ("layer.attn_norm", "norm")  # ours; SGLang's EAGLE Llama has no place for them


def sglang_eagle_tensors(weights: dict[str, Tensor], target_cfg) -> tuple[dict[str, Tensor], list[str]]:
    """Our draft's tensors under SGLang's EAGLE Llama names, and which of our norms that class cannot
    hold (those that are not identities, plus the final norm, whose normalisation itself has no place
    there). Without them the draft SGLang runs computes another function: verification keeps sampling
    lossless, acceptance may drop."""
    c = target_cfg
    h = c.hidden_size
    d = getattr(c, "head_dim", None) or h // c.num_attention_heads
    q_rows, kv_rows = c.num_attention_heads * d, c.num_key_value_heads * d
    expected = {"fc": (h, 2 * h), "layer.wqkv": (q_rows + 2 * kv_rows, h), "layer.wo": (h, q_rows),
                "layer.w_gate_up": (2 * c.intermediate_size, h), "layer.w_down": (h, c.intermediate_size),
                "layer.attn_norm": (h,), "layer.mlp_norm": (h,), "norm": (h,)}
    got = {k: tuple(v.shape) for k, v in weights.items()}
    if got != expected:
        raise ValueError(f"the draft does not fit the target (draft tensors {got}, expected {expected})")
    w = weights
    dropped = sorted({"norm"} | {n for n in SGLANG_DROPPED_NORMS if not torch.equal(w[n], torch.ones_like(w[n]))})
    q, k, v = w["layer.wqkv"].split([q_rows, kv_rows, kv_rows])
    gate, up = w["layer.w_gate_up"].chunk(2)
    return {"fc.weight": w["fc"], "fc.bias": torch.zeros(h, dtype=w["fc"].dtype),
            "layers.0.self_attn.q_proj.weight": q, "layers.0.self_attn.k_proj.weight": k,
            "layers.0.self_attn.v_proj.weight": v, "layers.0.self_attn.o_proj.weight": w["layer.wo"],
            "layers.0.mlp.gate_proj.weight": gate, "layers.0.mlp.up_proj.weight": up,
            "layers.0.mlp.down_proj.weight": w["layer.w_down"],
            "layers.0.post_attention_layernorm.weight": w["layer.mlp_norm"]}, dropped


def sglang_eagle_config(target_cfg, dtype: str) -> dict:
    """The config.json SGLang builds the EAGLE draft from: the target's shape and rope, one layer, an
    untied head (tied, SGLang's LlamaForCausalLMEagle makes lm_head the embedding and set_embed_and_head
    then deletes that one weight twice), and `dtype` (what transformers 5 reads; without it SGLang reads
    float32 and runs the draft in float16 beside a bfloat16 target)."""
    raw = target_cfg.to_dict()
    cfg = {k: v for k, v in raw.items() if k in (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
        "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings", "hidden_act",
        "bos_token_id", "eos_token_id") and v is not None}
    return cfg | dict(architectures=[SGLANG_EAGLE_ARCHITECTURE], model_type="llama", num_hidden_layers=1,
                      attention_bias=False, mlp_bias=False, hidden_act=raw.get("hidden_act", "silu"),
                      tie_word_embeddings=False, dtype=dtype)


def export_sglang_eagle(draft_path: str | Path, target_cfg, out: str | Path, dtype: str) -> list[str]:
    """Our draft at `draft_path` (its safetensors file) as an SGLang EAGLE draft directory (weights in
    `dtype` + config.json); returns the norms it leaves out (see `sglang_eagle_tensors`)."""
    tensors, dropped = sglang_eagle_tensors(load_file(str(draft_path)), target_cfg)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch_dtype = getattr(torch, dtype)
    save_file({k: v.to(torch_dtype).contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(sglang_eagle_config(target_cfg, dtype), indent=2))
    return dropped
