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
from torch import Tensor

from fastgrpo.speculation.draft import DraftHead, draft_loss


class DraftTrainer:
    def __init__(self, draft: DraftHead, lr: float = 1e-3, max_tokens: int = 200_000, batch_size: int = 16,
                 seed: int = 0):
        self.draft = draft
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
        return pad_states([self.buffer[i] for i in candidates[start: start + n]])

    def step(self, hidden: Tensor, tokens: Tensor, mask: Tensor) -> dict[str, float]:
        """One optimiser step on a batch [B, T, ...]; a non-finite loss leaves the draft untouched."""
        self.draft.train()
        loss, metrics = draft_loss(self.draft, hidden, tokens, mask)
        self.optimizer.zero_grad(set_to_none=True)
        if not math.isfinite(loss.item()):
            return metrics | {"draft_skipped": 1.0}
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.draft.parameters(), 1.0)
        self.optimizer.step()
        self.steps += 1
        return metrics | {"draft_skipped": 0.0, "draft_states": float(mask.sum())}  # states it learned from

    def train(self, max_steps: int, max_seconds: float = math.inf) -> dict[str, float]:
        """Up to `max_steps` steps on the buffer within `max_seconds`: a step that would likely end past
        the budget (by the mean step time so far) is not started, so the budget holds; the first step
        always runs."""
        t0 = time.perf_counter()
        totals: dict[str, float] = {}
        n = 0
        while self.buffer and n < max_steps:
            elapsed = time.perf_counter() - t0
            if n and elapsed + elapsed / n > max_seconds:
                break
            for k, v in self.step(*self._batch()).items():
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
def evaluate_draft(draft: DraftHead, items: list[tuple[Tensor, Tensor, Tensor]]) -> dict[str, float]:
    """The draft's loss and top-1 on sequences (hidden, tokens, mask) it has not trained on."""
    draft.eval()
    return draft_loss(draft, *pad_states(items))[1]


def pad_states(items: list[tuple[Tensor, Tensor, Tensor]]) -> tuple[Tensor, Tensor, Tensor]:
    width = max(h.shape[0] for h, _, _ in items)
    H = items[0][0].shape[1]
    hidden = torch.zeros(len(items), width, H)
    tokens = torch.zeros(len(items), width, dtype=torch.long)
    mask = torch.zeros(len(items), width, dtype=torch.bool)
    for i, (h, t, m) in enumerate(items):
        hidden[i, : h.shape[0]], tokens[i, : t.shape[0]], mask[i, : m.shape[0]] = h, t, m
    return hidden, tokens, mask
