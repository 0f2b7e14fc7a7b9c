"""Dynamic draft trees (EAGLE-2) and lossless verification by sampling (docs/speculation.md).

Drafting: the draft proposes the top-k tokens after the root; then, level by level, it expands the k
most probable frontier nodes (by cumulative draft log-probability) into their top-k children. Of all
nodes proposed, the `num_verify - 1` most probable are kept: since a child's cumulative probability
never exceeds its parent's, the kept set is a tree (every kept node's ancestors are kept).

Verification: the target scores every tree node in one forward. Then, starting at the root, a token x
is sampled from the target's sampling distribution at the current node; if x is one of the node's
children, we move there and sample again; otherwise x is emitted and the step ends. Every emitted
token is an ordinary sample from the target given all tokens before it, whatever the draft proposed,
so the output distribution is exactly the target's. The draft only decides how often we get to
continue, i.e. how many tokens one target forward yields. Greedy decoding is the argmax special case.

Hybrid trees (`hybrid_tree`, `speculation.drafts: index | hybrid`, merged on the host): the learned
draft's nodes and the suffix index's continuations (`speculation/suffix_index.py`: what the prompt's
earlier responses and its live siblings wrote) merged into one tree of the same node budget, a path
both propose being one node. Verification is the same, so the output stays exactly the target's
(docs/drafts.md).

Both functions run eagerly (shapes from the data: the engine's eager step) or statically (`ctx` and
`depth` given: every shape fixed by the tree's configuration and the step's context bucket, no value read
back to the host), which a graph-captured step (`steps.py`) needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from fastgrpo.engines.embedded.constants import arange, constant, eye, full
from fastgrpo.engines.embedded.model import KVCache, block_mask, cache_kv
from fastgrpo.models.sampling import sample
from fastgrpo.speculation.spec import SpecConfig
from fastgrpo.types import SamplingParams
from fastgrpo.models.draft import DraftHead
from fastgrpo.models.layers import EAGER, Pointwise
from fastgrpo.speculation.node_calibration import LONG_MATCH, NodeCalibration, node_classes
from fastgrpo.speculation.suffix_index import CandidateRows

try:  # hybrid_tree's merge and observe_verified's counting in C, where the install built them
    from fastgrpo.engines.embedded._tree_merge import merge as compiled_merge
    from fastgrpo.engines.embedded._tree_merge import merge_rows as compiled_merge_rows
    from fastgrpo.engines.embedded._tree_merge import observe as compiled_observe
except ImportError:
    compiled_merge = compiled_merge_rows = compiled_observe = None

NO_DEPTH_LIMIT = 2**62  # the C merge's max_depth for none


class NonFiniteDraft(RuntimeError):
    """The draft produced NaN/inf: the engine decodes plainly for the step instead."""


def _draft_logprobs(draft: DraftHead, features: Tensor, static: bool, ops: Pointwise = EAGER) -> Tensor:
    """Log-probabilities [..., V]; eagerly, non-finite ones raise at once. Statically they are left to
    `draft_tree`'s one check of its scores: a non-finite logit makes log_softmax's whole row NaN (its
    log-sum-exp is NaN or inf), so every top-k score drawn from that row, and every descendant's, is NaN."""
    logp = torch.log_softmax(draft.logits(features, ops).float(), dim=-1)
    if not static and not bool(torch.isfinite(logp).all()):
        raise NonFiniteDraft("non-finite draft logits")
    return logp


@dataclass
class Tree:
    tokens: Tensor  # [B, N] root first, then nodes ordered by depth
    parents: Tensor  # [B, N] index of each node's parent (root: 0)
    depth: Tensor  # [B, N] root 0
    mask: Tensor  # [B, N, N] ancestors (self included)
    score: Tensor | None = None  # [B, N] cumulative draft log-probability of each node (root 0)
    valid: Tensor | None = None  # [B, N] the nodes to verify (None: all); ancestor-closed per row
    source: Tensor | None = None  # [B, N] who proposed each node: LEARNED | INDEX bits (None: the learned draft)
    raw: Tensor | None = None  # [B, N] a merged tree's raw conditional estimate of each node (`node_calibration`)
    match: Tensor | None = None  # [B] a merged tree's index match length per row

    def restricted(self, nodes: Tensor) -> Tree:
        """This tree verifying only `nodes` [B, N - 1] of each row's non-root nodes (an ancestor-closed
        set): the others are neither attended to nor accepted, and cost no matmul work."""
        B, device = len(nodes), nodes.device
        valid = torch.cat([full((B, 1), True, torch.bool, device), nodes], 1)
        # a left-out node still sees itself: no query row is wholly masked (attention would give NaN)
        seen = valid[:, None, :] | eye(valid.shape[1], device)
        return Tree(self.tokens, self.parents, self.depth, self.mask & seen, self.score, valid,
                    self.source, self.raw, self.match)


