"""The suffix index (fastgrpo/speculation/suffix_index.py): its matches and candidates against a brute
force count over the indexed texts, removal, the per-prompt and memory limits, live siblings."""

import math
import random

import pytest

from fastgrpo.speculation.suffix_index import Candidates, CompiledTrie, IndexLimits, SuffixIndex, SuffixTrie

# the Python trie and the compiled one (tests/test_suffix_trie_compiled.py: the two agree on everything)
TRIES = [pytest.param(SuffixTrie, id="python"),
         pytest.param(CompiledTrie, id="compiled", marks=pytest.mark.skipif(CompiledTrie is None, reason="not built"))]


def occurrences(texts: list[list[int]], s: tuple[int, ...]) -> int:
    """How many times `s` occurs in `texts` (overlapping occurrences counted)."""
    n = len(s)
    return sum(tuple(t[i : i + n]) == s for t in texts for i in range(len(t) - n + 1))


def brute_match(texts: list[list[int]], context: list[int], window: int) -> int:
    """The length of the longest suffix of `context` (at most `window`) that occurs followed by a token."""
    for m in range(min(window, len(context)), 0, -1):
        s = tuple(context[-m:])
        if any(tuple(t[i : i + m]) == s for t in texts for i in range(len(t) - m)):
            return m
    return 0


def brute_paths(texts, s, alphabet, depth, prior) -> dict[tuple[int, ...], float]:
    """Every continuation path of `s` up to `depth` tokens with its probability: each step's count over
    its siblings' counts plus `prior`, multiplied along the path."""
    out, level = {}, {(): 1.0}
    for _ in range(depth):
        nxt = {}
        for path, p in level.items():
            counts = {y: occurrences(texts, s + path + (y,)) for y in alphabet}
            total = sum(counts.values()) + prior
            for y, c in counts.items():
                if c:
                    nxt[path + (y,)] = p * c / total
        out |= nxt
        level = nxt
    return out


def check_candidates(cands, texts, context, window, depth, budget, alphabet, prior=1.0):
    m = brute_match(texts, context, window)
    assert cands.match_len == m
    if m == 0:
        assert len(cands) == 0
        return
    s = tuple(context[-m:])
    want = brute_paths(texts, s, alphabet, depth, prior)
    got = dict(zip(cands.paths(), (math.exp(lp) for lp in cands.logp)))
    assert len(got) == min(budget, len(want))
    for path, p in got.items():
        assert p == pytest.approx(want[path], rel=1e-9)
        assert cands.counts[cands.paths().index(path)] == occurrences(texts, s + path)
    # the best `budget` paths: nothing left out is more probable than what was chosen
    left = [p for path, p in want.items() if path not in got]
    assert not left or max(left) <= min(got.values()) + 1e-12
    for i, parent in enumerate(cands.parents):  # parents first, depths consistent
        assert parent < i and cands.depth[i] == (1 if parent < 0 else cands.depth[parent] + 1) <= depth


@pytest.mark.parametrize("trie_type", TRIES)
def test_matches_and_candidates_equal_a_brute_force_count(trie_type):
    rng = random.Random(0)
    alphabet = range(4)
    for trial in range(40):
        window, depth = rng.randint(1, 5), rng.randint(1, 4)
        trie = trie_type(window + depth)
        texts = [[rng.randrange(4) for _ in range(rng.randint(1, 30))] for _ in range(rng.randint(1, 4))]
        for t in texts:
            trie.insert(t)
        for _ in range(5):
            context = [rng.randrange(4) for _ in range(rng.randint(1, 8))]
            node, m = trie.match(context, window)
            budget, prior = rng.randint(1, 12), rng.choice([0.0, 0.5, 1.0])
            cands = Candidates(*trie.continuations(node, budget, depth, prior)) if m else None
            if cands is not None:
                cands.match_len = m
                check_candidates(cands, texts, context, window, depth, budget, alphabet, prior)
            else:
                assert brute_match(texts, context, window) == 0


