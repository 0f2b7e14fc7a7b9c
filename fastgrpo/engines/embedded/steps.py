"""Static decode steps: the engine's plain and speculative steps with every shape fixed in advance.

An eager step's shapes follow the data (the running rows, the longest row's context, how many draft
tokens were accepted), so it reads values back to the host to size its tensors, and on a GPU it is
bound by launching ~1,000 small kernels. A static step's shapes are fixed by three things the host
knows without asking the device: a batch bucket B (the running rows padded up), a context bucket C (the
longest row's cache length plus the step's new tokens, padded up) and, for a speculative step, the
tree's configuration. Its inputs and the state it advances live in persistent device buffers
(`StepState`, the KV caches, the draft's pending states), so the same function over the same buffers can
be captured once as a CUDA graph and replayed (`graphs.py`).

The rules every step function here keeps (`graphs.StepAudit` checks them, tests run it on each):
- no host sync: nothing is read back (no `.item()`, `.tolist()`, `bool(t)`, boolean indexing or other
  data-dependent sizes);
- no host-to-device copy: nothing is built from Python data inside a step;
- its results go to one packed tensor ([B, 3 L + 1] float64: tokens, log-probabilities, the accepted path,
  accepted counts, draft finiteness), which the engine copies to the host once per step.

Rows: the running batch is rows 0..n-1 of the caches and the step runs rows 0..B-1. Rows n..B-1 hold no
sequence (`active` false, length 0): they compute on their own unused cache rows, write at slot 0 (their
scratch slot), and advance nothing; nothing they compute is read. Attention reads C cache positions of
every row, the positions past a row's own being masked, so a row's results do not depend on the bucket.
Sampling stays keyed by (seed, request, position), never by row, so the tokens are those of the eager
step whatever the padding.

Trees the host merges (drafts from the suffix index, alone or with the learned draft's) cannot be built
inside a step: the index lives on the host. Such a step is two step functions with the host between them:
`propose` (the learned draft's tree, read back; hybrid only), the host's merge into `tree_input`'s rows
(`merged_rows`), then `verify`, which walks a fixed number of levels (`depth_bucket`). Two
read-backs a step instead of one, and no kernel launched while the host merges; the verify is the same
graph as a learned step's past its drafting.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from fastgrpo.engines.embedded.constants import arange, full
from fastgrpo.engines.embedded.model import InferenceModel, KVCache, block_mask, cache_kv
from fastgrpo.engines.embedded.pending import PendingStates
from fastgrpo.engines.embedded.tree import (Tree, Verified, ancestor_mask, compiled_merge_rows, draft_tree, host_tensor,
                                            hybrid_tree, merge_args, verify_tree)
from fastgrpo.models.draft import DraftHead
from fastgrpo.models.layers import EAGER, Pointwise
from fastgrpo.models.sampling import cuts, sample, sampling_logprobs, seed_key
from fastgrpo.speculation.node_calibration import NodeCalibration
from fastgrpo.speculation.spec import SpecConfig
from fastgrpo.speculation.suffix_index import CandidateRows
from fastgrpo.types import SamplingParams

# 1, 2, 4, 6, 8, 12, 16, 24, ...: powers of two and the halves between them, so a padded step does at most
# a third more work than its rows need, with few distinct shapes to capture (vLLM pads decode batches to
# 1, 2, 4 and multiples of 8; SGLang to a list of its own)
_LADDER = sorted({2**i for i in range(17)} | {3 * 2**i for i in range(1, 16)})


def batch_bucket(running: int) -> int:
    """The rows a static step runs for `running` sequences."""
    if running < 1:
        raise ValueError(f"a step needs at least one running sequence, got {running}")
    return _LADDER[bisect.bisect_left(_LADDER, running)]


CONTEXT_QUANTUM = 64  # context buckets are this many positions times the ladder: 64, 128, 256, 384, ...


def context_bucket(needed: int, cap: int) -> int:
    """The cache positions a static step's attention reads when it needs `needed` (the longest row's
    length plus the step's new tokens), at most `cap` (the engine's context plus the tree's room)."""
    if needed > cap:
        raise ValueError(f"a step needs {needed} cache positions, more than the cap {cap}")
    units = -(-needed // CONTEXT_QUANTUM)
    return min(CONTEXT_QUANTUM * _LADDER[bisect.bisect_left(_LADDER, units)], cap)


class StepState:
    """Per cache row, on the device: what a static step reads and advances besides the caches. The
    engine writes it only between steps (a prefill, a retired row, a new call's seed)."""

    def __init__(self, rows: int):
        self.pending = torch.zeros(rows, dtype=torch.long)  # the row's last sampled token (not yet cached)
        self.key = torch.zeros(rows, dtype=torch.long)  # its request's sampling key
        self.generated = torch.zeros(rows, dtype=torch.long)  # tokens emitted: the next one's sampling position
        self.active = torch.zeros(rows, dtype=torch.bool)  # a sequence runs in the row
        self.seed = torch.zeros((), dtype=torch.long)  # seed_key of the call's seed

    def set_seed(self, seed: int) -> None:
        self.seed.fill_(seed_key(seed))

    def start_rows(self, first: int, pending: list[int], keys: list[int], generated: list[int]) -> None:
        """New sequences in rows first.. (after their prefill)."""
        rows = slice(first, first + len(pending))
        device = self.pending.device
        self.pending[rows] = torch.tensor(pending, device=device)
        self.key[rows] = torch.tensor(keys, device=device)
        self.generated[rows] = torch.tensor(generated, device=device)
        self.active[rows] = True

    def move_row(self, src: int, dst: int) -> None:
        for t in (self.pending, self.key, self.generated, self.active):
            t[dst] = t[src]

    def clear_row(self, row: int) -> None:
        self.active[row] = False


@dataclass
class StepOutput:
    packed: Tensor  # [B, 3 L + 1] float64 (`pack`): what the host reads back
    hidden: Tensor  # [B, n, H] the target's final states of the step's tokens (the draft learns from them)
    # [B, n, V] sampling log-probabilities at each of them, when top-k / top-p cut the distribution (the
    # host reads the sets they keep); else None: a graph's outputs stay allocated as long as the graph, and
    # [B, n, V] in fp32 is hundreds of MB a speculative graph at a real vocabulary
    logprobs: Tensor | None
    experts: Tensor | None = None  # [B, n, sparse layers, k] int16: a mixture of experts' routing, when recorded


def pack(tokens: Tensor, logprobs: Tensor, path: Tensor, accepted: Tensor, finite: Tensor) -> Tensor:
    """tokens, logprobs [B, L], path [B, L - 1], accepted, finite [B] -> [B, 3 L + 1] float64 (token ids
    are exact in float64; one tensor so that one device-to-host copy brings a step's results)."""
    return torch.cat([tokens.double(), logprobs.double(), path.double(), accepted[:, None].double(),
                      finite[:, None].double()], 1)


@dataclass
class StepResult:
    """A packed step output read back on the host, per running row."""

    tokens: list[list[int]]  # the tokens the step can emit (accepted + 1 of each row are valid)
    logprobs: list[list[float]]
    path: list[list[int]]  # tree indices of the accepted nodes
    accepted: list[int]
    finite: list[bool]  # the row's draft was finite (else it verified its root alone)

    # rows from which converting whole columns through numpy (a few calls of fixed cost) beats converting
    # each row's entries in Python (a cost per row): measured beside the engine's steps, tools/step_host_time.py
    COLUMNS_FROM = 32

    @classmethod
    def unpack(cls, packed: Tensor, levels: int) -> StepResult:
        L = levels
        if packed.shape[0] >= cls.COLUMNS_FROM:
            a = packed.numpy()  # (on the host: a view)
            return cls(a[:, :L].astype(np.int64).tolist(), a[:, L:2 * L].tolist(),
                       a[:, 2 * L:3 * L - 1].astype(np.int64).tolist(), a[:, 3 * L - 1].astype(np.int64).tolist(),
                       (a[:, 3 * L] > 0).tolist())
        rows = packed.tolist()
        return cls([[int(x) for x in r[:L]] for r in rows], [r[L:2 * L] for r in rows],
                   [[int(x) for x in r[2 * L:3 * L - 1]] for r in rows], [int(r[3 * L - 1]) for r in rows],
                   [r[3 * L] > 0 for r in rows])


class StaticSteps:
    """The step functions over the engine's buffers. Each returns a `StepOutput` and advances the state
    of the active rows (cache lengths, pending tokens, sampling positions, the draft's pending states)."""

    def __init__(self, model: InferenceModel, cache: KVCache, state: StepState):
        self.model, self.cache, self.state = model, cache, state
        self.draft: DraftHead | None = None
        self.draft_cache: KVCache | None = None
        self._tree_inputs: dict[int, Tensor] = {}

    def _uniforms(self, B: int, levels: int, sampling: SamplingParams) -> Tensor | None:
        """[B, levels]: the sampling noise of each row's next `levels` positions (None: greedy)."""
        if sampling.greedy:
            return None
        st = self.state
        position = st.generated[:B, None] + arange(levels, st.generated.device)
        return self.model.static_ops.uniforms(st.seed, st.key[:B, None], position)

    def _advance(self, B: int, tokens: Tensor, accepted: Tensor) -> None:
        """Active rows keep accepted + 1 new tokens: cached, counted, the last one pending."""
        st, rows = self.state, slice(0, B)
        active = st.active[rows]
        emitted = (accepted + 1) * active
        self.cache.lengths[rows] += emitted
        st.generated[rows] += emitted
        last = tokens.gather(1, accepted[:, None])[:, 0]
        st.pending[rows] = torch.where(active, last, st.pending[rows])

    def plain(self, B: int, ctx: int, sampling: SamplingParams, states: PendingStates | None,
              routing: bool = False) -> StepOutput:
        """One token for each row (rows 0..B-1, attention over `ctx` positions); `routing`: with the
        experts each row's token ran (a mixture of experts' routing replay)."""
        st, rows = self.state, slice(0, B)
        routed = [] if routing else None
        logits, hidden = self.model.forward(st.pending[rows, None], self.cache, rows, ctx=ctx, routing=routed)
        logprobs = sampling_logprobs(logits, sampling)  # [B, 1, V]
        u = self._uniforms(B, 1, sampling)
        token = sample(logprobs[:, 0], sampling, None if u is None else u[:, 0])
        token_lp = logprobs[:, 0].gather(1, token[:, None])
        if states is not None:  # the state at each row's pending position, and the token sampled after it
            states.put(arange(B, token.device), self.cache.lengths[rows], hidden[:, 0], token)
        none, finite = full((B,), 0, torch.long, token.device), full((B,), True, torch.bool, token.device)
        self._advance(B, token[:, None], none)
        return StepOutput(pack(token[:, None], token_lp, none[:, None][:, :0], none, finite), hidden,
                          logprobs if cuts(sampling) else None, _stacked(routed))

    def speculate(self, config: SpecConfig, B: int, ctx: int, sampling: SamplingParams,
                  states: PendingStates, routing: bool = False) -> StepOutput:
        """Catch the draft up, draft a tree of `config` per row, verify all in one target forward, keep each
        row's accepted path. `ctx` covers every row's length + config.num_verify. `routing`: with the
        experts each tree node ran (the engine keeps the accepted nodes')."""
        tree = self._learned_tree(config, B, ctx, states)
        assert tree.valid is not None  # static trees always say which nodes are verified
        return self._verify(tree, config.depth, B, ctx, sampling, states, routing, tree.valid[:, 1:].any(-1))

    def propose(self, config: SpecConfig, B: int, ctx: int, states: PendingStates) -> Tensor:
        """The learned half of a merged step (drafts: hybrid): catch the draft up and draft a tree of
        `config` per row, packed for the host's merge with the index's candidates (`merged_rows`)."""
        tree = self._learned_tree(config, B, ctx, states)
        assert tree.valid is not None and tree.score is not None
        return torch.cat([tree.tokens.double(), tree.parents.double(), tree.depth.double(), tree.score.double(),
                          tree.valid[:, 1:].any(-1, keepdim=True).double()], 1)

    def verify(self, nodes: int, depth: int, B: int, ctx: int, sampling: SamplingParams,
               states: PendingStates, routing: bool = False) -> StepOutput:
        """Verify the trees of `nodes` nodes the host built (drafts: index | hybrid) and copied into
        `tree_input(nodes)` (`merged_rows`), walking `depth` levels: as `speculate` past its drafting."""
        N, t = nodes, self.tree_input(nodes)[:B]
        parents = t[:, N:2 * N]
        tree = Tree(t[:, :N], parents, t[:, 2 * N:3 * N], ancestor_mask(parents, depth), valid=t[:, 3 * N:] > 0)
        return self._verify(tree, depth, B, ctx, sampling, states, routing, full((B,), True, torch.bool, t.device))

    def tree_input(self, nodes: int) -> Tensor:
        """The device buffer [rows, 4 nodes] int64 that `verify` reads a host-built tree from (one per tree
        size, made on first use: a graph replays on the buffer it was captured with)."""
        buffer = self._tree_inputs.get(nodes)
        if buffer is None:
            buffer = self._tree_inputs[nodes] = torch.zeros(len(self.state.pending), 4 * nodes, dtype=torch.long,
                                                            device=self.state.pending.device)
        return buffer

    def _learned_tree(self, config: SpecConfig, B: int, ctx: int, states: PendingStates) -> Tree:
        assert self.draft is not None and self.draft_cache is not None
        ops = self.model.static_ops
        root_features = catch_up(self.draft, self.draft_cache, self.cache, states, B, states.window, ctx, ops,
                                 static=True)
        return draft_tree(self.draft, self.draft_cache, slice(0, B), root_features, self.state.pending[:B], config,
                          ctx=ctx, ops=ops)

    def _verify(self, tree: Tree, depth: int, B: int, ctx: int, sampling: SamplingParams, states: PendingStates,
                routing: bool, finite: Tensor) -> StepOutput:
        """Verify `tree` in one target forward over `ctx` positions, walking `depth` levels, and keep each
        row's accepted path (keys/values, the draft's pending states, the rows' state)."""
        rows = slice(0, B)
        start = self.cache.lengths[rows].clone()
        routed = [] if routing else None
        logits, hidden = self.model.forward(tree.tokens, self.cache, rows, positions=start[:, None] + tree.depth,
                                            new_mask=tree.mask, ctx=ctx, routing=routed)
        node_logprobs = sampling_logprobs(logits, sampling)
        result = verify_tree(node_logprobs, tree, sampling, self._uniforms(B, depth + 1, sampling), depth=depth)
        keep_path(self.cache, B, start, result.path, result.accepted)
        keep_states(states, start, hidden, result)
        self._advance(B, result.tokens, result.accepted)
        return StepOutput(pack(result.tokens, result.logprobs, result.path, result.accepted, finite),
                          hidden, node_logprobs if cuts(sampling) else None, _stacked(routed))


def depth_bucket(deepest: int, cap: int) -> int:
    """The levels a static verify of a host-built tree walks: its deepest node's depth up the ladder (few
    graphs for the depths index chains reach), at most `cap`."""
    return min(_LADDER[bisect.bisect_left(_LADDER, max(deepest, 1))], cap)


def node_widths(nodes: int) -> list[int]:
    """The widths (nodes a row, root included) a static verify runs a tree of `nodes` cut on the host at
    (`cut_tree`): the ladder below `nodes`, then `nodes` (a few graphs per tree shape)."""
    return [w for w in _LADDER if w < nodes] + [nodes]


def cut_tree(tree: Tree, chosen: Tensor, finite: Tensor | None = None) -> Tree:
    """The learned trees `tree` [B, N] (`unpack_learned`) keeping each row's root and `chosen` [B, N - 1]
    non-root nodes (ancestor-closed: a per-sequence budget's `select`), moved to the row's first columns in
    their order (parents before children) and renumbered, cut to the narrowest of `node_widths(N)` that
    holds every row's; the columns past a row's nodes are left out (`valid` false). `finite` [B]: rows
    whose draft was finite; the others keep their root alone (the static step's rule). On the host, in numpy
    (a GPU waits for it; torch calls on arrays this small cost several times as much)."""
    B, N = tree.tokens.shape
    keep = np.concatenate([np.ones((B, 1), dtype=bool), chosen.cpu().numpy()], 1)
    if finite is not None:
        keep[:, 1:] &= finite.cpu().numpy()[:, None]
    count = keep.sum(1)
    width = next(w for w in node_widths(N) if w >= int(count.max()))
    cols = np.argsort(~keep, axis=1, kind="stable")[:, :width]  # kept first, in order
    position = keep.cumsum(1) - 1  # a kept node's column in the cut tree
    valid = np.arange(width)[None] < count[:, None]

    def cut(t: Tensor) -> np.ndarray:
        return np.take_along_axis(t.cpu().numpy(), cols, 1)

    parents = np.where(valid, np.take_along_axis(position, cut(tree.parents), 1), 0)
    host = torch.from_numpy
    return Tree(host(cut(tree.tokens)), host(parents), host(cut(tree.depth)),
                torch.empty(B, width, 0, dtype=torch.bool), None if tree.score is None else host(cut(tree.score)),
                host(valid))


def tree_rows(tree: Tree, out: Tensor, depth: int) -> None:
    """Write a host-built tree of B rows into `out` [rows, 4 N] int64 as `StaticSteps.verify` reads it: each
    node's token, parent, depth and whether it is verified. A node left out (the merge's padding, or one
    deeper than the `depth` levels the step walks) becomes a padding node: token 0 under the root at depth
    1, which attends to the root and itself and is never accepted. Rows B.. (padded rows) hold a root alone."""
    B, N = tree.tokens.shape
    valid = tree.depth <= depth
    if tree.valid is not None:
        valid &= tree.valid
    left_out = ~valid
    torch.cat([tree.tokens.masked_fill(left_out, 0), tree.parents.masked_fill(left_out, 0),
               tree.depth.masked_fill(left_out, 1), valid.long()], 1, out=out[:B])
    if len(out) > B:
        padded = out[B:].view(-1, 4, N)
        padded.zero_()
        padded[:, 2, 1:] = 1
        padded[:, 3, 0] = 1


def unpack_learned(packed: Tensor, nodes: int) -> tuple[Tree, Tensor]:
    """`StaticSteps.propose`'s packed trees of `nodes` nodes read back on the host: the learned tree of
    each row (new tensors, not views of the read-back buffer, which the step's verify overwrites) and
    whether each row's draft was finite [B]. Its mask is left empty ([B, N, 0]): the merge reads the tokens,
    parents, depths and scores alone, and the merged tree makes its own."""
    N = nodes
    ids = packed[:, :3 * N].long()
    tree = Tree(ids[:, :N], ids[:, N:2 * N], ids[:, 2 * N:], torch.empty(len(packed), N, 0, dtype=torch.bool),
                packed[:, 3 * N:4 * N].float())
    return tree, packed[:, 4 * N] > 0


def merged_rows(packed: Tensor | None, candidates: CandidateRows, root_tokens: Tensor, nodes: int,
                calibration: NodeCalibration | None, max_depth: int, out: Tensor,
                compiled: bool | None = None) -> tuple[Tree, int, bool]:
    """A merged static step's tree on the host, written into `out` [rows, 4 nodes] as `verify` reads it
    (`tree_rows`; rows past the running ones a root alone): `hybrid_tree` of the learned trees `propose`
    packed (read back; None: the index alone) and the index's `candidates`, no node deeper than
    `max_depth`. Returns the merged tree (for the calibration: no mask or scores), its deepest verified
    node's depth (0: none), and whether every row's draft was finite (if not, every row merged the
    index's candidates alone, as an eager step would).

    On a GPU the device waits for this, so it runs as one C call from the read-back to the verify's input
    (`_tree_merge.merge_rows`) where the install built it: as tensor operations around the C merge
    (`unpack_learned`, `hybrid_tree`, `tree_rows`: `compiled=False`) the steps around the merge were most
    of its time. Both write the same rows and the same tree."""
    B, N = len(root_tokens), nodes
    if compiled is None:
        compiled = compiled_merge_rows is not None
    if not compiled or B == 0 or N < 2:
        learned, finite = None, True
        if packed is not None:
            learned, rows_finite = unpack_learned(packed, (packed.shape[1] - 1) // 4)
            finite = bool(rows_finite.all())
        tree = hybrid_tree(learned if finite else None, candidates, root_tokens, N, calibration,
                           max_depth=max_depth)
        tree_rows(tree, out, max_depth)
        depth = tree.depth if tree.valid is None else tree.depth.masked_fill(~tree.valid, 0)
        return tree, int(depth.max()), finite
    if compiled_merge_rows is None:
        raise RuntimeError("the compiled merge (fastgrpo/engines/embedded/_tree_merge.c) is not built")
    cpu = torch.device("cpu")
    if out.device != cpu or out.dtype != torch.long or not out.is_contiguous() or out.shape[1] != 4 * N:
        raise ValueError(f"merged_rows writes a contiguous int64 CPU tensor [rows, {4 * N}], not {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    if packed is not None:
        packed = host_tensor(packed, torch.float64)
        L = (packed.shape[1] - 1) // 4
    roots = host_tensor(root_tokens, torch.long)
    if len(candidates) != B:
        raise ValueError(f"{len(candidates)} candidate rows for {B} rows")
    args, _counts = merge_args(candidates, N, calibration, max_depth)
    record = [torch.empty(B, N, dtype=dtype) for dtype in (torch.long, torch.long, torch.long, torch.int8,
                                                           torch.float32, torch.bool)]
    deepest, finite = compiled_merge_rows(None if packed is None else packed.data_ptr(), 1 if packed is None else L,
                                          B, len(out), roots.data_ptr(), *args, *(t.data_ptr() for t in record),
                                          out.data_ptr())
    tokens, parents, depth, source, raw, valid = record
    return (Tree(tokens, parents, depth, torch.empty(B, N, 0, dtype=torch.bool), valid=valid, source=source, raw=raw,
                 match=candidates.match), deepest, finite)


def _stacked(routed: list[Tensor] | None) -> Tensor | None:
    """The sparse layers' experts [B, n, k] each, as [B, n, layers, k]; None when not recorded."""
    return None if routed is None else torch.stack(routed, 2)


def catch_up(draft: DraftHead, draft_cache: KVCache, cache: KVCache, states: PendingStates, B: int, width: int,
             ctx: int, ops: Pointwise = EAGER, static: bool = False) -> Tensor:
    """Feed the draft the target states of rows 0..B-1 it has not seen (accepted paths, decoded and
    prefilled tokens; at most a window of them: a row further behind feeds its last `states.window` and
    attends to those onwards) in one forward of `width` tokens a row over `ctx` draft-cache positions.
    Rows with fewer states pad; the padding writes to the row's first free slot and is never read.
    Returns the draft's state at each row's pending token [B, H] (its prediction of the next one).
    The eager step passes the widest row's count and the longest row's length + 1, the static one
    (`static`) the window and its context bucket."""
    rows = slice(0, B)
    end = cache.lengths[rows]
    behind = end - draft_cache.lengths[rows]
    counts = behind.clamp(0, states.window)
    start = end - counts
    hidden, tokens = states.take(start, width)
    visible = draft_cache.visible_from[rows]
    visible.copy_(torch.where(counts < behind, start, visible))
    slots = torch.minimum(start[:, None] + arange(width, end.device), end[:, None])
    feats = draft.features(hidden, tokens, slots, block_mask(start, width, ctx, None, visible, static),
                           cache_kv(draft_cache, 0, rows, slots, ctx), ops)
    draft_cache.lengths[rows] = end
    return feats.gather(1, (counts - 1).clamp(min=0)[:, None, None].expand(B, 1, feats.shape[-1]))[:, 0]


def keep_path(cache: KVCache, B: int, start: Tensor, path: Tensor, accepted: Tensor) -> None:
    """Move each row's accepted nodes' keys/values to the positions right after its root, for all D
    levels of the path (a level past a row's accepted count copies the root's slot onto itself)."""
    D = path.shape[1]
    if D == 0:
        return
    k = arange(D, path.device, 1)
    valid = k[None] <= accepted[:, None]
    src = start[:, None] + torch.where(valid, path, 0)
    dst = start[:, None] + torch.where(valid, k[None], 0)
    r = arange(B, path.device)[:, None]
    for c in (cache.k, cache.v):
        c[:, r, dst] = c[:, r, src]


def keep_states(states: PendingStates, start: Tensor, hidden: Tensor, result: Verified) -> None:
    """The draft's pending states of a verify step: the root's and each accepted node's, with the token
    after each, at positions start .. start + accepted. All D + 1 entries are written: those past a row's
    accepted count land at positions past its new length, which the next catch-up does not read and later
    steps overwrite (the window holds more than D + 1 positions, so they never alias a kept one)."""
    B, D = result.path.shape
    if D + 1 > states.window:
        raise ValueError(f"a static step of depth {D} needs a draft window over {D}, not {states.window}")
    k = arange(D + 1, start.device)
    nodes = torch.cat([full((B, 1), 0, torch.long, start.device), result.path], 1)
    rows = arange(B, start.device)[:, None].expand(B, D + 1)
    states.put(rows.reshape(-1), (start[:, None] + k).reshape(-1),
               hidden[rows, nodes].reshape(B * (D + 1), -1), result.tokens.reshape(-1))
