"""The data every side shares: what an engine is asked (sampling parameters, requests), what it
answers (completions) and reports of its last rollout (`EngineStats`), and what a policy trainer
receives (the rollout batch).

Engines, trainers, the draft learners and the loop all import these from here and nothing from
each other, so that a second engine (SGLang) or trainer (Megatron) plugs in without dragging the
first one along.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypedDict

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 256
    ignore_eos: bool = False  # benchmarks: keep every sequence running for exactly max_new_tokens

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @classmethod
    def of(cls, rollout) -> SamplingParams:
        """The sampling a run's `rollout` config section asks for (rollout and eval both use it)."""
        return cls(temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                   max_new_tokens=rollout.max_new_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]
    max_new_tokens: int | None = None  # None: the sampling params' limit
    # the request's sampling key (with the call's seed it keys every random draw of the request); None:
    # its index in the call. Keys that follow a request across engines make where it runs irrelevant.
    key: int | None = None

    def check(self, index: int, max_context: int, vocab_size: int) -> None:
        """What every engine refuses before any work (the engine contract suite holds them to it)."""
        if not self.prompt_ids:
            raise ValueError(f"request {index}: empty prompt")
        if len(self.prompt_ids) >= max_context:
            raise ValueError(f"request {index}: prompt of {len(self.prompt_ids)} tokens leaves no room in the "
                             f"context of {max_context}")
        if min(self.prompt_ids) < 0 or max(self.prompt_ids) >= vocab_size:
            raise ValueError(f"request {index}: token ids outside the vocabulary of {vocab_size}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"request {index}: max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.key is not None and self.key < 0:
            raise ValueError(f"request {index}: key must be >= 0, got {self.key}")


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # of the sampling distribution, one per token
    finish_reason: str  # "stop" (EOS), "length" (max_new_tokens), "context" (context full)
    spec: dict[str, float] = field(default_factory=dict)  # speculation statistics
    # with capture on: the target's final hidden states at positions 0..T-2 of prompt + response, taken
    # from the forwards that rollout ran anyway; hidden[t] is the state after reading token t
    hidden: Tensor | None = None
    # when top-k or top-p cut the distribution: for each token, the ids of the set it was sampled from
    # (the trainer scores in that set, not in one it recomputes from its own, slightly different logits)
    sample_sets: list[list[int]] | None = None
    # a mixture of experts with routing recorded: the experts each position of prompt + response ran,
    # [T, sparse layers, k] int16 (the last token, sampled but never run: -1); None: not recorded
    routing: Tensor | None = None


@dataclass(frozen=True)
class Placement:
    """Where a policy rank sits: its data-parallel replica, and whether it leads it (tensor rank 0
    of pipeline stage 0: the rank beside which the replica's rollout engine runs)."""

    replica: int = 0
    replicas: int = 1
    leads_replica: bool = True


class EngineStats(TypedDict, total=False):
    """What `Engine.stats()` reports of the engine's last generate() call (the embedded engine and the
    SGLang adapter alike, unless noted); before the first call only the two versions are there."""

    weights_version: int | None  # the policy version the engine holds; None while a push is under way
    draft_version: int  # the draft version the engine speculates with (-1: the one it was built with)
    sequences: int  # completions returned
    tokens: int  # tokens generated, over all sequences
    seconds: float  # the call's wall time
    tokens_per_s: float  # tokens / seconds
    decode_steps: int  # target forwards after prefill (SGLang: its verify steps, or tokens without speculation)
    mean_running: float  # sequences running per decode step, on average (SGLang: 0.0, not measured)
    prefill_s: float  # embedded only: seconds in prompt prefill
    decode_s: float  # embedded only: seconds in decode steps
    spec_steps: int  # decode steps that speculated (verified a draft tree)
    spec_seq_steps: int  # sequence-steps that speculated (a speculative step of B rows counts B)
    spec_emitted: int  # tokens emitted by speculative sequence-steps (accepted draft tokens + 1 each)
    accept_len: float  # spec_emitted / spec_seq_steps (1.0 when nothing speculated)
    # embedded only, drafts from the suffix index (speculation.drafts index | hybrid): seconds in its
    # lookups and inserts, seconds building and calibrating merged trees, lookups, lookups that matched,
    # accepted tokens it proposed, and per speculative step its running rows and those host seconds
    index_s: float
    merge_s: float
    index_lookups: int
    index_matched: int
    index_accepted: int
    # (a static step's share of those seconds that ran while its learned draft's step computed, third)
    host_steps: list[tuple[int, float, float]]
    # embedded only: the host seconds of the speculation policy's `choose` (with the rows' tokens left it is
    # told) and `observe`, on every decode step's path: what an adaptive policy costs beside a fixed one
    policy_s: float
    # static steps: the host seconds of the policy's `ahead` (run while the device computes the step) and of
    # the wait on the device after it (a wait left: the steps outlasted `ahead`; the CPU: 0; SGLang: absent)
    ahead_s: float
    wait_s: float
    # embedded only: seconds of the call's steps that captured a CUDA graph (each an eager run of the step
    # and its recording; a key's first use, once per engine; 0 where nothing is captured)
    capture_s: float
    # embedded only: decode steps run as static steps (a graph's replay or capture on a GPU); the token slots
    # decode steps' target forwards computed (rows x tokens a row), those in padded rows (static steps run
    # their batch's bucket), and their share; the cache positions their attention read (rows x positions),
    # those the running rows needed (each its own length and new tokens), and the share read beyond (padded
    # rows, rows shorter than the longest, the context bucket's rounding)
    static_steps: int
    token_slots: int
    padded_slots: int
    pad_row_share: float
    positions_read: int
    positions_needed: int
    pad_kv_share: float
    config_by_concurrency: dict[str, dict[str, int]]  # steps per chosen tree shape, by concurrency bucket (SGLang: {})
    trace: list[tuple[int, str, int, float]]  # per decode step: running, shape name, emitted, seconds (SGLang: [])


def padding_shares(slots: int, padded: int, read: int, needed: int) -> dict[str, float]:
    """EngineStats' `pad_row_share` and `pad_kv_share` from their counts: padded token slots over all, and the
    cache positions read beyond the rows' own over all read (0 where nothing was counted)."""
    return {"pad_row_share": padded / slots if slots else 0.0, "pad_kv_share": 1 - needed / read if read else 0.0}


@dataclass
class RolloutBatch:
    """What a policy trainer receives from one rollout: plain tensors, rows in group order (the G
    samples of a prompt are adjacent), so that it can be split across data-parallel ranks by group
    (`shard`) and sent whole to tensor/pipeline peers (a dataclass of CPU tensors: one
    `broadcast_object_list`).

    Per-position tensors are [N, L]; a value at position t belongs to token t (predicted from t-1).
    """

    input_ids: Tensor  # prompt + response, right-padded
    attention_mask: Tensor  # 1 on real tokens
    response_mask: Tensor  # 1 on response tokens (the ones trained)
    engine_logprobs: Tensor  # the engine's sampling log-probabilities of the response tokens
    advantages: Tensor  # [N]
    # [N, L, K] token ids of the set each response token was sampled from, -1 padded (every entry -1 at
    # positions that are no sampled token); None when nothing cut the distribution (no top-k / top-p)
    sample_sets: Tensor | None = None
    # [N, L, sparse layers, k] int16: a mixture of experts' experts each position ran in rollout (its
    # input token's), -1 where nothing was recorded; None: not recorded (models/routing.py)
    routing: Tensor | None = None

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx: Tensor | list[int]) -> RolloutBatch:
        """Rows `idx`, trimmed to their longest sequence (saves compute on short micro-batches)."""
        idx = torch.as_tensor(idx, dtype=torch.long, device=self.input_ids.device)
        width = int(self.attention_mask[idx].sum(-1).max())
        return RolloutBatch(
            self.input_ids[idx, :width], self.attention_mask[idx, :width], self.response_mask[idx, :width],
            self.engine_logprobs[idx, :width], self.advantages[idx],
            None if self.sample_sets is None else self.sample_sets[idx, :width],
            None if self.routing is None else self.routing[idx, :width],
        )

    def to(self, device: torch.device | str) -> RolloutBatch:
        """The same rows on `device` (a no-op where they are already)."""
        return RolloutBatch(*(None if t is None else t.to(device, non_blocking=True) for t in (
            self.input_ids, self.attention_mask, self.response_mask, self.engine_logprobs, self.advantages,
            self.sample_sets, self.routing)))

    def shard(self, rank: int, world: int, group_size: int) -> RolloutBatch:
        """This data-parallel rank's share: whole groups, as even as the group count allows (ranks
        differ by at most one group). A loss normalised over the whole batch needs the total token
        count, which each rank gets by an all-reduce, not from its shard."""
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside a data-parallel world of {world}")
        if group_size < 1 or self.size % group_size:
            raise ValueError(f"{self.size} rows do not split into groups of {group_size}")
        groups = self.size // group_size
        if groups < world:
            raise ValueError(f"{groups} groups cannot be shared by {world} data-parallel ranks")
        first, last = (rank * groups) // world, ((rank + 1) * groups) // world
        return self.select(list(range(first * group_size, last * group_size)))
