"""Weight updates and the memory saver in the emulated scheduler: update sessions with selectors, one
payload per TP rank, loading by name and shape, the cache flush; release and resume with tags."""

from __future__ import annotations

import torch

from .common import ALL_TAGS, EmulationError, _IPC


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
                state = self.model.state_dict()
                for name, t in named:
                    state[name].copy_(t)
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
