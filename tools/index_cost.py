"""The suffix trie's host cost per indexed token, the C trie and the Python one (docs/drafts.md, Limits):
insert time and resident memory on text that never repeats (the worst case: every token adds up to
window + depth nodes).

    python tools/index_cost.py [--texts 200] [--length 300] [--vocab 30000] [--max-depth 16]

Each trie is measured in a fresh process (resident memory is the process's, read from /proc/self/statm,
so Linux only); insert time is the median of three insertions of the same texts."""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time


def measure(kind: str, texts: int, length: int, vocab: int, max_depth: int) -> dict:
    from fastgrpo.speculation.suffix_index import CompiledTrie, SuffixTrie

    trie_type = SuffixTrie if kind == "python" else CompiledTrie
    if trie_type is None:
        raise SystemExit("the compiled trie is not built: make install (a C compiler is needed)")
    rng = random.Random(0)
    data = [[rng.randrange(vocab) for _ in range(length)] for _ in range(texts)]
    tokens = texts * length

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    gc.collect()
    before = resident()
    trie = trie_type(max_depth)
    for text in data:
        trie.insert(text)
    gc.collect()
    grown = resident() - before
    seconds = []
    for _ in range(3):
        t = time.perf_counter()
        other = trie_type(max_depth)
        for text in data:
            other.insert(text)
        seconds.append(time.perf_counter() - t)
        del other
    return {"trie": kind, "insert_us_per_token": 1e6 * statistics.median(seconds) / tokens,
            "resident_bytes_per_token": grown / tokens, "nodes": trie.nodes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=200)
    parser.add_argument("--length", type=int, default=300)
    parser.add_argument("--vocab", type=int, default=30000)
    parser.add_argument("--max-depth", type=int, default=16, help="index_window + index_depth")
    parser.add_argument("--one", choices=["python", "compiled"], help=argparse.SUPPRESS)  # a child's part
    args = parser.parse_args()
    shape = (args.texts, args.length, args.vocab, args.max_depth)
    if args.one:
        print(json.dumps(measure(args.one, *shape)))
        return 0
    for kind in ("compiled", "python"):
        out = subprocess.run([sys.executable, __file__, "--one", kind, "--texts", str(args.texts), "--length",
                              str(args.length), "--vocab", str(args.vocab), "--max-depth", str(args.max_depth)],
                             capture_output=True, text=True)
        if out.returncode:
            print(out.stderr, file=sys.stderr)
            return out.returncode
        r = json.loads(out.stdout)
        print(f"{kind:>8}: {r['insert_us_per_token']:.2f} us a token inserted, "
              f"{r['resident_bytes_per_token'] / 1024:.2f} KiB resident a token, {r['nodes']} nodes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