@torch.inference_mode()
def draft_tree(draft: DraftHead, cache: KVCache, rows: slice, root_features: Tensor, root_tokens: Tensor,
               cfg: SpecConfig, ctx: int | None = None, ops: Pointwise = EAGER) -> Tree:
    """Propose a tree per sequence. root_features [B, H]: the draft's predicted state at the root
    (the pending token), from which the first level is read. Expansion keys/values go to the draft
    cache after each row's length and are discarded (the length does not move).

    A draft that produces NaN/inf raises NonFiniteDraft; statically (`ctx` given: the draft cache
    positions attention reads, at least every row's length + 1) nothing can be raised without reading
    the flag back, so a row whose draft is not finite verifies its root alone (a plain step's token).
    Statically every level attends over the same ctx + E positions (E: the expansion entries of all
    levels; a later level's are masked until written), so that the mask's parts common to all levels are
    made once. `ops`: how the draft's pointwise regions run (`layers.Pointwise`)."""
    B, k, device = root_tokens.shape[0], cfg.topk, root_tokens.device
    static = ctx is not None
    start, visible_from = cache.lengths[rows], cache.visible_from[rows]
    E = (cfg.depth - 1) * k  # expansion entries per sequence
    row_idx = arange(B, device, rows.start)[:, None]
    if static and E > 0:
        kpos, tree_ctx = arange(ctx + E, device), ctx + E
        rel = kpos - start[:, None, None]  # [B, 1, ctx + E]: key position relative to the first entry
        visible = kpos >= visible_from[:, None, None]
        cached, entry = (rel < 0) & visible, (rel >= 0) & (rel < E) & visible
        entry_of = rel.clamp(0, E - 1)

    logp = _draft_logprobs(draft, root_features, static, ops)
    score, tok = logp.topk(k, dim=-1)  # level 1
    levels_tok, levels_score, levels_parent = [tok], [score], [full((B, k), -1, torch.long, device)]
    n_nodes = k  # nodes numbered level by level
    # the current level's nodes expand from the state of their parent, the p-th of the level above (p =
    # node // k): those parents' states, numbers and expansion entries they descend from
    parent_feat = root_features[:, None].expand(B, k, -1)  # (level 1: p = node, all from the root)
    parent_anc = None
    if cfg.depth > 1:  # every level's cache slots and position, made at once (a level takes views)
        slots_all, positions = start[:, None] + arange(E, device), start[:, None] + arange(cfg.depth - 1, device)
    for d in range(1, cfg.depth):
        sel = score.topk(k, dim=-1).indices  # expand the k most probable nodes of this level
        tok, score = tok.gather(1, sel), score.gather(1, sel)
        if d == 1:
            feat, node_id = parent_feat, sel
            anc = eye_block(k, E, device).expand(B, k, E)  # each node descends from its own entry alone
        else:
            p = sel // k
            feat = parent_feat.gather(1, p[:, :, None].expand(B, k, parent_feat.shape[-1]))
            anc = parent_anc.gather(1, p[:, :, None].expand(B, k, E))
            anc[:, :, (d - 1) * k: d * k] = eye(k, device)  # and from its own entry (this level's: unset before)
            node_id = sel + (n_nodes - k * k)
        slots = slots_all[:, (d - 1) * k: d * k]
        if static:
            seen = torch.gather(anc[:, None], 3, entry_of[:, :, None].expand(B, 1, k, tree_ctx))
            mask = cached[:, None] | (entry[:, None] & seen)
        else:
            tree_ctx = int(start.max()) + d * k
            mask = block_mask(start, k, tree_ctx, anc[:, :, : d * k], visible_from)
        feat = draft.features(feat, tok, positions[:, d - 1: d].expand(B, k), mask,
                              cache_kv(cache, 0, rows, slots, tree_ctx, row_idx), ops)
        logp = _draft_logprobs(draft, feat, static, ops)
        cs, ct = logp.topk(k, dim=-1)  # [B, k, k]: each expanded node's k children
        tok, score = ct.flatten(1), (score[:, :, None] + cs).flatten(1)
        parent_feat, parent_anc = feat, anc
        levels_tok.append(tok), levels_score.append(score)
        levels_parent.append(node_id[:, :, None].expand(B, k, k).reshape(B, k * k))
        n_nodes += k * k

    tok, score, parent = torch.cat(levels_tok, 1), torch.cat(levels_score, 1), torch.cat(levels_parent, 1)
    depth = node_depths(k, cfg.depth, device)  # [n_nodes]
    # keep the most probable nodes; break exact ties toward shallower nodes so that parents win
    keep = (score.double() - tie_break(k, cfg.depth, device)).topk(cfg.num_verify - 1, dim=-1).indices
    order = torch.sort(depth[keep] * (n_nodes + 1) + keep, dim=-1).indices  # parents before children
    keep = keep.gather(1, order)
    N = cfg.num_verify
    # each kept node's number in the tree (1..N-1 in keep's order), at column n_nodes the root's (0): the
    # parent a level-1 node names (-1) reads it; -1 elsewhere (a kept node's parent is always kept)
    position = root_position(n_nodes, device).repeat(B, 1)
    position.scatter_(1, keep, arange(N - 1, device, 1).expand(B, -1))
    parents = position.gather(1, parent.gather(1, keep).remainder(n_nodes + 1))
    zero = full((B, 1), 0, torch.long, device)
    parents, tree_depth = torch.cat([zero, parents], 1), torch.cat([zero, depth[keep]], 1)
    tokens = torch.cat([root_tokens[:, None], tok.gather(1, keep)], 1)
    tree_score = torch.cat([full((B, 1), 0.0, torch.float32, device), score.gather(1, keep)], 1)
    if not static:
        if (parents < 0).any():  # cannot happen with finite scores; never let it crash a rollout
            raise NonFiniteDraft("draft tree is not ancestor-closed")
        return Tree(tokens, parents, tree_depth, ancestor_mask(parents, cfg.depth), tree_score)
    # static: a row with a non-finite draft (NaN among its scores, `_draft_logprobs`) keeps its root only.
    # Its NaN scores may have kept a node without its parent (-1 here): such a node hangs from the root,
    # so the tree's arrays stay indexable, and is never verified
    parents = parents.clamp(min=0)
    tree = Tree(tokens, parents, tree_depth, ancestor_mask(parents, cfg.depth), tree_score)
    return tree.restricted(torch.isfinite(score).all(-1, keepdim=True).expand(B, N - 1))


