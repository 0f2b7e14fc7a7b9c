"""Weight updates and the memory saver in the emulated scheduler: update sessions with selectors, one
payload per TP rank, loading by name and shape (a mixture of experts' experts one tensor per expert, as
SGLang's loader maps them), the cache flush; release and resume with tags."""

from __future__ import annotations

import re

import torch

from .common import ALL_TAGS, EmulationError, _IPC


_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def checkpoint_names(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a push may name, each a view of the model's own storage to load into: Hugging Face's
    names, but transformers 5's stacked experts (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj`
    [E, H, I]) as a checkpoint names them, expert j's `gate_proj.weight` / `up_proj.weight` (the first /
    second half of `gate_up_proj[j]`) and `down_proj.weight`: the only expert names SGLang's Qwen3-MoE
    `load_weights` maps (FusedMoE.make_expert_params_mapping; a stacked name matches none and is skipped:
    tests/test_sglang_conformance.py runs that loader)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        match = _STACKED.match(name)
        if match is None:
            out[name] = t
            continue
        prefix, kind = match.groups()
        for j in range(t.shape[0]):
            if kind == "down_proj":
                out[f"{prefix}.{j}.down_proj.weight"] = t[j]
            else:
                gate, up = t[j].chunk(2, dim=0)
                out[f"{prefix}.{j}.gate_proj.weight"], out[f"{prefix}.{j}.up_proj.weight"] = gate, up
    return out


class Weights:
    """The scheduler's weight updater and memory saver (a mixin of `Scheduler`, whose state it reads
    and sets)."""

    # -- weights ------------------------------------------------------------------------------
    def begin(self, selector: str) -> tuple[bool, str]:
        self.calls.append(f"begin_weight_update({selector})")
        if selector not in ("target", "draft", "all"):
            raise ValueError(f"invalid selector {selector!r}; expected 'target', 'draft', or 'all'")
        if self.session is not None:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session, self.session_loaded = selector, False
        return True, "Success"

    def end(self) -> tuple[bool, str]:
        self.calls.append("end_weight_update")
        if self.session is None:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session = None
        return True, "Success"

    def update_from_tensor(self, req) -> tuple[bool, str]:
        self.calls.append(f"update_weights_from_tensor({req.selector})")
        if self.session is None:
            return False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
        if "weights" in self.offloaded:
            raise EmulationError("weights loaded into released memory (resume_memory_occupation(['weights']) first)")
        payloads = req.serialized_named_tensors
        per_rank = []
        for rank in range(self.tp):
            if rank >= len(payloads):
                raise EmulationError(f"IndexError: tensor-parallel rank {rank} has no payload ({len(payloads)} sent)")
            per_rank.append(_IPC.deserialize(payloads[rank]))
        named = per_rank[0]
        roles = {"all": ("target", "draft"), "target": ("target",), "draft": ("draft",)}[req.selector]
        if "target" in roles:
            for name, t in named:
                if name not in self.names:
                    raise EmulationError(f"KeyError: {name!r} (the target model has no such parameter)")
                if tuple(t.shape) != self.names[name]:
                    raise EmulationError(f"{name}: shape {tuple(t.shape)}, the model's is {self.names[name]}")
            with torch.no_grad():
                for name, t in named:
                    self.targets[name].copy_(t)
                    self.garbage.discard(name)
            self.generation += 1
        if "draft" in roles and self.draft is not None:
            self._load_draft(named)
        if req.weight_version is not None:
            self.weight_version = req.weight_version
        if req.flush_cache:
            self.flush()
        return True, "Success"

    def flush(self) -> bool:
        self.calls.append("flush_cache")
        self.cache.clear()
        return True

    # -- memory saver ---------------------------------------------------------------------------
    def release(self, tags: list[str] | None) -> None:
        tags = list(tags) if tags else list(ALL_TAGS)
        self.calls.append(f"release_memory_occupation({','.join(tags)})")
        self.offloaded |= set(tags)
        if "kv_cache" in tags:
            self.flush()

    def resume(self, tags: list[str] | None) -> None:
        tags = list(tags) if tags else list(ALL_TAGS)
        self.calls.append(f"resume_memory_occupation({','.join(tags)})")
        for tag in tags:
            if tag not in self.offloaded:
                raise EmulationError(f"KeyError: {tag!r} (resume_memory_occupation of memory that was not released)")
            self.offloaded.remove(tag)
        if "weights" in tags and self.args.enable_memory_saver:
            if not self.args.enable_weights_cpu_backup:
                self.garbage = set(self.names)
            if self.draft is not None and not (self.args.enable_draft_weights_cpu_backup or self.args.enable_weights_cpu_backup):
                self.draft_garbage = set(self.draft_names)
