"""Training the draft on target hidden states: a bounded buffer of states and the optimiser loop.

The same trainer serves the offline warm start (states from the target's forward over a corpus) and
online learning during RL (states that rollout's verification forwards computed anyway).
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from fastgrpo.models.draft import DraftHead, draft_loss


class DraftTrainer:
    """`data_parallel`: this trainer is one of the ranks of the default process group (the draft slice),
    each with a buffer of its own: every step averages the gradients of all of them, weighted by the
    positions each learned from, so their drafts stay identical; a rank with nothing buffered takes
    part with none. `unroll`: the draft's own predictions fed back this many steps (`draft_loss`)."""

    def __init__(self, draft: DraftHead, lr: float = 1e-3, max_tokens: int = 200_000, batch_size: int = 16,
                 seed: int = 0, data_parallel: bool = False, unroll: int = 1):
        self.draft = draft
        self.unroll = unroll
        self.device = next(draft.parameters()).device  # where it trains: batches are moved there
        self.data_parallel = data_parallel
        self.optimizer = torch.optim.AdamW(draft.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.max_tokens = max_tokens
        self.batch_size = batch_size
        self.buffer: deque[tuple[Tensor, Tensor, Tensor]] = deque()
        self.buffered_tokens = 0
        self.rng = random.Random(seed)
        self.steps = 0

    def add(self, hidden: Tensor, tokens: Tensor, mask: Tensor) -> None:
        """One sequence: hidden [T, H] target states, tokens [T], mask [T] (1 where the draft learns)."""
        if not (hidden.shape[0] == tokens.shape[0] == mask.shape[0]) or hidden.shape[0] < 2:
            raise ValueError("hidden, tokens and mask must describe the same sequence of >= 2 tokens")
        self.buffer.append((hidden.detach().float(), tokens.long(), mask.bool()))
        self.buffered_tokens += hidden.shape[0]
        while self.buffered_tokens > self.max_tokens and len(self.buffer) > 1:  # oldest states go first
            self.buffered_tokens -= self.buffer.popleft()[0].shape[0]

    def _batch(self) -> tuple[Tensor, Tensor, Tensor]:
        """A random batch of similar-length sequences (a window of 4x oversampled, length-sorted
        candidates): lengths are long-tailed, so plain random batches would be mostly padding."""
        n = min(self.batch_size, len(self.buffer))
        candidates = sorted(self.rng.sample(range(len(self.buffer)), min(4 * n, len(self.buffer))),
                            key=lambda i: self.buffer[i][0].shape[0])
        start = self.rng.randrange(len(candidates) - n + 1)
        return to_device(pad_states([self.buffer[i] for i in candidates[start: start + n]]), self.device)

    def step(self, hidden: Tensor | None, tokens: Tensor | None, mask: Tensor | None) -> dict[str, float]:
        """One optimiser step on a batch [B, T, ...] (None: a data-parallel rank with nothing buffered);
        a non-finite loss, on any rank, leaves the draft untouched."""
        self.draft.train()
        self.optimizer.zero_grad(set_to_none=True)
        metrics: dict[str, float] = {}
        finite, states = True, float(mask.sum()) if mask is not None else 0.0
        if hidden is not None:
            loss, metrics = draft_loss(self.draft, hidden, tokens, mask, unroll=self.unroll)
            finite = math.isfinite(loss.item())
            if finite:
                loss.backward()
        if self.data_parallel:
            finite, states = self._average_gradients(mask, finite, states)
        if not finite:
            return metrics | {"draft_skipped": 1.0}
        torch.nn.utils.clip_grad_norm_(self.draft.parameters(), 1.0)
        self.optimizer.step()
        self.steps += 1
        return metrics | {"draft_skipped": 0.0, "draft_states": states}  # states it learned from

    def _average_gradients(self, mask: Tensor | None, finite: bool, states: float) -> tuple[bool, float]:
        """Every rank's gradient of its mean loss, weighted by the positions that mean is over (the
        pairs `draft_loss` learns from), summed and divided by all of them: the gradient of the mean
        over the slice's batches. Returns whether every rank's loss was finite, and the states learned
        from on all ranks."""
        params = list(self.draft.parameters())
        pairs = float((mask[:, :-1] & mask[:, 1:]).sum()) if mask is not None and finite else 0.0
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) * pairs for p in params]
                         + [torch.tensor([pairs, float(not finite), states if finite else 0.0])])
        dist.all_reduce(flat)
        total, failed, states = flat[-3:].tolist()
        if failed or total == 0:
            return False, states
        offset = 0
        for p in params:
            p.grad = (flat[offset: offset + p.numel()] / total).view_as(p).clone()
            offset += p.numel()
        return True, states

    def _go_on(self, n: int, elapsed: float, max_steps: int, max_seconds: float) -> bool:
        """Another step? Not past `max_steps`, nor likely past the budget (by the mean step time so far),
        and with something buffered; data-parallel ranks decide together (any rank out of time ends the
        round; it goes on while any rank has states)."""
        if n >= max_steps:
            return False
        in_time = not (n and elapsed + elapsed / n > max_seconds)
        if not self.data_parallel:
            return bool(self.buffer) and in_time
        votes = torch.tensor([float(bool(self.buffer)), float(not in_time)])
        dist.all_reduce(votes)
        return votes[0].item() > 0 and votes[1].item() == 0

    def train(self, max_steps: int, max_seconds: float = math.inf) -> dict[str, float]:
        """Up to `max_steps` steps on the buffer within `max_seconds`: a step that would likely end past
        the budget (by the mean step time so far) is not started, so the budget holds; the first step
        always runs."""
        t0 = time.perf_counter()
        totals: dict[str, float] = {}
        n = 0
        while self._go_on(n, time.perf_counter() - t0, max_steps, max_seconds):
            for k, v in self.step(*(self._batch() if self.buffer else (None, None, None))).items():
                totals[k] = totals.get(k, 0.0) + v
            n += 1
        out = {k: v / max(n, 1) for k, v in totals.items()}
        seconds = time.perf_counter() - t0
        return out | {"draft_steps": float(n), "draft_train_s": seconds,
                      "draft_states_per_s": totals.get("draft_states", 0.0) / max(seconds, 1e-9)}

    def export(self) -> Iterator[tuple[str, Tensor]]:
        for name, t in self.draft.state_dict().items():
            yield name, t.detach()