@pytest.mark.parametrize("trie_type", TRIES)
def test_a_text_being_written_matches_its_own_earlier_text_not_its_end(trie_type):
    """The sequence's own end is in the index (it is being written there): the match skips that
    occurrence, which has nothing after it, and finds the earlier one that does."""
    trie = trie_type(8)
    w = trie.writer()
    w.extend([5, 1, 2, 3, 9, 7, 1, 2, 3])  # "1 2 3" occurred before, followed by 9
    node, m = trie.match(w.tokens, window=4)
    assert m == 3  # "7 1 2 3" occurs only at the end; "1 2 3" earlier, followed by 9
    cands = Candidates(*trie.continuations(node, budget=4, depth=3))
    assert cands.paths()[:3] == [(9,), (9, 7), (9, 7, 1)]
    assert math.exp(cands.logp[0]) == pytest.approx(1 / 2)  # seen once: 1 / (1 + prior)


@pytest.mark.parametrize("trie_type", TRIES)
def test_a_response_matches_from_its_frontier_as_a_walk_of_its_text_does(trie_type):
    """`Response.lookup` reads its match off its writer's frontier; `SuffixIndex.lookup` of the same text
    walks the trie along suffix links: the same candidates at every step, while siblings write beside it,
    earlier responses are trimmed (`responses=2`) and matches pass the window and the cut."""
    rng = random.Random(7)
    for trial in range(30):
        limits = IndexLimits(window=rng.randint(1, 5), depth=rng.randint(1, 4), responses=2)
        index = SuffixIndex(limits, compiled=trie_type is not SuffixTrie)
        prompt = [rng.randrange(3) for _ in range(rng.randint(1, 6))]
        for _ in range(3):  # three calls of a group of three, written a few tokens at a time, interleaved
            group = [index.open("p", prompt) for _ in range(3)]
            for _ in range(12):
                for r in group:
                    r.extend([rng.randrange(3) for _ in range(rng.randint(1, 3))])
                    budget = rng.randint(1, 8)
                    assert r.lookup(budget) == index.lookup("p", r.writer.tokens, budget)
            for r in group:
                r.close()


def test_removal_takes_back_exactly_what_an_insertion_added():
    rng = random.Random(1)
    for _ in range(20):
        texts = [[rng.randrange(3) for _ in range(rng.randint(1, 25))] for _ in range(4)]
        trie, fresh, whole = SuffixTrie(5), SuffixTrie(5), SuffixTrie(5)
        for t in texts:
            trie.insert(t)
            whole.insert(t)
        for t in texts[1:3]:
            trie.remove(t)
        for t in (texts[0], texts[3]):
            fresh.insert(t)
        assert dump(trie) == dump(fresh)
        assert trie.nodes == fresh.nodes == len(dump(fresh)) + 1
        for t in texts[1:3]:  # the removed nodes' ids are reused, and the trie is as if never removed
            trie.insert(t)
        assert dump(trie) == dump(whole)
        assert trie.nodes == whole.nodes and len(trie.count) <= len(whole.count) + 25


def dump(trie, node=0, prefix=()) -> dict:
    """Every string of the trie with its count (checking each suffix link's string is one shorter)."""
    out = {}
    for token, child in trie.children[node].items():
        assert trie.count[child] > 0 and trie.depth[trie.link[child]] == trie.depth[child] - 1
        out[prefix + (token,)] = trie.count[child]
        out |= dump(trie, child, prefix + (token,))
    return out


def test_suffix_links_point_at_the_string_less_its_first_token():
    trie = SuffixTrie(6)
    for t in ([1, 2, 3, 1, 2, 4], [2, 3, 1, 2, 4, 4, 4]):
        trie.insert(t)

    def walk(node, prefix=()):
        for token, child in trie.children[node].items():
            s = prefix + (token,)
            target = trie.root
            for x in s[1:]:
                target = trie.children[target][x]
            assert trie.link[child] == target, s
            walk(child, s)

    walk(trie.root)


def test_siblings_see_each_others_tokens_while_they_are_written():
    index = SuffixIndex(IndexLimits(window=4, depth=4))
    prompt = [1, 2, 3]
    a, b = index.open("p", prompt), index.open("p", prompt)
    a.extend([10, 11, 12, 13, 14])
    b.extend([10, 11])
    cands = b.lookup(budget=3)
    assert cands.paths() == [(12,), (12, 13), (12, 13, 14)]  # a's text, before a finished
    assert cands.match_len == 4  # prompt tail 2 3 then 10 11... matched to the window
    other = index.open("q", prompt)  # another prompt key sees nothing of p's responses
    other.extend([10, 11])
    assert len(other.lookup(budget=3)) == 0


