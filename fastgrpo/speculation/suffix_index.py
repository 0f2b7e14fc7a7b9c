"""Draft candidates from text already written: a suffix index per prompt (docs/drafts.md).

GRPO samples `group_size` responses per prompt and returns to the same prompts epoch after epoch, so
much of what a response is about to write was already written, by a sibling a few steps earlier or by
the prompt's responses in an earlier step (repeated derivations, copied numbers, the answer format).
The index holds, for each prompt key:

- the prompt itself, once (a response copies numbers from its problem);
- the last `responses` finished responses of the prompt, from any earlier generate() call (history);
- the responses of the current call while they are written (live siblings, and the request itself:
  a response that repeats its own earlier text matches there too).

Each response is indexed as the prompt's last `window + depth` tokens followed by the response, so
that the first tokens of a response are predicted from the end of the prompt.

The structure is a suffix trie cut at depth `window + depth`: a node is a string of at most that many
tokens that occurs in the indexed text, with the number of its occurrences (end positions). Every node
has a suffix link to the node of its string without its first token, which exists because a string's
suffix occurs at least as often as the string. A lookup feeds the last `window` tokens of the
sequence through the trie along these links, in time proportional to those tokens (each token
descends at most one level, each link climbs one), and ends at the longest suffix of the sequence
that occurs in the index; from there it climbs to the longest one that has occurred with a
continuation. The continuations below that node are the candidates: the `budget` most probable paths,
a child's probability being its count over its siblings' counts plus `prior / m`, m the match's length,
multiplied along the path. The prior keeps one occurrence from being certainty, the more so the
shorter the context it followed: after a match of 8 tokens a continuation seen once is nearly sure to
recur, after one token it is a guess. Since a path's probability never exceeds its prefix's, the
chosen set is ancestor-closed.

In a distributed rollout each engine answers its share of the prompts, and a prompt's next visit may
land on another engine: every engine receives every engine's answers, and `remember` keeps the other
shares' as their prompts' history, indexed lazily, when the prompt is next used here.

The trie is compiled C (`_suffix_trie.c`, built at install where a C compiler is found: the host
work of a step, which a GPU waits on, is several times smaller) with `SuffixTrie` below as its
reference and fallback; both give identical nodes, matches and candidates.

Limits: each prompt keeps its last `responses` finished responses (older ones are removed from its
trie); all prompts together hold at most `max_tokens` tokens of indexed text (a trie holds at most
`window + depth` nodes per token), the least recently used prompts being dropped whole when the cap is
passed (never one with a response still being written). Both apply when a response closes, or at the
next `tidy()` for one closed with `tidy=False` (the engine's: off the host's critical path).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor

try:  # the same trie in C, where the install built it
    from fastgrpo.speculation._suffix_trie import SuffixTrie as CompiledTrie
    from fastgrpo.speculation._suffix_trie import lookup_rows as compiled_lookup_rows
except ImportError:
    CompiledTrie = compiled_lookup_rows = None


class SuffixTrie:
    """The suffixes of every inserted text, each cut at `max_depth` tokens, with occurrence counts.

    Nodes are integer ids into flat lists (children by next token, occurrences, length, suffix link;
    node 0 the root), not objects: a trie holds up to `max_depth` nodes per indexed token, and that
    many container objects make every full pass of Python's garbage collector walk them all (a
    trie of objects inserted at 5x the cost, measured). A dict of ints to ints is not tracked by the
    collector. Ids of removed nodes are reused."""

    def __init__(self, max_depth: int):
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.root = 0
        self.children: list[dict[int, int]] = [{}]
        self.count = [0]
        self.depth = [0]
        self.link = [0]
        self._free: list[int] = []

    def _new(self, depth: int, link: int) -> int:
        """A node of no occurrence yet (a removed node's id if one is free)."""
        if self._free:
            node = self._free.pop()
            self.count[node], self.depth[node], self.link[node] = 0, depth, link
            return node
        self.children.append({})
        self.count.append(0)
        self.depth.append(depth)
        self.link.append(link)
        return len(self.count) - 1

    @property
    def nodes(self) -> int:
        """Nodes in the trie, the root included."""
        return len(self.count) - len(self._free)

    def writer(self) -> TrieWriter:
        """A text inserted token by token (its occurrences count from each token on)."""
        return TrieWriter(self)

    def insert(self, tokens: Iterable[int]) -> TrieWriter:
        w = self.writer()
        w.extend(tokens)
        return w

    def remove(self, tokens: Sequence[int]) -> None:
        """Remove one earlier insertion of `tokens`: every count it added is taken back, and strings
        that no longer occur leave the trie (their suffixes occur at least as often, so no suffix link
        of a remaining node points at a removed one; their extensions occurred only where they did, so
        this walk removes those too)."""
        children, count, depth, max_depth = self.children, self.count, self.depth, self.max_depth
        frontier: list[int] = []
        freed: list[int] = []
        for x in tokens:
            new = []
            for parent in [self.root, *frontier]:
                if depth[parent] >= max_depth:
                    continue
                child = children[parent][x]
                count[child] -= 1
                if count[child] == 0:
                    del children[parent][x]  # the detached node is still walked for the tokens after it
                    freed.append(child)
                new.append(child)
            frontier = new
        for node in freed:  # reusable only now that the walk is done
            children[node].clear()
        self._free += freed

    def match(self, tail: Sequence[int], window: int) -> tuple[int, int]:
        """The node of the longest suffix of `tail` (at most `window` tokens) that occurs with a
        continuation, and its length (0: the root, no suffix occurs with one)."""
        children, depth, link = self.children, self.depth, self.link
        node = self.root
        for x in tail[-window:]:
            while True:
                if depth[node] >= window:  # the match may not grow past the window
                    node = link[node]
                child = children[node].get(x)
                if child is not None:
                    node = child
                    break
                if node == self.root:
                    break
                node = link[node]
        while node != self.root and not children[node]:
            node = link[node]  # the suffix occurred only where nothing followed it (the sequence's own end)
        return node, depth[node]

    def continuations(self, node: int, budget: int, depth: int, prior: float = 1.0,
                      min_prob: float = 0.0) -> tuple[list[int], list[int], list[int], list[float], list[int]]:
        """The `budget` most probable continuation paths below `node`, at most `depth` tokens deep, best
        first (so every node's parent comes before it), as `Candidates`' tokens, parents, depth, logp and
        counts (`Candidates(*found)`)."""
        out = Candidates()
        heap: list[tuple[float, int, int, int, int]] = []
        tie = 0
        children, count = self.children, self.count
        floor = math.log(min_prob) if min_prob > 0 else -math.inf

        def push(parent: int, logp: float, index: int) -> None:
            nonlocal tie
            below = children[parent]
            total = sum(count[c] for c in below.values()) + prior
            for token, child in below.items():
                lp = logp + math.log(count[child] / total)
                if lp >= floor:
                    heapq.heappush(heap, (-lp, tie, child, index, token))
                    tie += 1

        push(node, 0.0, -1)
        while heap and len(out.tokens) < budget:
            neg, _, child, parent, token = heapq.heappop(heap)
            out.tokens.append(token)
            out.parents.append(parent)
            out.logp.append(-neg)
            out.counts.append(count[child])
            d = 1 if parent < 0 else out.depth[parent] + 1
            out.depth.append(d)
            if d < depth:
                push(child, -neg, len(out.tokens) - 1)
        return out.tokens, out.parents, out.depth, out.logp, out.counts


class TrieWriter:
    """One text being inserted: the trie's nodes of its suffixes that end at its last token (shortest
    first), so each new token adds one occurrence to each of those suffixes extended by it."""

    def __init__(self, trie: SuffixTrie):
        self.trie = trie
        self.tokens: list[int] = []
        self._frontier: list[int] = []

    def append(self, x: int) -> None:
        trie = self.trie
        children, count = trie.children, trie.count
        frontier = self._frontier  # frontier[i], i + 1 tokens deep, gets a child i + 2 deep (none at the cut)
        below = children[trie.root].get(x)
        if below is None:
            below = children[trie.root][x] = trie._new(1, trie.root)
        count[below] += 1
        new = [below]
        for depth, parent in enumerate(frontier[: trie.max_depth - 1], 2):
            at = children[parent]
            child = at.get(x)
            if child is None:  # its suffix link: the same string without its first token, made just before
                child = at[x] = trie._new(depth, below)
            count[child] += 1
            new.append(child)
            below = child
        self._frontier = new
        self.tokens.append(x)

    def match(self, window: int) -> tuple[int, int]:
        """`SuffixTrie.match` of this text's end: the longest of its suffixes (at most `window` tokens)
        that has occurred with a continuation, read off the frontier (whose nodes are exactly its
        suffixes, shortest first, each linked to the one before) without walking the trie."""
        children = self.trie.children
        for length in range(min(window, len(self._frontier)), 0, -1):
            node = self._frontier[length - 1]
            if children[node]:
                return node, length
        return self.trie.root, 0

    def extend(self, tokens: Iterable[int]) -> None:
        for x in tokens:
            self.append(x)


@dataclass
class Candidates:
    """Continuations proposed for one sequence after its last token: node i is `tokens[i]` under node
    `parents[i]` (-1: directly after the sequence), `depth[i]` levels down, with the log of its path's
    estimated probability and how often the matched context was followed by its path. Parents come
    before children."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    match_len: int = 0  # tokens of the sequence's end matched in the index

    def __len__(self) -> int:
        return len(self.tokens)

    def paths(self) -> list[tuple[int, ...]]:
        """Each node's token path from the sequence's end."""
        out: list[tuple[int, ...]] = []
        for t, p in zip(self.tokens, self.parents):
            out.append((out[p] if p >= 0 else ()) + (t,))
        return out


class CandidateRows:
    """The candidates of B rows in flat arrays [B, width] (`SuffixIndex.lookup_rows`; what the tree merge
    reads): row b's `n[b]` candidates in its first columns of `tokens`, `parents` (among the row's, -1:
    directly after the sequence), `depth`, `counts` and `logp`, its match length in `match[b]` (0: none
    found); the columns past a row's `n` are zero. The integers are one int64 tensor (`ints`: tokens,
    parents, depth, counts, then n and match), the log-probabilities one float64 tensor: two allocations
    and two addresses for the C code, whatever the rows (a step's fixed host cost, which a GPU waits on)."""

    def __init__(self, rows: int, width: int):
        self.rows, self.width = rows, width
        self.ints = torch.zeros(4 * rows * width + 2 * rows, dtype=torch.long)
        self.logp = torch.zeros(rows, width, dtype=torch.float64)

    def _block(self, k: int) -> Tensor:
        return self.ints[k * self.rows * self.width:(k + 1) * self.rows * self.width].view(self.rows, self.width)

    tokens = property(lambda self: self._block(0))
    parents = property(lambda self: self._block(1))
    depth = property(lambda self: self._block(2))
    counts = property(lambda self: self._block(3))
    n = property(lambda self: self.ints[4 * self.rows * self.width:][:self.rows])
    match = property(lambda self: self.ints[4 * self.rows * self.width + self.rows:])

    @classmethod
    def of(cls, candidates: Sequence[Candidates], width: int | None = None) -> CandidateRows:
        """Each `Candidates` of a list as a row (`width`: the columns, at least the longest's)."""
        out = cls(len(candidates), max([len(c) for c in candidates] + [width or 0]))
        for b, c in enumerate(candidates):
            out.put(b, c)
        return out

    def put(self, b: int, c: Candidates) -> None:
        """Row b's candidates from a `Candidates`."""
        n = len(c)
        for name in ("tokens", "parents", "depth", "logp", "counts"):
            getattr(self, name)[b, :n] = torch.tensor(getattr(c, name), dtype=getattr(self, name).dtype)
        self.n[b], self.match[b] = n, c.match_len

    def __len__(self) -> int:
        return self.rows

    def row(self, b: int) -> Candidates:
        """Row b as a `Candidates`."""
        n = int(self.n[b])
        return Candidates(*(getattr(self, name)[b, :n].tolist() for name in ("tokens", "parents", "depth", "logp",
                                                                               "counts")), int(self.match[b]))


@dataclass(frozen=True)
class IndexLimits:
    window: int = 8  # most tokens of a sequence's end matched (a lookup's time is proportional to them)
    depth: int = 8  # deepest continuation proposed
    responses: int = 16  # finished responses kept per prompt (the most recent)
    # indexed tokens over all prompts; least recently used prompts dropped past it. A token of text that does not
    # repeat costs up to window + depth nodes: 1.0 KiB at 16 with the C trie, 4.1 with the Python one
    # (tools/index_cost.py), so about 0.2 GB at the cap
    max_tokens: int = 200_000
    prior: float = 1.0  # a continuation seen c times of n after a match of m tokens: probability c / (n + prior / m)

    @classmethod
    def of(cls, speculation) -> IndexLimits:
        """The limits a run's `speculation` config section sets (its index_* keys)."""
        return cls(window=speculation.index_window, depth=speculation.index_depth,
                   responses=speculation.index_responses, max_tokens=speculation.index_max_tokens,
                   prior=speculation.index_prior)

    def __post_init__(self) -> None:
        for key in ("window", "depth", "responses", "max_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"index {key} must be >= 1, got {getattr(self, key)}")
        if self.prior < 0:
            raise ValueError(f"index prior must be >= 0, got {self.prior}")


class _Prompt:
    """One prompt key's trie: its prompt, finished responses (oldest first) and open responses."""

    def __init__(self, prompt: Sequence[int], limits: IndexLimits, trie: type):
        self.prompt = list(prompt)
        self.trie = trie(limits.window + limits.depth)
        self.tail = list(prompt[-(limits.window + limits.depth):])
        self.trie.insert(prompt)
        self.tokens = len(prompt)  # indexed tokens
        self.history: deque[list[int]] = deque()
        self.pending: deque[list[int]] = deque()  # remembered responses (`SuffixIndex.remember`), not yet in the trie
        self.open = 0


class Response:
    """A response being written into its prompt's index (`SuffixIndex.open`): extend it with the
    tokens as they are emitted, look up candidates after its last one, close it when it finishes."""

    def __init__(self, index: SuffixIndex, key: Hashable, entry: _Prompt):
        self.index, self.key, self.entry = index, key, entry
        self.writer = entry.trie.insert(entry.tail)
        entry.tokens += len(entry.tail)
        self.written = 0  # response tokens written
        self.closed = False

    def extend(self, tokens: Sequence[int]) -> None:
        self.writer.extend(tokens)
        self.written += len(tokens)
        self.entry.tokens += len(tokens)
        self.index.tokens += len(tokens)

    def lookup(self, budget: int, depth: int | None = None, min_prob: float = 0.0) -> Candidates:
        """Candidates after this response's last token: at most `budget` nodes, `depth` levels deep (as
        `SuffixIndex.lookup` of its text finds them, matched from the writer's frontier)."""
        return self.index.lookup(self.key, self.writer.tokens, budget, depth, min_prob, writer=self.writer)

    def close(self, tidy: bool = True) -> None:
        self.index.close(self, tidy)


class SuffixIndex:
    """Suffix tries of what each prompt's responses wrote (module docstring). Keys are any hashable
    value that identifies a prompt across calls (the engine uses its token ids)."""

    def __init__(self, limits: IndexLimits | None = None, compiled: bool | None = None):
        """`compiled`: the C trie (True), the Python one (False), or the C one where it was built (None)."""
        if compiled is None:
            compiled = CompiledTrie is not None
        if compiled and CompiledTrie is None:
            raise RuntimeError("the compiled suffix trie (fastgrpo/speculation/_suffix_trie.c) is not built: "
                               "reinstall fastgrpo (`pip install -e .`) where a C compiler is found")
        self.trie_type = CompiledTrie if compiled else SuffixTrie
        self.limits = limits or IndexLimits()
        self.prompts: OrderedDict[Hashable, _Prompt] = OrderedDict()  # least recently used first
        self.tokens = 0
        self.evicted = 0  # prompts dropped for the memory cap
        self._untidy: list[tuple[Hashable, _Prompt]] = []  # prompts closed without their limits applied

    def open(self, key: Hashable, prompt: Sequence[int]) -> Response:
        """Start indexing a response of prompt `key` (visible to its siblings from its first token)."""
        entry = self._entry(key, prompt)
        self._index_pending(entry)
        entry.open += 1
        response = Response(self, key, entry)
        self.tokens += len(entry.tail)
        return response

    def _entry(self, key: Hashable, prompt: Sequence[int]) -> _Prompt:
        """The prompt's entry (made, with its prompt indexed, if new), as the most recently used."""
        entry = self.prompts.get(key)
        if entry is None:
            entry = self.prompts[key] = _Prompt(prompt, self.limits, self.trie_type)
            self.tokens += entry.tokens
        self.prompts.move_to_end(key)
        return entry

    def remember(self, key: Hashable, prompt: Sequence[int], responses: Iterable[Sequence[int]]) -> None:
        """Finished responses of prompt `key` written elsewhere (another engine's share of a distributed
        rollout), kept as the prompt's latest history. They enter the trie only when this index next
        opens a response of the prompt or looks it up: an engine pays the insertion for the prompts it
        later gets, not for every prompt of the run (a prompt revisited here then drafts from all its
        responses, whichever engine wrote them)."""
        entry = self._entry(key, prompt)
        for response in responses:
            text = entry.tail + list(response)  # as an opened response is indexed: the prompt's tail first
            entry.pending.append(text)
            entry.tokens += len(text)
            self.tokens += len(text)
        while len(entry.pending) > self.limits.responses:  # only the latest can stay
            dropped = len(entry.pending.popleft())
            entry.tokens -= dropped
            self.tokens -= dropped
        self._evict()

    def _index_pending(self, entry: _Prompt) -> None:
        """Remembered responses into the trie, as history (the oldest beyond the limit removed)."""
        while entry.pending:
            text = entry.pending.popleft()
            entry.trie.insert(text)
            entry.history.append(text)
        self._trim(entry)

    def _trim(self, entry: _Prompt) -> None:
        while len(entry.history) > self.limits.responses:
            old = entry.history.popleft()
            entry.trie.remove(old)
            entry.tokens -= len(old)
            self.tokens -= len(old)

    def close(self, response: Response, tidy: bool = True) -> None:
        """The response is finished: it stays as the prompt's history; the prompt keeps its last
        `responses`, and prompts are dropped, least recently used first, while the index is over its cap.
        `tidy=False`: those two are left to the next `tidy()`, and lookups until then still see the
        responses beyond the limit. Removing a response from a trie walks all of it (milliseconds for
        thousands of tokens): the engine closes a finished sequence so, and tidies while a step computes."""
        if response.closed:
            return
        response.closed = True
        entry = response.entry
        entry.open -= 1
        if self.prompts.get(response.key) is not entry:  # its prompt was dropped meanwhile
            return
        entry.history.append(response.writer.tokens)
        self._untidy.append((response.key, entry))
        if tidy:
            self.tidy()

    def tidy(self) -> None:
        """Apply what closes with `tidy=False` left: each such prompt keeps its last `responses`, then the
        memory cap drops the least recently used prompts."""
        if not self._untidy:
            return
        for key, entry in self._untidy:
            if self.prompts.get(key) is entry:
                self._trim(entry)
        self._untidy.clear()
        self._evict()

    def _evict(self) -> None:
        for key in [k for k, e in self.prompts.items() if e.open == 0]:
            if self.tokens <= self.limits.max_tokens:
                return
            self.tokens -= self.prompts.pop(key).tokens
            self.evicted += 1

    def lookup(self, key: Hashable, context: Sequence[int], budget: int, depth: int | None = None,
               min_prob: float = 0.0, writer: TrieWriter | None = None) -> Candidates:
        """Continuations of `context` (a sequence of prompt `key`; its last `window` tokens are
        matched) from that prompt's index: empty if the prompt is unknown or nothing matches.
        `writer`: the context's own writer in that prompt's trie, from which the match is read."""
        entry = self.prompts.get(key)
        if entry is None:
            out = Candidates()
        else:
            self.prompts.move_to_end(key)
            if entry.pending:
                self._index_pending(entry)
            if writer is not None and writer.trie is entry.trie:
                node, length = writer.match(self.limits.window)
            else:
                node, length = entry.trie.match(context, self.limits.window)
            depth = self.limits.depth if depth is None else min(depth, self.limits.depth)
            out = Candidates() if length == 0 else Candidates(*entry.trie.continuations(
                node, budget, depth, self.limits.prior / length, min_prob))
            out.match_len = length if out.tokens else 0
        return out

    def lookup_rows(self, responses: Sequence[Response], budget: int) -> tuple[CandidateRows, int]:
        """`lookup(budget)` of each response, as rows of flat arrays, and how many rows found a match. With
        the C trie, one call for every row and no Python object a candidate (a step of a few hundred rows
        made tens of thousands of them, on the host work a step waits for); the same candidates, match
        lengths and order of use as `Response.lookup` row by row, which runs instead where a response's
        prompt was dropped while it was written."""
        out = CandidateRows(len(responses), budget)
        whole = compiled_lookup_rows is not None and self.trie_type is CompiledTrie
        prompts = self.prompts
        for r in responses:  # (each row's prompt used in turn, as row-by-row lookups use them)
            entry = prompts.get(r.key)
            if entry is not r.entry:
                whole = False
            elif entry is not None:
                prompts.move_to_end(r.key)
                if entry.pending:
                    self._index_pending(entry)
        if whole:
            matched = compiled_lookup_rows([r.writer for r in responses], self.limits.window, budget,
                                           self.limits.depth, self.limits.prior, 0.0, out.ints.data_ptr(),
                                           out.logp.data_ptr())
            return out, matched
        for b, r in enumerate(responses):
            out.put(b, r.lookup(budget))
        return out, int((out.match > 0).sum())

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the index: each prompt's key, prompt and finished responses (as
        indexed; remembered ones after the rest), least recently used first, and the limits they were kept under. Responses still being
        written are not kept (a checkpoint falls between rollouts, when none is). Keys are saved as lists:
        `load_state_dict` makes them tuples, the engine's keys (a prompt's token ids)."""
        self.tidy()
        return {"limits": asdict(self.limits),
                "prompts": [{"key": list(key), "prompt": e.prompt,
                             "history": [list(r) for r in (*e.history, *e.pending)]}
                            for key, e in self.prompts.items()]}

    def load_state_dict(self, state: dict) -> None:
        """Restore a checkpoint's `state_dict` (replacing what this index holds), in its order of use,
        under this index's limits (a smaller cap keeps the most recent). Each prompt's responses enter
        its trie when the prompt is next used, as remembered ones do (a resume does not index the
        prompts it will not meet soon)."""
        self.prompts.clear()
        self._untidy.clear()
        self.tokens = 0
        for saved in state["prompts"]:
            entry = self.prompts[tuple(saved["key"])] = _Prompt(saved["prompt"], self.limits, self.trie_type)
            for response in saved["history"][-self.limits.responses:]:
                entry.pending.append(list(response))
                entry.tokens += len(response)
            self.tokens += entry.tokens
        self._evict()

    def history(self, key: Hashable) -> list[list[int]]:
        """The prompt's finished responses kept, oldest first, each as indexed (the prompt's tail first),
        remembered ones included."""
        entry = self.prompts.get(key)
        return [] if entry is None else [*entry.history, *entry.pending][-self.limits.responses:]
