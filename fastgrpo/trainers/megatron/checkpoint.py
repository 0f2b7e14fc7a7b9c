"""What the Megatron trainer's checkpoints need beside megatron-core's dist_checkpointing: the identity of
the model a checkpoint holds (`fastgrpo.json`, written by the trainer and the conversion tools, checked on
load), and the async writer's result server, started with the trainer so that a job's SIGTERM cannot
kill it mid-checkpoint."""

from __future__ import annotations

import multiprocessing
import os

from fastgrpo.process_exit import serve_for
from fastgrpo.trainers.megatron.layout import Layout

_write_results_manager = None  # see start_write_results_queue


def start_write_results_queue() -> None:
    """dist_checkpointing's torch_dist writer reports through a multiprocessing Manager that it starts
    at the first save and keeps (`filesystem_async._get_write_results_queue`). Slurm signals every
    process of a job, and a SIGTERM that killed that server would fail the very checkpoint the signal
    asks the ranks to write; started here first (when the trainer is built, not at the first save, so
    that a job's signal meets a running server), with SIGTERM ignored, it outlives the signal, and it
    ends with its rank (the kernel kills it when the rank dies, however: a SIGKILLed rank must not
    leave it behind)."""
    global _write_results_manager
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        from multiprocessing.managers import SyncManager

        # a SIGTERM that comes while the server starts, before its initializer ignores the signal, ends
        # it (a new process's mask and handlers are reset at exec): it is started again
        for attempt in range(3):
            _write_results_manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
            try:
                _write_results_manager.start(initializer=serve_for, initargs=(os.getpid(),))
                break
            except EOFError:
                if attempt == 2:
                    raise
        filesystem_async._results_queue = _write_results_manager.Queue()


def checkpoint_identity(hf_config, layout: Layout) -> dict:
    """The model a Megatron checkpoint holds, as `fastgrpo.json` records it (checked on load; written
    by the trainer and by the conversion tools)."""
    l = layout
    identity = {"model_type": hf_config.model_type, "layers": l.layers, "hidden": l.hidden, "heads": l.heads,
                "kv_heads": l.kv_heads, "head_dim": l.head_dim, "ffn": l.ffn, "vocab": l.vocab, "tied": l.tied,
                "qkv_bias": l.qkv_bias}
    if l.experts:  # (a dense model's identity is unchanged: its checkpoints keep loading)
        identity.update(experts=l.experts, topk=l.top_k, moe_ffn=l.expert_ffn)  # the keys checkpoints hold
    return identity


def saved_at(layout: Layout, data: int) -> dict:
    """The layout a Megatron checkpoint was written at, as `fastgrpo.json` records it: tensor, pipeline,
    expert and data-parallel sizes, and for a mixture of experts the experts' tensor-parallel size
    (`expert_tensor`: a converter reads the stored pieces by it, and a distributed optimizer's state
    reloads only at the same one). A dense model's record is unchanged (no `expert_tensor`); a record
    without it is of experts split over TP."""
    at = {"tensor": layout.tensor, "pipeline": layout.pipeline, "expert": layout.expert, "data": data}
    if layout.experts:
        at["expert_tensor"] = layout.expert_tp
    return at
