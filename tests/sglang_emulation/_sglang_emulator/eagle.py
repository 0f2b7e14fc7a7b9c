"""EAGLE in the emulated scheduler: the exported draft read as SGLang reads it, the adaptive tiers and
the slot each decode step's padded batch size routes to, and a stand-in draft forward."""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from .common import DEFAULT_ADAPTIVE_CONFIG, EmulationError, resolve_dtype


@dataclass
class _Slot:  # AdaptiveStepSlot's attributes that fastgrpo's plugin touches
    candidate_steps: list[int]
    current_steps: int
    warmup_batches: float = 10


class _Namespace:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class Eagle:
    """The scheduler's EAGLE worker (a mixin of `Scheduler`, whose state it reads and sets)."""

    def _start_eagle(self, args) -> None:
        if self.algorithm != "EAGLE":
            raise EmulationError(f"the emulation runs EAGLE only, not {self.algorithm}")
        directory = Path(args.speculative_draft_model_path)
        cfg = json.loads((directory / "config.json").read_text())
        if cfg.get("architectures") != ["LlamaForCausalLMEagle"]:
            raise EmulationError(f"draft architectures {cfg.get('architectures')}: not LlamaForCausalLMEagle")
        if cfg.get("tie_word_embeddings", False):
            # models/llama_eagle.py: lm_head is embed_tokens; models/llama.py set_embed_and_head deletes
            # embed_tokens.weight, then lm_head.weight: the same parameter twice
            raise EmulationError("AttributeError: 'VocabParallelEmbedding' has no attribute 'weight' (the EAGLE "
                                 "draft config has tie_word_embeddings=true: set_embed_and_head deletes the shared "
                                 "weight twice)")
        self.draft_config = cfg
        self.draft_dtype = resolve_dtype(cfg, args.dtype)
        h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        d = cfg.get("head_dim") or h // heads
        ffn = cfg["intermediate_size"]
        self.draft_names = {
            "fc.weight": (h, 2 * h), "fc.bias": (h,),
            "layers.0.self_attn.q_proj.weight": (heads * d, h), "layers.0.self_attn.k_proj.weight": (kv * d, h),
            "layers.0.self_attn.v_proj.weight": (kv * d, h), "layers.0.self_attn.o_proj.weight": (h, heads * d),
            "layers.0.mlp.gate_proj.weight": (ffn, h), "layers.0.mlp.up_proj.weight": (ffn, h),
            "layers.0.mlp.down_proj.weight": (h, ffn), "layers.0.post_attention_layernorm.weight": (h,)}
        self.draft = {}
        self._load_draft(list(load_file(str(directory / "model.safetensors")).items()))
        if args.speculative_adaptive:
            if args.speculative_eagle_topk not in (None, 1):
                raise EmulationError("adaptive speculation runs chains only (speculative_eagle_topk 1)")
            if args.speculative_adaptive_config is not None:
                raw = json.loads(Path(args.speculative_adaptive_config).read_text())
                tiers = {}
                for key, entry in raw.items():
                    if not key.isdigit():
                        continue
                    steps = entry.get("candidate_steps")
                    if not isinstance(steps, list) or not steps or not all(isinstance(s, int) and s >= 0 for s in steps):
                        raise ValueError(f"BS {key}: candidate_steps must be a list of non-negative ints, got {steps!r}")
                    tiers[int(key)] = sorted(set(steps))
                if not tiers:
                    raise ValueError("speculative_adaptive_config must contain at least one integer-string BS key")
            else:
                tiers = {int(k): v for k, v in DEFAULT_ADAPTIVE_CONFIG.items()}
            self.tiers = dict(sorted(tiers.items()))
            every = sorted({s for steps in tiers.values() for s in steps})
            self.reserved = max(every) + 1  # topk 1 x num_steps <= max + 1 draft tokens
            # the adaptive controller on the EAGLE worker (eagle_worker_v2.py), one slot per key
            # (adaptive_spec_params.py): each starts at the server's num_steps (the middle of all
            # candidates) if it is one of its own, else at its own middle; the EMA is not emulated
            initial = every[len(every) // 2]
            slots = {k: _Slot(v, initial if initial in v else v[len(v) // 2]) for k, v in self.tiers.items()}
            self.draft_worker = _Namespace(adaptive_controller=_Namespace(params=_Namespace(_slots=slots)))
        else:
            steps, topk, tokens = args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens
            if steps is None:
                steps, topk, tokens = 5, 4, 8  # speculative_hook.py _auto_choose_speculative_params, Llama
            self.tiers = None
            self.static_steps = steps
            self.reserved = max(topk * steps, tokens)

    def _steps(self, batch: int) -> int:
        """The depth of a decode step of `batch` running requests: EAGLEWorkerV2 activates the state of
        the slot for `batch.seq_lens.shape[0]` before the step (speculative/eagle_worker_v2.py:1444-1445,
        1771-1773; adaptive_runtime_state.py:122-125), AdaptiveSpeculativeParams._route pads it to a
        captured CUDA-graph size, then takes the largest slot key not above that
        (adaptive_spec_params.py:342-358; the sizes set at start, eagle_worker_v2.py:1408-1413)."""
        if self.tiers is None:
            return self.static_steps
        sizes = self.capture_sizes
        i = bisect.bisect_left(sizes, batch)
        padded = sizes[i] if i < len(sizes) else batch
        keys = sorted(self.tiers)
        key = keys[max(0, bisect.bisect_right(keys, padded) - 1)]
        return self.draft_worker.adaptive_controller.params._slots[key].current_steps

    def _load_draft(self, named) -> None:
        for name, t in named:
            if name not in self.draft_names:
                raise EmulationError(f"KeyError: {name!r} (the EAGLE draft has no such parameter)")
            if tuple(t.shape) != self.draft_names[name]:
                raise EmulationError(f"draft {name}: shape {tuple(t.shape)}, the model's is {self.draft_names[name]}")
            self.draft[name] = t.detach().float().clone()
            self.draft_garbage.discard(name)

    def _propose(self, token: int, hidden: torch.Tensor, steps: int) -> list[int]:
        """A stand-in for EAGLE's draft forward (fc over [embedding; state], its MLP, the target's head)."""
        w = self.draft
        embed = self.model.get_input_embeddings().weight
        head = self.model.get_output_embeddings().weight
        out = []
        with torch.no_grad():
            for _ in range(steps):
                x = w["fc.weight"] @ torch.cat([embed[token], hidden]) + w["fc.bias"]
                n = x * torch.rsqrt(x.pow(2).mean() + 1e-6) * w["layers.0.post_attention_layernorm.weight"]
                x = x + w["layers.0.mlp.down_proj.weight"] @ (
                    torch.nn.functional.silu(w["layers.0.mlp.gate_proj.weight"] @ n) * (w["layers.0.mlp.up_proj.weight"] @ n))
                token = int((head @ x).argmax())
                hidden = x
                out.append(token)
        return out