def test_the_first_tokens_of_a_response_are_predicted_from_the_end_of_the_prompt():
    index = SuffixIndex(IndexLimits(window=3, depth=2))
    prompt = [7, 8, 9, 4]
    for response in ([20, 21], [20, 21], [22, 23]):
        r = index.open(("k",), prompt)
        r.extend(response)
        r.close()
    new = index.open(("k",), prompt)
    cands = new.lookup(budget=2, depth=1)
    assert cands.paths() == [(20,), (22,)]
    # counts over 3 + prior / match length: "8 9 4" (the prompt's tail) matched
    assert cands.match_len == 3
    assert [math.exp(lp) for lp in cands.logp] == pytest.approx([2 / (3 + 1 / 3), 1 / (3 + 1 / 3)])
    assert cands.counts == [2, 1]


def test_a_prompt_keeps_only_its_last_responses():
    index = SuffixIndex(IndexLimits(window=2, depth=2, responses=2))
    prompt = [1]
    for first in (30, 40, 50):
        r = index.open("p", prompt)
        r.extend([first, first + 1])
        r.close()
    assert [h[-2:] for h in index.history("p")] == [[40, 41], [50, 51]]
    probe = index.open("p", prompt)
    assert sorted(probe.lookup(budget=5, depth=1).tokens) == [40, 50]  # 30 was removed from the trie
    # the prompt, the two kept responses with their tails, the open probe's tail
    assert index.tokens == 1 + 2 * (len(index.prompts["p"].tail) + 2) + len(index.prompts["p"].tail)


def test_a_close_that_leaves_the_upkeep_to_tidy_keeps_the_response_until_then():
    """`close(tidy=False)`: the prompt goes over its limit (2 responses) and the index over its cap until
    `tidy()`, which then applies both as a plain close would have; a checkpoint tidies first. Tokens: p's
    prompt and three responses of 3 (its one-token tail first), 10; q's prompt, tail and 8 written, 10:
    20 over the cap of 18, and 17 once p's oldest response is removed, so nothing need be dropped."""
    limits = IndexLimits(window=2, depth=2, responses=2, max_tokens=18)
    index = SuffixIndex(limits)
    for first in (30, 40, 50):
        r = index.open("p", [1])
        r.extend([first, first + 1])
        r.close(tidy=False)
    probe = index.open("q", [1])  # another prompt, left open: the cap never drops it
    probe.extend([7] * 8)
    assert len(index.prompts["p"].history) == 3 and index.tokens > limits.max_tokens
    assert sorted(index.lookup("p", [1], budget=5, depth=1).tokens) == [30, 40, 50]  # 30 not yet removed
    saved = index.state_dict()
    p_saved = next(x for x in saved["prompts"] if x["key"] == list("p"))
    assert [h[-2:] for h in p_saved["history"]] == [[40, 41], [50, 51]]
    assert sorted(index.lookup("p", [1], budget=5, depth=1).tokens) == [40, 50]
    assert index.tokens == 17 and set(index.prompts) == {"p", "q"} and index.evicted == 0
    index.tidy()  # nothing left to do
    assert [h[-2:] for h in index.history("p")] == [[40, 41], [50, 51]]


def test_the_memory_cap_drops_the_least_recently_used_prompts_but_not_open_ones():
    limits = IndexLimits(window=2, depth=2, max_tokens=60)
    index = SuffixIndex(limits)
    held = index.open("held", [9])  # stays open throughout: never dropped
    held.extend([5] * 10)
    for key in ("a", "b", "c"):
        r = index.open(key, [1, 2])
        r.extend([3] * 10)
        r.close()
    index.lookup("a", [1, 2, 3], budget=1)  # a is now more recent than b and c
    r = index.open("d", [1, 2])
    r.extend([4] * 10)
    r.close()
    assert index.tokens <= limits.max_tokens
    assert "held" in index.prompts and "a" in index.prompts and "d" in index.prompts
    assert "b" not in index.prompts and index.evicted >= 1
    assert index.tokens == sum(e.tokens for e in index.prompts.values())


def test_limits_are_validated():
    with pytest.raises(ValueError, match="window"):
        IndexLimits(window=0)
    with pytest.raises(ValueError, match="prior"):
        IndexLimits(prior=-1.0)