@torch.no_grad()
def evaluate_draft(draft: DraftHead, items: list[tuple[Tensor, Tensor, Tensor]], unroll: int = 1) -> dict[str, float]:
    """The draft's loss and top-1 on sequences (hidden, tokens, mask) it has not trained on; with `unroll`,
    also its top-1 fed its own predictions (`draft_top1_<j>`)."""
    draft.eval()
    return draft_loss(draft, *to_device(pad_states(items), next(draft.parameters()).device), unroll=unroll)[1]


def to_device(batch: tuple[Tensor, Tensor, Tensor], device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """A padded batch moved to where the draft trains. The online learner buffers states in host memory
    (a GPU's memory is the rollout's), so on a GPU each step copies its one batch there, on purpose;
    on a CPU, or for a buffer already on the device (the warm start's), nothing moves."""
    return tuple(t.to(device, non_blocking=True) for t in batch)  # type: ignore[return-value]


def pad_states(items: list[tuple[Tensor, Tensor, Tensor]]) -> tuple[Tensor, Tensor, Tensor]:
    width = max(h.shape[0] for h, _, _ in items)
    H = items[0][0].shape[1]
    hidden = torch.zeros(len(items), width, H, device="cpu")  # assembled on the host; moved one batch at a time
    tokens = torch.zeros(len(items), width, dtype=torch.long, device="cpu")
    mask = torch.zeros(len(items), width, dtype=torch.bool, device="cpu")
    for i, (h, t, m) in enumerate(items):
        hidden[i, : h.shape[0]], tokens[i, : t.shape[0]], mask[i, : m.shape[0]] = h, t, m
    return hidden, tokens, mask
