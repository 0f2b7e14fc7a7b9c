"""Measure what scoring a sequence's logits holds and costs, whole and in chunks (`trainer.logits_chunk_tokens`,
trainers/chunked_logprobs.py), on this machine's CPU: the peak of bytes allocated during forward + backward
(torch's profiler records every CPU allocation and free) and the median wall time, for the torch / DeepSpeed
trainers' scoring (`token_scores`) and Megatron's vocab-parallel one (`vocab_parallel_logprobs`, in a world of
one). Random hidden states [tokens, hidden] and output weight [vocab, hidden]; the loss is sum(log p) + 0.1
sum(entropy), so both gradients flow.

    python tools/logits_memory.py                                   # 4096 tokens, vocab 32768, hidden 64
    python tools/logits_memory.py --chunk 256 --chunk 1024 --top-k 50 --top-p 0.9
    python tools/logits_memory.py --dtype bf16 --tokens 2048 --vocab 16384

Each row: the peak in MiB, and as a multiple of the fp32 logits it holds (the whole sequence's, or one
chunk's): what `fastgrpo plan` prices (`plan.LOGIT_COPIES`). The wall time shows the chunks' price: each
chunk's logits are computed twice (the backward recomputes them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch


def peak_bytes(fn: Callable[[], object]) -> int:
    """The most bytes allocated at once while `fn` runs, beyond what was allocated before: the running
    sum of the profiler's [memory] events (every CPU allocation, +bytes, and free, -bytes), at its maximum."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        events = [e for e in json.loads(Path(path).read_text())["traceEvents"] if e.get("name") == "[memory]"]
    finally:
        os.unlink(path)
    now = peak = 0
    for e in sorted(events, key=lambda e: e["ts"]):
        now += e["args"]["Bytes"]
        peak = max(peak, now)
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--chunk", type=int, action="append", help="chunk sizes (default 256 and 1024)")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from fastgrpo.trainers.chunked_logprobs import chunked_scores, token_scores
    from fastgrpo.trainers.megatron.logprobs import vocab_parallel_logprobs
    from fastgrpo.trainers.megatron.model import initialize
    from fastgrpo.types import SamplingParams

    initialize(1, 1)  # Megatron's parallel groups, a world of one (its scoring reduces over TP ranks: one here)
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=g).to(dtype).requires_grad_()
    weight = (0.1 * torch.randn(args.vocab, args.hidden, generator=g)).to(dtype).requires_grad_()
    tokens = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    scorers = {"torch": lambda logits, t, s: token_scores(logits, t, sampling, s),
               "megatron": lambda logits, t, s: vocab_parallel_logprobs(logits, t, sampling, args.vocab, s)}
    print(f"{args.tokens} tokens x vocab {args.vocab} x hidden {args.hidden}, {args.dtype}, T={args.temperature} "
          f"top_k={args.top_k} top_p={args.top_p}; whole fp32 logits {4 * args.tokens * args.vocab / 2**20:.1f} MiB")
    for name, score in scorers.items():
        for chunk in [0, *(args.chunk or [256, 1024])]:
            def step():
                hidden.grad = weight.grad = None
                logp, entropy = chunked_scores(hidden, weight, tokens, score, chunk)
                (logp.sum() + 0.1 * entropy.sum()).backward()

            step()  # (one-time allocations out of the measurement)
            peak = peak_bytes(step)
            times = []
            for _ in range(args.repeat):
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
            held = 4 * (chunk if 0 < chunk < args.tokens else args.tokens) * args.vocab
            what = f"chunk {chunk}" if 0 < chunk < args.tokens else "whole"
            print(f"{name:9s} {what:11s} peak {peak / 2**20:9.1f} MiB = {peak / held:5.2f} x its fp32 logits   "
                  f"{statistics.median(times):7.3f} s")


if __name__ == "__main__":
    main()
