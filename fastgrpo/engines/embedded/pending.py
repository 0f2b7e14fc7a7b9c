"""The target's states a draft has not consumed yet (`PendingStates`): what a speculative step's catch-up
feeds the draft, kept per cache row in a ring of the draft's window."""

from __future__ import annotations

from collections import deque

import torch
from torch import Tensor

from fastgrpo.engines.embedded.constants import arange


class PendingStates:
    """Target states the draft has not consumed yet, per cache row: the state at position p, and the
    token that follows it, in slot p % window. A row keeps only its last `window` states, all a
    catch-up ever feeds. A plain step only appends its states to a list (`defer`): they are written
    in one batch when they are needed or the rows change (`flush`), so the plain steps `aware` takes
    cost what plain decoding costs."""

    def __init__(self, rows: int, window: int, hidden_size: int, dtype: torch.dtype = torch.float32):
        self.window = window
        self.hidden = torch.zeros(rows, window, hidden_size, dtype=dtype)  # the target's states, in its dtype
        self.next_token = torch.zeros(rows, window, dtype=torch.long)
        # plain steps not yet written, oldest first: (states [B, H], next tokens) of rows 0..B-1
        self._deferred: deque[tuple[Tensor, list[int]]] = deque(maxlen=window)

    def put(self, rows: Tensor, positions: Tensor, hidden: Tensor, next_token: Tensor) -> None:
        """Write state i to (rows[i], positions[i] % window); a flat index_copy_ is the cheapest such write."""
        flat = rows * self.window + positions % self.window
        self.hidden.view(-1, self.hidden.shape[-1]).index_copy_(0, flat, hidden)
        self.next_token.view(-1).index_copy_(0, flat, next_token)

    def defer(self, hidden: Tensor, next_token: list[int]) -> None:
        """A plain step's states of rows 0..B-1 (a view of the forward's output, never written to)."""
        self._deferred.append((hidden, next_token))

    def discard(self) -> None:
        """Drop the deferred steps unwritten (a new call: their rows hold other sequences now)."""
        self._deferred.clear()

    def flush(self, lengths: Tensor) -> None:
        """Write the deferred steps, given the rows' cache lengths now: the last deferred step's states
        are at positions lengths - 1 (no row changed since: the engine flushes before any change)."""
        if not self._deferred:
            return
        k, B = len(self._deferred), len(self._deferred[0][1])
        hidden = torch.stack([h for h, _ in self._deferred], 1)  # [B, k, H]
        tokens = torch.tensor([t for _, t in self._deferred]).T  # [B, k]
        positions = lengths[:B, None] - k + torch.arange(k)
        rows = torch.arange(B)[:, None].expand(B, k)
        self.put(rows.reshape(-1), positions.reshape(-1), hidden.reshape(B * k, -1), tokens.reshape(-1))
        self.discard()

    def take(self, start: Tensor, width: int) -> tuple[Tensor, Tensor]:
        """States at positions start[b] .. start[b] + width - 1 of rows 0..B-1 (entries past a row's
        last state are stale and must be treated as padding; width is at most the window)."""
        rows = arange(len(start), start.device)[:, None]
        slots = (start[:, None] + arange(width, start.device)) % self.window
        return self.hidden[rows, slots], self.next_token[rows, slots]

    def move_row(self, src: int, dst: int) -> None:
        self.hidden[dst] = self.hidden[src]
        self.next_token[dst] = self.next_token[src]
