"""The draft head's side that runs no kernel: the policy tensors it shares and collects from a weight push
(`TargetTensors`), and its export as SGLang's EAGLE draft (names, config, files). Its files' names and
place are `fastgrpo.paths` (DRAFT_WEIGHTS, draft_dir).

Why here, in `fastgrpo/models/`, and not in an engine: every side of the draft uses these parts. The
draft learners (`fastgrpo/draft_learning/`) collect the target tensors; the SGLang adapter swaps the
draft in SGLang's names; checkpoint conversion exports it; none of them should import the embedded
engine for that. The head itself (`DraftHead`, `draft_loss`: engines/embedded/draft.py) computes its
layer with the embedded engine's decoder layer (engines/embedded/model.py `decoder_layer`, the layout
of engines/embedded/families.py), so it stays beside those kernels until they move here too.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor


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
