"""sglang/srt/sampling/sampling_params.py: the per-request sampling parameters the emulation models."""

from dataclasses import dataclass
from typing import Optional, Set

TOP_K_ALL = 1 << 30


@dataclass
class SamplingParams:
    max_new_tokens: Optional[int] = 128
    stop_token_ids: Optional[Set[int]] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    ignore_eos: bool = False
    sampling_seed: Optional[int] = None

    def __post_init__(self):
        if self.stop_token_ids:  # sampling_params.py:201-205
            filtered = {int(t) for t in self.stop_token_ids if t is not None}
            self.stop_token_ids = filtered or None
        else:
            self.stop_token_ids = None
        if 0 <= self.temperature < 1e-6:  # greedy: top_k 1
            self.temperature = 1.0
            self.top_k = 1
        if self.top_k == -1:
            self.top_k = TOP_K_ALL

    def verify(self, vocab_size):
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 1 or self.top_k == -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.")
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
        if self.sampling_seed is not None and not -(2**63) <= self.sampling_seed <= 2**63 - 1:
            raise ValueError(f"sampling_seed must be in [-2**63, 2**63 - 1], got {self.sampling_seed}.")
