"""Weight transfer from a policy trainer to rollout engines.

The trainer exports full tensors under Hugging Face names (a Megatron trainer gathers its TP
shards and renames first); the bridge groups them into size-bounded buckets so that a 70B push
never materialises a second full copy, and stamps each push with a strictly increasing version.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from torch import Tensor

from fastgrpo.backends.protocols import WeightConsumer


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
        for bucket in buckets(named_tensors, self.bucket_bytes):
            for consumer in self.consumers:
                consumer.update_weights(bucket, version)
            n += len(bucket)
            nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
            nb += 1
        self.version = version
        return SyncReport(version, n, nbytes, nb, time.perf_counter() - t0)