def test_a_checkpointed_index_rebuilds_to_the_same_candidates():
    """state_dict -> JSON -> load_state_dict gives an index that proposes what the original proposes
    after any context, holds the same tokens, prompts (in order of use) and histories; a smaller
    per-prompt limit keeps each prompt's latest responses."""
    import json

    rng = random.Random(3)
    index = SuffixIndex(IndexLimits(window=4, depth=3, responses=3))
    prompts = {(i, 9): [i, 9] + [rng.randrange(6) for _ in range(8)] for i in range(3)}
    for round_ in range(4):
        for key, prompt in prompts.items():
            response = index.open(key, prompt)
            response.extend([rng.randrange(6) for _ in range(12)])
            response.close()
    index.lookup((0, 9), prompts[(0, 9)], budget=4)  # prompt (0, 9) now the most recently used
    restored = SuffixIndex(IndexLimits(window=4, depth=3, responses=3))
    restored.load_state_dict(json.loads(json.dumps(index.state_dict())))
    assert list(restored.prompts) == list(index.prompts) == [(1, 9), (2, 9), (0, 9)]
    assert restored.tokens == index.tokens > 0
    assert all(restored.history(k) == index.history(k) and len(index.history(k)) == 3 for k in prompts)
    for _ in range(50):
        key = rng.choice(list(prompts))
        context = prompts[key] + [rng.randrange(6) for _ in range(rng.randrange(1, 6))]
        a, b = index.lookup(key, context, budget=500), restored.lookup(key, context, budget=500)
        # every path with the same probability (a budget that cuts nothing: ties at a cut may be broken
        # the other way, as children are kept in the order the texts were inserted)
        assert a.match_len == b.match_len and len(a) == len(b)
        assert dict(zip(a.paths(), a.logp)) == pytest.approx(dict(zip(b.paths(), b.logp)))
    smaller = SuffixIndex(IndexLimits(window=4, depth=3, responses=1))
    smaller.load_state_dict(index.state_dict())
    assert all(smaller.history(k) == index.history(k)[-1:] for k in prompts)


def test_remembered_responses_draft_as_written_ones_once_their_prompt_is_used():
    """Responses another engine wrote, remembered, propose exactly what the same responses written here
    propose; they enter the trie only when the prompt is used (open or lookup), and only the latest
    `responses` of them stay."""
    rng = random.Random(5)
    limits = IndexLimits(window=4, depth=3, responses=3)
    prompt = [7, 8] + [rng.randrange(5) for _ in range(6)]
    texts = [[rng.randrange(5) for _ in range(10)] for _ in range(5)]
    written, remembered = SuffixIndex(limits), SuffixIndex(limits)
    for text in texts:
        r = written.open("p", prompt)
        r.extend(text)
        r.close()
    remembered.remember("p", prompt, texts)
    only_prompt = SuffixTrie(limits.window + limits.depth)
    only_prompt.insert(prompt)
    assert remembered.prompts["p"].trie.nodes == only_prompt.nodes  # nothing indexed before the prompt is used
    assert remembered.history("p") == written.history("p") and len(written.history("p")) == 3  # the latest 3
    assert remembered.tokens == written.tokens
    saved = remembered.state_dict()
    assert [h[-10:] for h in saved["prompts"][0]["history"]] == texts[-3:]
    for _ in range(30):
        context = prompt + [rng.randrange(5) for _ in range(rng.randrange(1, 6))]
        a, b = written.lookup("p", context, budget=500), remembered.lookup("p", context, budget=500)
        assert a.match_len == b.match_len and dict(zip(a.paths(), a.logp)) == pytest.approx(dict(zip(b.paths(), b.logp)))
    assert remembered.prompts["p"].trie.nodes == written.prompts["p"].trie.nodes > only_prompt.nodes
    assert not remembered.prompts["p"].pending


def test_the_upkeep_tool_times_the_removal_on_and_off_the_critical_path():
    """tools/index_upkeep_time.py at a small size: a close that removes the prompt's oldest response costs
    its removal; a deferred one files the response only, and the removal moves to `tidy`."""
    from tools.index_upkeep_time import main

    for row in main(["--prompts", "2", "--group", "4", "--epochs", "2", "--length", "400", "--responses", "4"]):
        before, now = row["close"], row["deferred"]
        assert before["closes"] == now["closes"] == 8
        assert now["close_ms"] < before["close_ms"] / 3 and now["tidy_ms"] > 3 * now["close_ms"]
