"""The suffix index's host work when a sequence finishes, on the engine's critical path and off it.

    python tools/index_upkeep_time.py [--prompts 8] [--group 8] [--epochs 3] [--length 3000] [--responses 16]

A GRPO-shaped index (`prompts` prompts of 200 tokens, `group` responses each per epoch, each prompt keeping
its last `responses`): every response is written into the index and then closed, two ways on the same
texts. `close()` removes the prompt's oldest response past the limit at once (walking all of it through
the trie), which the engine did in its retire, between two steps. `close(tidy=False)` then `tidy()` is
what the engine does now: the close only files the response, and the removal runs at the next step's
`tidy`, while that step's function computes (on a GPU). Reported per finished response, from the first
epoch whose closes remove one (epoch 3 at group 8 and 16 kept): the median milliseconds of each part. Two
kinds of text: siblings of one answer a prompt (10% of their tokens changed: GRPO's groups repeat each
other), and text that never repeats (every token new to the trie: the most nodes to remove)."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def texts(kind: str, prompts: int, group: int, epochs: int, length: int, seed: int = 0) -> list[list[list[int]]]:
    """Per epoch, the responses of every prompt in turn (prompt-major), as token lists."""
    rng = random.Random(seed)
    base = [[rng.randrange(32000) for _ in range(length)] for _ in range(prompts)]
    out = []
    for _ in range(epochs):
        epoch = []
        for p in range(prompts):
            for _ in range(group):
                if kind == "novel":
                    epoch.append([rng.randrange(32000) for _ in range(length)])
                else:
                    t = list(base[p])
                    for _ in range(length // 10):
                        t[rng.randrange(length)] = rng.randrange(32000)
                    epoch.append(t)
        out.append(epoch)
    return out


def measure(kind: str, prompts: int, group: int, epochs: int, length: int, responses: int) -> dict:
    from fastgrpo.speculation.suffix_index import IndexLimits, SuffixIndex

    rng = random.Random(1)
    keys = [tuple(rng.randrange(32000) for _ in range(200)) for _ in range(prompts)]
    data = texts(kind, prompts, group, epochs, length)
    limits = IndexLimits(responses=responses, max_tokens=10**9)
    result = {"kind": kind}
    for mode in ("close", "deferred"):
        index = SuffixIndex(limits)
        at_close, at_tidy = [], []
        for e, epoch in enumerate(data):
            for i, text in enumerate(epoch):
                key = keys[i // group]
                r = index.open(key, list(key))
                r.extend(text)
                trims = (e + 1) * group > responses  # this close puts the prompt past its limit
                t = time.perf_counter()
                r.close(tidy=mode == "close")
                closed = time.perf_counter()
                index.tidy()
                tidied = time.perf_counter()
                if trims:
                    at_close.append(closed - t)
                    at_tidy.append(tidied - closed)
        result[mode] = {"close_ms": 1e3 * statistics.median(at_close), "tidy_ms": 1e3 * statistics.median(at_tidy),
                        "closes": len(at_close)}
    return result


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--length", type=int, default=3000)
    p.add_argument("--responses", type=int, default=16)
    args = p.parse_args(argv)
    if args.epochs * args.group <= args.responses:
        raise SystemExit(f"no close removes a response: {args.epochs} epochs of {args.group} "
                         f"keep within {args.responses}")
    rows = [measure(kind, args.prompts, args.group, args.epochs, args.length, args.responses)
            for kind in ("siblings", "novel")]
    for r in rows:
        c, d = r["close"], r["deferred"]
        print(f"{r['kind']:8s} ({c['closes']} closes that remove a response of {args.length} tokens): on the critical "
              f"path {c['close_ms']:.3f} ms a close before, {d['close_ms']:.3f} ms now; the removal, now at the next "
              f"step's tidy while its step function computes, {d['tidy_ms']:.3f} ms", flush=True)
    print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()
