"""The embedded rollout engine: continuous batching over a static slot KV cache.

Requests wait in a queue; whenever rows are free, waiting prompts are prefilled together and join
the running batch; every step decodes one token for all running sequences; a finished sequence
leaves at once and the last running row is moved into its place, so the running batch is always
rows 0..B-1 of the cache.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from transformers import LlamaConfig

from fastgrpo.backends.protocols import Completion, Request
from fastgrpo.engine.model import InferenceModel, KVCache
from fastgrpo.engine.sampling import SamplingParams, sample, sampling_logprobs


@dataclass
class _Sequence:
    index: int  # position in the caller's request list
    prompt_len: int
    max_new: int
    pending: int = -1  # last sampled token, not yet in the cache
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None


class EmbeddedEngine:
    def __init__(self, cfg: LlamaConfig, max_batch: int, max_context: int, eos_id: int, pad_id: int = 0):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.cfg = cfg
        self.max_batch = max_batch
        self.max_context = max_context
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.model = InferenceModel(cfg, max_context)
        self.cache = KVCache(cfg, max_batch, max_context)
        self.weights_version = -1
        self._stats: dict[str, Any] = {}

    # -- weights --------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        self.model.load(named_tensors)
        self.weights_version = version

    def update_draft(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        raise NotImplementedError("the embedded engine has no draft model yet")

    def release_memory(self) -> None:
        """No-op on CPU: the KV cache stays allocated (SGLang frees GPU memory here for the trainer)."""

    def resume_memory(self) -> None:
        """No-op on CPU."""

    def stats(self) -> dict[str, Any]:
        return dict(self._stats)

    # -- generation -----------------------------------------------------------------------
    def generate(self, requests: list[Request], sampling: SamplingParams, seed: int = 0) -> list[Completion]:
        for i, r in enumerate(requests):
            if not r.prompt_ids:
                raise ValueError(f"request {i}: empty prompt")
            if len(r.prompt_ids) >= self.max_context:
                raise ValueError(f"request {i}: prompt of {len(r.prompt_ids)} tokens leaves no room in the "
                                 f"context of {self.max_context}")
            if min(r.prompt_ids) < 0 or max(r.prompt_ids) >= self.cfg.vocab_size:
                raise ValueError(f"request {i}: token ids outside the vocabulary of {self.cfg.vocab_size}")
            if r.max_new_tokens is not None and r.max_new_tokens < 1:
                raise ValueError(f"request {i}: max_new_tokens must be >= 1, got {r.max_new_tokens}")
        self.cache.lengths.zero_()
        gen = torch.Generator().manual_seed(seed)
        t0 = time.perf_counter()
        waiting = deque(range(len(requests)))
        running: list[_Sequence] = []
        done: dict[int, _Sequence] = {}
        forwards = decode_steps = batch_sum = 0
        while waiting or running:
            if waiting and len(running) < self.max_batch:
                joined = [waiting.popleft() for _ in range(min(len(waiting), self.max_batch - len(running)))]
                running += self._prefill(requests, joined, len(running), sampling, gen)
                forwards += 1
            else:
                self._decode(running, sampling, gen)
                forwards += 1
                decode_steps += 1
                batch_sum += len(running)
            self._retire(running, done)
        seconds = time.perf_counter() - t0
        out = [done[i] for i in range(len(requests))]
        tokens = sum(len(s.tokens) for s in out)
        self._stats = dict(sequences=len(out), tokens=tokens, seconds=seconds, forwards=forwards,
                           decode_steps=decode_steps, tokens_per_s=tokens / max(seconds, 1e-9),
                           mean_running=batch_sum / max(decode_steps, 1))
        return [Completion(s.tokens, s.logprobs, s.finish or "length") for s in out]

    def _prefill(self, requests: list[Request], joined: list[int], first_row: int,
                 sampling: SamplingParams, gen: torch.Generator) -> list[_Sequence]:
        """Prefill new prompts together (right-padded) into the rows after the running batch."""
        prompts = [requests[i].prompt_ids for i in joined]
        width = max(map(len, prompts))
        tokens = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        for r, p in enumerate(prompts):
            tokens[r, : len(p)] = torch.tensor(p)
        rows = slice(first_row, first_row + len(prompts))
        lens = torch.tensor([len(p) for p in prompts])
        self.cache.lengths[rows] = 0
        logits, _ = self.model.forward(tokens, self.cache, rows)
        self.cache.lengths[rows] = lens  # padding keys beyond a prompt's length are never visible
        last = logits[torch.arange(len(prompts)), lens - 1]
        seqs = []
        for i, p in zip(joined, prompts):
            limit = requests[i].max_new_tokens or sampling.max_new_tokens
            seqs.append(_Sequence(index=i, prompt_len=len(p), max_new=limit))
        self._emit(seqs, last, sampling, gen)
        return seqs

    def _decode(self, running: list[_Sequence], sampling: SamplingParams, gen: torch.Generator) -> None:
        rows = slice(0, len(running))
        tokens = torch.tensor([[s.pending] for s in running])
        logits, _ = self.model.forward(tokens, self.cache, rows)
        self.cache.lengths[rows] += 1
        self._emit(running, logits[:, 0], sampling, gen)

    def _emit(self, seqs: list[_Sequence], logits: Tensor, sampling: SamplingParams, gen: torch.Generator) -> None:
        logprobs = sampling_logprobs(logits, sampling)
        chosen = sample(logprobs, sampling, gen)
        chosen_lp = logprobs.gather(-1, chosen[:, None])[:, 0]
        for s, tok, lp in zip(seqs, chosen.tolist(), chosen_lp.tolist()):
            s.tokens.append(tok)
            s.logprobs.append(lp)
            s.pending = tok
            if tok == self.eos_id:
                s.finish = "stop"
            elif len(s.tokens) >= s.max_new:
                s.finish = "length"
            elif s.prompt_len + len(s.tokens) >= self.max_context:
                s.finish = "context"

    def _retire(self, running: list[_Sequence], done: dict[int, _Sequence]) -> None:
        """Remove finished sequences, moving the last running row into each freed row."""
        row = 0
        while row < len(running):
            if running[row].finish is None:
                row += 1
                continue
            done[running[row].index] = running[row]
            last = len(running) - 1
            if row != last:
                self.cache.move_row(last, row)
                running[row] = running[last]
            running.pop()
