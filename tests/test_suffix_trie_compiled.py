"""The compiled suffix trie (fastgrpo/speculation/_suffix_trie.c) against the Python one, its reference:
the same node count, matches and candidates (tokens, parents, depths, log-probabilities to the bit,
counts) through random insertions, removals and texts written token by token, and the same drafts from
a whole index."""

import random
import shutil

import pytest

from fastgrpo.speculation.suffix_index import CompiledTrie, IndexLimits, SuffixIndex, SuffixTrie

needs_build = pytest.mark.skipif(CompiledTrie is None, reason="the compiled trie is not built here")


def test_the_install_built_the_compiled_trie_where_a_c_compiler_is():
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: fastgrpo runs the Python trie")
    assert CompiledTrie is not None, "reinstall fastgrpo (make install) to build fastgrpo/speculation/_suffix_trie.c"
    assert SuffixIndex().trie_type is CompiledTrie  # the index takes it by default


def variants(rng: random.Random, vocab: int, length: int) -> list[int]:
    """A text that repeats much of one base text (as a prompt's responses repeat each other), cut short."""
    base = [(7 * i) % vocab for i in range(length)]
    for _ in range(rng.randrange(length // 3 + 1)):
        base[rng.randrange(length)] = rng.randrange(vocab)
    return base[: rng.randrange(length // 2, length + 1)]


@needs_build
def test_the_compiled_trie_answers_as_the_python_one():
    for case in range(200):
        rng = random.Random(case)
        max_depth, vocab = rng.randrange(2, 12), rng.choice([3, 5, 20, 200, 50_000])
        python, compiled = SuffixTrie(max_depth), CompiledTrie(max_depth)
        inserted, writers = [], []
        for _ in range(rng.randrange(1, 12)):
            op = rng.random()
            if op < 0.4 or not inserted:
                text = variants(rng, vocab, rng.randrange(1, 40 if vocab < 1000 else 400))
                python.insert(text), compiled.insert(text)
                inserted.append(text)
            elif op < 0.6:  # removed nodes' ids are reused by later insertions
                text = inserted.pop(rng.randrange(len(inserted)))
                python.remove(text), compiled.remove(text)
            else:
                pair = python.writer(), compiled.writer()
                for x in variants(rng, vocab, rng.randrange(1, 30)):
                    pair[0].append(x), pair[1].append(x)
                    for window in (1, 3, max_depth):
                        assert pair[0].match(window) == pair[1].match(window), case
                writers.append(pair)
            assert python.nodes == compiled.nodes, case
            for _ in range(5):
                context, window = variants(rng, vocab, rng.randrange(1, 20)), rng.randrange(1, max_depth + 1)
                node, m = python.match(context, window)
                assert compiled.match(context, window) == (node, m), case
                args = (node, rng.randrange(1, 30), rng.randrange(1, max_depth + 1),
                        rng.choice([0.0, 0.5, 1.0 / max(m, 1)]), rng.choice([0.0, 0.01, 0.2]))
                assert compiled.continuations(*args) == python.continuations(*args), case
        assert all(p.tokens == c.tokens for p, c in writers)


@needs_build
def test_an_index_drafts_the_same_with_either_trie():
    """Two groups of a prompt over three calls, siblings interleaved, history trimmed to two responses."""
    rng = random.Random(3)
    limits = IndexLimits(window=4, depth=3, responses=2)
    indexes = SuffixIndex(limits, compiled=False), SuffixIndex(limits, compiled=True)
    prompt = [1, 2, 3, 4]
    for _ in range(3):
        groups = [[index.open("p", prompt) for _ in range(3)] for index in indexes]
        for _ in range(20):
            for python, compiled in zip(*groups):
                tokens = variants(rng, 6, 3)
                python.extend(tokens), compiled.extend(tokens)
                assert python.lookup(8) == compiled.lookup(8)
        for group in groups:
            for response in group:
                response.close()
    assert indexes[0].history("p") == indexes[1].history("p") and indexes[0].tokens == indexes[1].tokens


@needs_build
def test_a_batch_of_lookups_is_each_rows_lookup():
    """`lookup_rows` (one C call for every row, flat arrays) against `Response.lookup` row by row, on both
    tries: three prompts' responses interleaved, with remembered history indexed on first use, rows that
    match nothing, and every prompt dropped by `load_state_dict` while its responses are open (those rows
    answer from the new entry, as a row-by-row lookup does). The same candidates, match lengths and
    order of use."""
    rng = random.Random(7)
    limits = IndexLimits(window=4, depth=3, responses=2)
    for compiled in (True, False):
        batched, single = SuffixIndex(limits, compiled=compiled), SuffixIndex(limits, compiled=compiled)
        prompts = {(k,): [k, 1, 2, 3] for k in (10, 11, 12)}  # (keys: the prompts' ids, as the engine's)
        history = [variants(rng, 6, 12), variants(rng, 6, 12)]
        for index in (batched, single):
            index.remember((12,), prompts[(12,)], history)
        rows = [[index.open((k,), prompts[(k,)]) for k in (10, 11, 10, 12, 11, 10)] for index in (batched, single)]
        matched = empty = 0
        for step in range(25):
            for a, b in zip(*rows):
                tokens = variants(rng, 6 if step % 5 else 40, 2)
                a.extend(tokens), b.extend(tokens)
            if step == 20:  # every prompt dropped and made again: the open responses' tries are gone
                for index in (batched, single):
                    index.load_state_dict(index.state_dict())
            budget = rng.choice([1, 5, 8])
            (got, got_matched), want = batched.lookup_rows(rows[0], budget), [r.lookup(budget) for r in rows[1]]
            assert [got.row(b) for b in range(len(want))] == want, (compiled, step)
            assert got_matched == sum(c.match_len > 0 for c in want)
            assert list(batched.prompts) == list(single.prompts)
            matched += sum(c.match_len > 0 for c in want)
            empty += sum(len(c) == 0 for c in want)
        assert matched > 40 and empty > 5


@needs_build
def test_bad_tokens_are_refused():
    trie = CompiledTrie(4)
    with pytest.raises(ValueError, match="token id"):
        trie.insert([1, -2])
    with pytest.raises(TypeError):
        trie.writer().extend(["a"])
    with pytest.raises(ValueError, match="max_depth"):
        CompiledTrie(1)


@needs_build
def test_the_cost_tool_measures_both_tries_on_the_same_text():
    """tools/index_cost.py (the memory and insert figures of docs/drafts.md), at a small size."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "tools/index_cost.py", "--texts", "20", "--length", "50", "--vocab", "500"],
                         cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = re.findall(r"^\s*(compiled|python): ([\d.]+) us a token inserted, ([-\d.]+) KiB resident a token, (\d+) nodes$",
                      out.stdout, re.MULTILINE)
    assert [r[0] for r in rows] == ["compiled", "python"]
    assert rows[0][3] == rows[1][3] and int(rows[0][3]) > 1000  # the same trie: up to 16 nodes a token of 1000
    assert all(float(r[1]) > 0 for r in rows)