def eye_block(k: int, E: int, device: torch.device) -> Tensor:
    """[k, max(E, 1)] bool: the first level's expanded nodes' ancestry over the E expansion entries (node i
    descends from entry i alone)."""
    return constant(("eye_block", k, E, device), lambda: torch.eye(k, max(E, 1), dtype=torch.bool, device=device))


def node_depths(k: int, depth: int, device: torch.device) -> Tensor:
    """The depth of each node a draft tree proposes, numbered level by level (k, then k^2 a level)."""
    return constant(("node_depths", k, depth, device), lambda: torch.tensor(
        [1] * k + [d for d in range(2, depth + 1) for _ in range(k * k)], device=device))


def tie_break(k: int, depth: int, device: torch.device) -> Tensor:
    """1e-9 x each proposed node's depth (a float32 product, float64 out): subtracted from the scores, exact
    ties go to the shallower."""
    return constant(("tie_break", k, depth, device), lambda: (1e-9 * node_depths(k, depth, device)).double())


def root_position(n: int, device: torch.device) -> Tensor:
    """[1, n + 1]: -1 for each of n proposed nodes, 0 (the root's number) at column n."""
    return constant(("root_position", n, device), lambda: torch.tensor([[-1] * n + [0]], device=device))


LEARNED, INDEX = 1, 2  # Tree.source bits: the learned draft proposed the node, the suffix index did


