"""Weight transfer from a policy trainer to rollout engines.

The trainer exports full tensors under Hugging Face names (a Megatron trainer gathers its TP
shards and broadcasts each pipeline stage's layers, one tensor at a time, on every rank of a
replica); the bridge groups them into size-bounded buckets so that a 70B push never materialises a
second full copy, stamps each push with a strictly increasing version, and ends it with a commit
carrying each tensor's checksum: a consumer checks what it received and only then serves the new
version. On ranks without a consumer the push still runs (the gathers are collective) and its
tensors are dropped as they pass.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from fastgrpo.protocols import WeightConsumer


def checksum(t: Tensor) -> int:
    """The sum of a tensor's 32-bit words (its bytes when the size is not a multiple of 4): any single
    changed word changes it, and it costs one pass over memory, cheap next to the transfer."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    words = flat.view(torch.int32) if flat.numel() % 4 == 0 else flat
    return int(words.sum(dtype=torch.int64))


@dataclass
class SyncReport:
    version: int
    tensors: int
    bytes: int
    buckets: int
    seconds: float


def buckets(named_tensors: Iterable[tuple[str, Tensor]], max_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    for name, t in named_tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


class WeightBridge:
    def __init__(self, consumers: list[WeightConsumer], bucket_bytes: int = 64 << 20):
        self.consumers = consumers  # the engines, and the draft learner (it shares the policy's embedding and head)
        self.bucket_bytes = bucket_bytes
        self.version = -1

    def push(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> SyncReport:
        if version <= self.version:
            raise ValueError(f"weight version {version} is not newer than the consumers' version {self.version}")
        t0 = time.perf_counter()
        n = nbytes = nb = 0
        sums: dict[str, int] = {}
        for bucket in buckets(named_tensors, self.bucket_bytes):
            for consumer in self.consumers:
                consumer.update_weights(bucket, version, complete=False)
            if self.consumers:
                sums.update((name, checksum(t)) for name, t in bucket)
            n += len(bucket)
            nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
            nb += 1
        for consumer in self.consumers:
            consumer.commit_weights(version, sums)
        self.version = version
        return SyncReport(version, n, nbytes, nb, time.perf_counter() - t0)