def calibration_outcomes(tree: Tree, path: Tensor, accepted: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A merged tree's verified nodes whose parent was reached (the root, or a node on the accepted
    path: `Verified.path` and `.accepted`), row by row: each one's class id, raw conditional estimate and
    whether it was accepted (`NodeCalibration.observe`)."""
    assert tree.source is not None and tree.raw is not None and tree.match is not None
    B, N = tree.parents.shape
    kept = torch.arange(path.shape[1])[None] < accepted[:, None]
    on_path = torch.zeros(B, N, dtype=torch.long).scatter_add_(1, path, kept.long()) > 0
    reached = on_path.clone()
    reached[:, 0] = True
    counted = reached.gather(1, tree.parents) & (torch.arange(N) > 0)
    if tree.valid is not None:
        counted &= tree.valid
    classes = node_classes((tree.source & LEARNED) > 0, (tree.source & INDEX) > 0, tree.match[:, None])
    return classes[counted], tree.raw[counted], on_path[counted]


def index_accepted(tree: Tree, path: Tensor, accepted: Tensor) -> int:
    """Accepted nodes of a verified merged tree that the suffix index proposed (alone or with the draft)."""
    assert tree.source is not None
    on_path = torch.arange(path.shape[1])[None] < accepted[:, None]
    return int((((tree.source.gather(1, path) & INDEX) > 0) & on_path).sum())


def host_tensor(t: Tensor, dtype: torch.dtype) -> Tensor:
    """`t` as a contiguous CPU tensor of `dtype` for the C code (itself when it is one already: most are,
    and a conversion's call costs microseconds on a path taken every step)."""
    if t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous():
        return t
    return t.to("cpu", dtype).contiguous()


def observe_verified(calibration: NodeCalibration | None, tree: Tree, path: Tensor, accepted: Tensor,
                     compiled: bool | None = None) -> int:
    """Count a verified merged tree's outcomes (its accepted `path` and counts, as `Verified` holds them)
    into `calibration` (`calibration_outcomes`, then `NodeCalibration.observe`; None: nothing to count) and
    return the accepted nodes the index proposed (`index_accepted`): in C where built and every tensor is
    on the CPU (one pass over the rows, a few microseconds), else as tensor operations; the same counts
    either way."""
    assert tree.source is not None and tree.raw is not None and tree.match is not None
    counts = None if calibration is None else calibration.counts
    if compiled is None:
        compiled = (compiled_observe is not None and tree.tokens.device.type == "cpu"
                    and (counts is None or counts.device.type == "cpu"))
    if not compiled or len(tree.tokens) == 0:
        if calibration is not None:
            calibration.observe(*calibration_outcomes(tree, path, accepted))
        return index_accepted(tree, path, accepted)
    if compiled_observe is None:
        raise RuntimeError("the compiled merge (fastgrpo/engines/embedded/_tree_merge.c) is not built")
    B, N = tree.parents.shape
    parents, match, path, accepted = (host_tensor(t, torch.long) for t in (tree.parents, tree.match, path, accepted))
    source, raw = host_tensor(tree.source, torch.int8), host_tensor(tree.raw, torch.float32)
    valid = None if tree.valid is None else host_tensor(tree.valid, torch.bool)
    if counts is not None and (counts.device.type != "cpu" or counts.dtype != torch.float64
                               or not counts.is_contiguous()):
        raise ValueError("the compiled count needs the calibration's counts as a contiguous float64 CPU tensor")
    return compiled_observe(parents.data_ptr(), source.data_ptr(), raw.data_ptr(),
                            None if valid is None else valid.data_ptr(), match.data_ptr(), path.data_ptr(),
                            accepted.data_ptr(), B, N, path.shape[1], None if counts is None else counts.data_ptr(),
                            1 if calibration is None else calibration.buckets, LONG_MATCH)


def hybrid_tree(learned: Tree | None, candidates: CandidateRows, root_tokens: Tensor, num_verify: int,
                calibration: NodeCalibration | None = None, compiled: bool | None = None,
                max_depth: int | None = None) -> Tree:
    """One tree per row from the learned draft's tree (None: the index alone) and the index's
    continuations of that row (`SuffixIndex.lookup_rows`' rows of candidates after the root), `num_verify`
    nodes with the root.

    A node is a token path from the root, whoever proposed it: a path both propose is one node (so a
    node's children are distinct tokens). Its score: without `calibration`, the larger of the two
    estimates of its path's probability (the draft's cumulative probability, the index's count-based
    one); with it, the product along the path of each node's calibrated conditional
    (`node_calibration`: learned per source from what verification accepted, the raw conditional the
    larger of the two sources'). Of all nodes the `num_verify - 1` best are kept, exact ties going to
    the shallower, then to the learned draft's, then to the earlier proposed: no path scores above its
    prefix, so the kept set is ancestor-closed. `max_depth`: nodes deeper are never kept (a static verify
    walks at most that many levels: a slot spent on a deeper node would be wasted). A row with fewer
    nodes pads with nodes it does not verify (`valid`).

    Verification (`verify_tree`) does not read the scores or the sources: it samples the target at each
    node and moves on only if a child holds that token, so any child set keeps the output exactly the
    target's (docs/drafts.md). The scores only decide which nodes hold the most of its mass.

    The merge is host work on every hybrid step, on the critical path. It runs in C (`_tree_merge.c`,
    row by row, a few microseconds a row) where the install built it, else as one batch of tensor
    operations per step, a few per tree level (about a hundred small operations: over a millisecond of
    host time a step on this CPU, but never a Python loop over nodes); both give the same tree.
    `compiled`: force one (True: the C merge, False: the batched one; None: C where built)."""
    B, N = len(root_tokens), num_verify
    if learned is not None and learned.valid is not None:
        raise ValueError("hybrid_tree merges whole learned trees (restrict the merged tree instead)")
    if compiled is None:
        compiled = compiled_merge is not None
    elif compiled and compiled_merge is None:
        raise RuntimeError("the compiled merge (fastgrpo/engines/embedded/_tree_merge.c) is not built: reinstall "
                           "fastgrpo (`pip install -e .`) where a C compiler is found")
    if compiled and B > 0 and N > 1:
        return _merge_compiled(learned, candidates, root_tokens, N, calibration, max_depth)
    if learned is None:  # the root alone
        zeros = torch.zeros(B, 1, dtype=torch.long)
        learned = Tree(root_tokens[:, None], zeros, zeros, torch.ones(B, 1, 1, dtype=torch.bool), torch.zeros(B, 1))
        levels = 0
    else:
        levels = int(learned.depth.max())
    L = learned.tokens.shape[1]

    # the index's candidates as [B, M] tensors (padding invalid), parents numbered among all U = L + M nodes
    if len(candidates) != B:
        raise ValueError(f"{len(candidates)} candidate rows for {B} rows")
    n = candidates.n
    M = int(n.max()) if len(n) else 0
    i_valid = torch.arange(M)[None, :] < n[:, None]

    def index_column(values: Tensor, pad: float | int) -> Tensor:
        return torch.where(i_valid, values[:, :M], pad)

    i_tok, i_dep, i_par = (index_column(a, 0) for a in (candidates.tokens, candidates.depth, candidates.parents))
    i_par = torch.where(i_valid & (i_par >= 0), i_par + L, 0)
    levels = max(levels, index_levels := int(i_dep.max()) if M else 0)
    tokens = torch.cat([learned.tokens, i_tok], 1)
    parents = torch.cat([learned.parents, i_par], 1)
    depth = torch.cat([learned.depth, i_dep], 1)
    estimate = torch.cat([learned.score.double(), index_column(candidates.logp, 0.0)], 1)
    raw = torch.exp(estimate - estimate.gather(1, parents))  # each source's own conditional (roots: 1)
    ids = torch.arange(L + M)
    source = torch.cat([torch.where(ids[:L] > 0, LEARNED, 0).expand(B, L), torch.where(i_valid, INDEX, 0)], 1)

    # a candidate whose path the learned draft proposed is that node (found level by level: its parent's
    # node first); the learned draft's own paths are distinct, and so are the index's
    node = ids.expand(B, -1).clone()
    proposed = ids[1:L]
    for d in range(1, index_levels + 1 if L > 1 else 0):
        parent_node = node.gather(1, i_par)
        same = ((learned.parents[:, None, 1:] == parent_node[:, :, None])
                & (learned.tokens[:, None, 1:] == i_tok[:, :, None]))  # [B, M, L - 1]
        found = same.any(-1) & i_valid & (i_dep == d)
        node[:, L:] = torch.where(found, proposed[same.to(torch.int8).argmax(-1)], node[:, L:])
    merged = node[:, L:] != ids[L:]
    estimate = estimate.scatter_reduce(1, node, estimate, "amax")
    raw = raw.scatter_reduce(1, node, raw, "amax")
    source = source.scatter_add(1, node, torch.cat([torch.zeros(B, L, dtype=torch.long), INDEX * merged.long()], 1))
    parents = node.gather(1, parents)  # a kept candidate's parent may be a learned node
    alive = torch.cat([ids[:L].expand(B, -1) > 0, i_valid & ~merged], 1)
    if max_depth is not None:
        alive &= depth <= max_depth
    match = candidates.match.clone()

    if calibration is None:
        score = estimate
    else:  # parents first: each path's score is its parent's plus its own node's
        classes = node_classes((source & LEARNED) > 0, (source & INDEX) > 0, match[:, None])
        own = torch.log(calibration.conditionals(classes, raw).clamp(min=1e-12))
        score = torch.zeros(B, L + M, dtype=torch.float64)
        for d in range(1, levels + 1):
            score = torch.where(depth == d, score.gather(1, parents) + own, score)

    # rank: alive first, then by score, exact ties by depth, then by number (stable sorts, last key first)
    rank = torch.sort(depth, dim=1, stable=True).indices
    rank = rank.gather(1, torch.sort(-score.gather(1, rank), dim=1, stable=True).indices)
    rank = rank.gather(1, torch.sort((~alive).gather(1, rank).to(torch.int8), dim=1, stable=True).indices)
    chosen = rank[:, : N - 1]
    if chosen.shape[1] < N - 1:  # fewer nodes than the budget in every row: pad with the root's number
        chosen = torch.cat([chosen, torch.zeros(B, N - 1 - chosen.shape[1], dtype=torch.long)], 1)
    kept = alive.gather(1, chosen)
    chosen = chosen.gather(1, torch.sort(torch.where(kept, depth.gather(1, chosen), levels + 1), dim=1,
                                         stable=True).indices)  # parents before children, padding last
    kept = alive.gather(1, chosen)

    # the kept nodes renumbered 1..N-1 after the root; padding nodes are token 0 at depth 1, never verified
    position = torch.zeros(B, L + M + 1, dtype=torch.long)
    position.scatter_(1, torch.where(kept, chosen, L + M), torch.arange(1, N).expand(B, -1))
    root = torch.zeros(B, 1, dtype=torch.long)

    def column(values: Tensor, pad: float | int) -> Tensor:
        return torch.where(kept, values.gather(1, chosen), pad)

    tree_parents = torch.cat([root, column(position.gather(1, parents), 0)], 1)
    tree_depth = torch.cat([root, column(depth, 1)], 1)
    tree = Tree(torch.cat([root_tokens[:, None], column(tokens, 0)], 1), tree_parents, tree_depth,
                ancestor_mask(tree_parents, max(levels, 1)),
                torch.cat([root.float(), column(score, -math.inf).float()], 1),
                source=torch.cat([root, column(source, 0)], 1).to(torch.int8),
                raw=torch.cat([root.float(), column(raw, 0.0).float()], 1), match=match)
    return tree if bool(kept.all()) else tree.restricted(kept)


def merge_args(candidates: CandidateRows, N: int, calibration: NodeCalibration | None,
               max_depth: int | None) -> tuple[list, Tensor | None]:
    """The C merges' arguments after the roots (`merge`, `merge_rows`): the candidate rows' two tensors'
    addresses and width, each tensor checked to be what the C code reads (contiguous, on the CPU, of its
    dtype and size); the node budget; the calibration's counts address (None: raw scores), prior, buckets
    and long-match threshold; the depth limit. Also the counts tensor the address points into, to be
    kept alive through the call."""
    cells = candidates.rows * candidates.width
    for name, t, dtype, size in (("ints", candidates.ints, torch.long, 4 * cells + 2 * candidates.rows),
                                 ("logp", candidates.logp, torch.float64, cells)):
        if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous() or t.numel() != size:
            raise ValueError(f"CandidateRows.{name}: a contiguous {dtype} CPU tensor of {size} values, not "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")
    counts = None if calibration is None else host_tensor(calibration.counts, torch.float64)
    return ([candidates.ints.data_ptr(), candidates.logp.data_ptr(), candidates.width, N,
             None if counts is None else counts.data_ptr(), 0.0 if calibration is None else calibration.prior,
             1 if calibration is None else calibration.buckets, LONG_MATCH,
             NO_DEPTH_LIMIT if max_depth is None else max_depth], counts)


def _merge_compiled(learned: Tree | None, candidates: CandidateRows, root_tokens: Tensor, N: int,
                    calibration: NodeCalibration | None, max_depth: int | None) -> Tree:
    """`hybrid_tree` by the C merge: contiguous CPU tensors of its dtypes in and out (a device's trees
    cross to the host and back)."""
    device, B = root_tokens.device, len(root_tokens)
    if len(candidates) != B:
        raise ValueError(f"{len(candidates)} candidate rows for {B} rows")
    roots = host_tensor(root_tokens, torch.long)
    if learned is None:  # the root alone
        zeros = torch.zeros(B, 1, dtype=torch.long)
        tokens, parents, depth, score = roots[:, None].contiguous(), zeros, zeros, torch.zeros(B, 1)
    else:
        tokens, parents, depth = (host_tensor(t, torch.long) for t in (learned.tokens, learned.parents, learned.depth))
        score = host_tensor(learned.score, torch.float32)
    out = [torch.empty(B, N, dtype=dtype) for dtype in (torch.long, torch.long, torch.long, torch.float32, torch.int8,
                                                         torch.float32)]
    out += [torch.empty(B, N - 1, dtype=torch.bool), torch.empty(B, N, N, dtype=torch.bool)]
    args, _counts = merge_args(candidates, N, calibration, max_depth)
    all_kept = compiled_merge(tokens.data_ptr(), parents.data_ptr(), depth.data_ptr(), score.data_ptr(), B,
                              tokens.shape[1], roots.data_ptr(), *args, *(t.data_ptr() for t in out))
    tokens, parents, depth, score, source, raw, kept, mask = (t.to(device) for t in out)
    valid = None if all_kept else torch.cat([torch.ones(B, 1, dtype=torch.bool, device=device), kept], 1)
    match = candidates.match.to(device, copy=True)
    return Tree(tokens, parents, depth, mask, score, valid, source, raw, match)


def ancestor_mask(parents: Tensor, max_depth: int) -> Tensor:
    """[B, N, N] bool: node j is node i itself or one of its ancestors, for trees no deeper than
    `max_depth`: j is on the chain of i's parents followed `max_depth` times (the root is its own parent,
    so every chain ends there)."""
    B, N = parents.shape
    ids = arange(N, parents.device)
    chain = [ids.expand(B, N)]
    for d in range(max_depth):
        chain.append(parents if d == 0 else parents.gather(1, chain[-1]))
    return (torch.stack(chain, 2)[..., None] == ids).any(2)


@dataclass
class Verified:
    """Per row: what a verify step emits. Entries past a row's `accepted + 1` tokens (`accepted` path
    nodes) are unspecified (a static walk computes every level for every row): readers take only those."""

    tokens: Tensor  # [B, D + 1] emitted tokens (first `accepted + 1` of each row are valid)
    logprobs: Tensor  # [B, D + 1] their sampling log-probabilities
    path: Tensor  # [B, D] tree indices of the accepted nodes (first `accepted` valid; every entry a node index)
    accepted: Tensor  # [B] draft tokens accepted; accepted + 1 tokens are emitted


# a static verify samples every node's distribution at once (one pass of sampling's ~8 kernels over
# [B, N, V]) rather than the current node's a level (D + 1 passes over [B, V]) up to this many elements:
# inside a graph each kernel costs a fixed few microseconds, and below ~2^23 float64 elements (~67 MB a
# pass) the extra bytes cost less than the kernels saved. An estimate from H100/H200 bandwidth (3.3-4.8
# TB/s) and a kernel's cost in a graph (~2 us), not a measurement
SAMPLE_AT_ONCE = 2**23


def verify_tree(logprobs: Tensor, tree: Tree, sampling: SamplingParams, uniforms: Tensor | None,
                depth: int | None = None, at_once: bool | None = None) -> Verified:
    """logprobs [B, N, V]: the target's sampling distribution after each tree node; uniforms [B, D + 1]:
    the sampling noise of the positions the step can emit (the k-th emitted token uses column k, as
    plain decoding of that position would), or None for fresh randomness. `depth`: D, the tree's
    configured depth (static: every level is walked, with no early exit), else the deepest node's.

    The walk samples the target at the current node of every row and moves to the child holding that
    token. A row that found none is done: its later levels are still computed (no per-row branch, no
    write masked by it) but never counted, since `moved` stays false once it is. `at_once`: sample every
    node first, then walk by lookups (`_verify_sampled_nodes`); the same tokens. Default: statically, up to
    SAMPLE_AT_ONCE elements of logprobs."""
    (B, N), V = tree.tokens.shape, logprobs.shape[-1]
    D = int(tree.depth.max()) if depth is None else depth
    # a node another can move to: not the root, and verified; the others' tokens can never match a sample
    candidate = tree.tokens.masked_fill(arange(N, tree.tokens.device) == 0, -1)
    if tree.valid is not None:  # nodes left out of a ragged verify are never accepted
        candidate = candidate.masked_fill(~tree.valid, -1)
    if at_once is None:
        at_once = depth is not None and B * N * V <= SAMPLE_AT_ONCE
    if at_once:
        return _verify_sampled_nodes(logprobs, tree, candidate, sampling, uniforms, D)
    cur = None  # the current node of each row (None: the root)
    tokens, token_lp, path, moves = [], [], [], []
    moved = None
    for step in range(D + 1):
        lp = logprobs[:, 0] if cur is None else logprobs.gather(1, cur[:, None, None].expand(B, 1, V))[:, 0]
        x = sample(lp, sampling, None if uniforms is None else uniforms[:, step])  # a target sample at the current node
        tokens.append(x)
        token_lp.append(lp.gather(1, x[:, None])[:, 0])
        if step == D:
            break
        parent_is_cur = tree.parents == 0 if cur is None else tree.parents == cur[:, None]
        match = parent_is_cur & (candidate == x[:, None])
        moved = match.any(-1) if moved is None else moved & match.any(-1)
        moves.append(moved)
        cur = match.to(torch.int8).argmax(-1)  # the child (0 where none: that row is done)
        path.append(cur)
        if depth is None and not bool(moved.any()):  # eager: every row is done
            pad = [x] * (D - step)
            tokens += pad
            token_lp += [token_lp[-1]] * (D - step)
            path += [cur] * (D - step - 1)
            moves += [moved] * (D - step - 1)
            break
    accepted = torch.stack(moves, 1).sum(1) if moves else torch.zeros(B, dtype=torch.long, device=tree.tokens.device)
    path_t = torch.stack(path, 1) if path else tree.tokens[:, :0]
    return Verified(torch.stack(tokens, 1), torch.stack(token_lp, 1), path_t, accepted)


def _verify_sampled_nodes(logprobs: Tensor, tree: Tree, candidate: Tensor, sampling: SamplingParams,
                          uniforms: Tensor | None, D: int) -> Verified:
    """verify_tree by sampling every node first (a node at depth d with column d of the noise, as the walk
    would if it got there). Each node's next node is then known before the walk: the child holding its
    sample, or a sink (number N) where none does, which leads to itself. The walk is one lookup a level,
    and a row's accepted count is the levels before it reached the sink."""
    B, N = tree.tokens.shape
    device = tree.tokens.device
    node_tokens = sample(logprobs, sampling, None if uniforms is None else uniforms.gather(1, tree.depth))
    node_lp = logprobs.gather(2, node_tokens[..., None])[..., 0]
    is_child = tree.parents[:, None, :] == arange(N, device)[:, None]  # [B, n, j]: j's parent is n
    hit = is_child & (candidate[:, None, :] == node_tokens[:, :, None])
    sink = full((B, 1), N, torch.long, device)
    following = torch.cat([torch.where(hit.any(-1), hit.to(torch.int8).argmax(-1), N), sink], 1)  # [B, N + 1]
    nodes = [full((B, 1), 0, torch.long, device)]  # the root, then each level's node (N: stopped)
    for _ in range(D):
        nodes.append(following.gather(1, nodes[-1]))
    walk = torch.cat(nodes, 1)  # [B, D + 1]
    at = walk.clamp(max=N - 1)  # (a stopped row's entries are unspecified, but indices)
    reached = walk[:, 1:] < N
    return Verified(node_tokens.gather(1, at), node_lp.gather(1, at), at[:, 1:], reached.sum(1))
