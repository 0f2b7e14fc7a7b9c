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

Hybrid trees (`hybrid_tree`, `speculation.drafts: index | hybrid`, eager steps only): the learned
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
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from fastgrpo.engines.embedded.model import KVCache, block_mask, cache_kv
from fastgrpo.models.sampling import sample
from fastgrpo.speculation.spec import SpecConfig
from fastgrpo.types import SamplingParams
from fastgrpo.models.draft import DraftHead
from fastgrpo.speculation.node_calibration import NodeCalibration, node_class
from fastgrpo.speculation.suffix_index import Candidates


class NonFiniteDraft(RuntimeError):
    """The draft produced NaN/inf: the engine decodes plainly for the step instead."""


def _draft_logprobs(draft: DraftHead, features: Tensor, static: bool) -> tuple[Tensor, Tensor]:
    """Log-probabilities [..., V] and whether each row's are all finite [...] (eagerly: raised at once)."""
    logp = torch.log_softmax(draft.logits(features).float(), dim=-1)
    finite = torch.isfinite(logp).all(-1)
    if not static and not bool(finite.all()):
        raise NonFiniteDraft("non-finite draft logits")
    return logp, finite


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
        valid = torch.cat([torch.ones(len(nodes), 1, dtype=torch.bool), nodes], 1)
        # a left-out node still sees itself: no query row is wholly masked (attention would give NaN)
        eye = torch.eye(valid.shape[1], dtype=torch.bool)
        return Tree(self.tokens, self.parents, self.depth, self.mask & (valid[:, None, :] | eye), self.score, valid,
                    self.source, self.raw, self.match)


@torch.inference_mode()
def draft_tree(draft: DraftHead, cache: KVCache, rows: slice, root_features: Tensor, root_tokens: Tensor,
               cfg: SpecConfig, ctx: int | None = None) -> Tree:
    """Propose a tree per sequence. root_features [B, H]: the draft's predicted state at the root
    (the pending token), from which the first level is read. Expansion keys/values go to the draft
    cache after each row's length and are discarded (the length does not move).

    A draft that produces NaN/inf raises NonFiniteDraft; statically (`ctx` given: the draft cache
    positions attention reads, at least every row's length + 1) nothing can be raised without reading
    the flag back, so a row whose draft is not finite verifies its root alone (a plain step's token)."""
    B, k = root_tokens.shape[0], cfg.topk
    start, visible_from = cache.lengths[rows], cache.visible_from[rows]
    E = (cfg.depth - 1) * k  # expansion entries per sequence
    bidx = torch.arange(B)[:, None]

    logp, finite = _draft_logprobs(draft, root_features, ctx is not None)
    score, tok = logp.topk(k, dim=-1)  # level 1
    feat = root_features[:, None].expand(B, k, -1)  # state each level-1 node is expanded from
    anc = torch.zeros(B, k, max(E, 1), dtype=torch.bool)  # expansion entries each node descends from
    gid = torch.arange(k).expand(B, k)
    all_tok, all_score, all_parent, all_depth = [tok], [score], [torch.full((B, k), -1)], [torch.ones(B, k, dtype=torch.long)]
    n_nodes = k
    for d in range(1, cfg.depth):
        sel = score.topk(k, dim=-1).indices  # expand the k most probable nodes of this level
        tok, feat, anc, gid, score = tok[bidx, sel], feat[bidx, sel], anc[bidx, sel].clone(), gid[bidx, sel], score[bidx, sel]
        offs = (d - 1) * k + torch.arange(k)
        anc[:, :, (d - 1) * k : d * k] |= torch.eye(k, dtype=torch.bool)  # each node descends from its own entry
        slots = start[:, None] + offs
        level_ctx = (int(start.max()) if ctx is None else ctx) + d * k
        mask = block_mask(start, k, level_ctx, anc[:, :, : d * k], visible_from)
        feat = draft.features(feat, tok, (start[:, None] + d - 1).expand(B, k), mask,
                              cache_kv(cache, 0, rows, slots, level_ctx))
        logp, level_finite = _draft_logprobs(draft, feat, ctx is not None)
        finite = finite & level_finite.all(-1)
        cs, ct = logp.topk(k, dim=-1)  # [B, k, k]
        tok = ct.flatten(1)
        score = (score[:, :, None] + cs).flatten(1)
        feat = feat.repeat_interleave(k, dim=1)
        anc = anc.repeat_interleave(k, dim=1)
        parent = gid.repeat_interleave(k, dim=1)
        gid = n_nodes + torch.arange(k * k).expand(B, -1)
        n_nodes += k * k
        all_tok.append(tok), all_score.append(score), all_parent.append(parent)
        all_depth.append(torch.full((B, k * k), d + 1))

    tok, score = torch.cat(all_tok, 1), torch.cat(all_score, 1)
    parent, depth = torch.cat(all_parent, 1), torch.cat(all_depth, 1)
    # keep the most probable nodes; break exact ties toward shallower nodes so that parents win
    keep = (score.double() - 1e-9 * depth).topk(cfg.num_verify - 1, dim=-1).indices
    order = torch.sort(depth[bidx, keep] * (n_nodes + 1) + keep, dim=-1).indices  # parents before children
    keep = keep[bidx, order]
    N = cfg.num_verify
    position = torch.full((B, n_nodes), -1)
    position[bidx, keep] = torch.arange(1, N).expand(B, -1)
    p = parent[bidx, keep]
    parents = torch.cat([torch.zeros(B, 1, dtype=torch.long), torch.where(p < 0, 0, position[bidx, p.clamp(min=0)])], 1)
    tree_depth = torch.cat([torch.zeros(B, 1, dtype=torch.long), depth[bidx, keep]], 1)
    tokens = torch.cat([root_tokens[:, None], tok[bidx, keep]], 1)
    tree_score = torch.cat([torch.zeros(B, 1), score[bidx, keep]], 1)
    tree = Tree(tokens, parents, tree_depth, ancestor_mask(parents, tree_depth, cfg.depth), tree_score)
    if ctx is None:
        if (parents < 0).any():  # cannot happen with finite scores; never let it crash a rollout
            raise NonFiniteDraft("draft tree is not ancestor-closed")
        return tree
    # static: a row with a non-finite draft keeps its root only (its other nodes are never accepted)
    return tree.restricted(finite[:, None].expand(B, N - 1))


LEARNED, INDEX = 1, 2  # Tree.source bits: the learned draft proposed the node, the suffix index did


def calibration_outcomes(tree: Tree, result: Verified) -> list[tuple[str, float, bool]]:
    """A merged tree's verified nodes whose parent was reached (the root, or a node on the accepted
    path): each one's class, raw conditional estimate and whether it was accepted
    (`NodeCalibration.observe`)."""
    assert tree.source is not None and tree.raw is not None and tree.match is not None
    out = []
    valid = tree.valid.tolist() if tree.valid is not None else None
    parents, source, raw, path, accepted, match = (t.tolist() for t in (
        tree.parents, tree.source, tree.raw, result.path, result.accepted, tree.match))
    for b in range(len(parents)):
        on_path = set(path[b][: accepted[b]])
        reached = on_path | {0}
        for j in range(1, len(parents[b])):
            if (valid is None or valid[b][j]) and parents[b][j] in reached:
                bits = source[b][j]
                out.append((node_class(bool(bits & LEARNED), bool(bits & INDEX), match[b]), raw[b][j], j in on_path))
    return out


def hybrid_tree(learned: Tree | None, candidates: Sequence[Candidates], root_tokens: Tensor, num_verify: int,
                calibration: NodeCalibration | None = None) -> Tree:
    """One tree per row from the learned draft's tree (None: the index alone) and the index's
    continuations of that row (`SuffixIndex` candidates after the root), `num_verify` nodes with the root.

    A node is a token path from the root, whoever proposed it: a path both propose is one node (so a
    node's children are distinct tokens). Its score: without `calibration`, the larger of the two
    estimates of its path's probability (the draft's cumulative probability, the index's count-based
    one); with it, the product along the path of each node's calibrated conditional
    (`node_calibration`: learned per source from what verification accepted, the raw conditional the
    larger of the two sources'). Of all nodes the `num_verify - 1` best are kept, exact ties going to
    the shallower: no path scores above its prefix, so the kept set is ancestor-closed. A row with
    fewer nodes pads with nodes it does not verify (`valid`).

    Verification (`verify_tree`) does not read the scores or the sources: it samples the target at each
    node and moves on only if a child holds that token, so any child set keeps the output exactly the
    target's (docs/drafts.md). The scores only decide which nodes hold the most of its mass."""
    B, N = len(root_tokens), num_verify
    if learned is not None and learned.valid is not None:
        raise ValueError("hybrid_tree merges whole learned trees (restrict the merged tree instead)")
    roots = root_tokens.tolist()
    drafted = None if learned is None else [t.tolist() for t in (learned.tokens, learned.parents, learned.score)]
    rows: list[tuple[list[tuple[int, ...]], dict[tuple[int, ...], list]]] = []
    for b in range(B):
        # path -> [score, source bits, raw conditional]: the score a log-probability (the larger estimate, or
        # the calibrated one), the raw conditional the larger of the sources' own
        nodes: dict[tuple[int, ...], list] = {}
        if drafted is not None:
            tokens, parents, score = (t[b] for t in drafted)
            paths: list[tuple[int, ...]] = [()]
            for j in range(1, len(tokens)):  # parents come before children
                paths.append(paths[parents[j]] + (tokens[j],))
                nodes[paths[j]] = [score[j], LEARNED, math.exp(score[j] - score[parents[j]])]
        c = candidates[b]
        for i, (path, logp) in enumerate(zip(c.paths(), c.logp)):
            conditional = math.exp(logp - (c.logp[c.parents[i]] if c.parents[i] >= 0 else 0.0))
            entry = nodes.setdefault(path, [logp, 0, 0.0])
            entry[0], entry[1], entry[2] = max(entry[0], logp), entry[1] | INDEX, max(entry[2], conditional)
        if calibration is not None:  # parents first: each path's score is its parent's plus its own node's
            for path in sorted(nodes, key=len):
                entry = nodes[path]
                cls = node_class(bool(entry[1] & LEARNED), bool(entry[1] & INDEX), c.match_len)
                entry[0] = (nodes[path[:-1]][0] if len(path) > 1 else 0.0) + math.log(
                    max(calibration.conditional(cls, entry[2]), 1e-12))
        kept = sorted(nodes, key=lambda p: (-nodes[p][0], len(p)))[: N - 1]
        rows.append((sorted(kept, key=len), nodes))  # parents before children (a stable sort by depth)

    # each row's nodes, the root first, padded to N with nodes it does not verify (one tensor per field)
    tokens, parents, depth, score, source, raw, valid = ([] for _ in range(7))
    for b, (kept, nodes) in enumerate(rows):
        position = {(): 0} | {p: i + 1 for i, p in enumerate(kept)}
        pad = N - 1 - len(kept)
        tokens.append([roots[b]] + [p[-1] for p in kept] + [0] * pad)
        parents.append([0] + [position[p[:-1]] for p in kept] + [0] * pad)
        depth.append([0] + [len(p) for p in kept] + [1] * pad)
        score.append([0.0] + [nodes[p][0] for p in kept] + [-math.inf] * pad)
        source.append([0] + [nodes[p][1] for p in kept] + [0] * pad)
        raw.append([0.0] + [nodes[p][2] for p in kept] + [0.0] * pad)
        valid.append([True] * (len(kept) + 1) + [False] * pad)
    tokens, parents, depth = (torch.tensor(x, dtype=torch.long) for x in (tokens, parents, depth))
    score, raw = torch.tensor(score), torch.tensor(raw)
    source, valid = torch.tensor(source, dtype=torch.int8), torch.tensor(valid)
    match = torch.tensor([c.match_len for c in candidates])
    tree = Tree(tokens, parents, depth, ancestor_mask(parents, depth, int(depth.max())), score, source=source,
                raw=raw, match=match)
    return tree if bool(valid.all()) else tree.restricted(valid[:, 1:])


def ancestor_mask(parents: Tensor, depth: Tensor, max_depth: int) -> Tensor:
    """[B, N, N] bool: node j is node i itself or one of its ancestors (levels up to `max_depth`)."""
    B, N = parents.shape
    eye = torch.eye(N, dtype=torch.bool).expand(B, N, N)
    mask = eye.clone()
    for d in range(1, max_depth + 1):
        inherited = torch.gather(mask, 1, parents[:, :, None].expand(B, N, N)) | eye
        mask = torch.where((depth == d)[:, :, None], inherited, mask)
    return mask


@dataclass
class Verified:
    tokens: Tensor  # [B, D + 1] emitted tokens (first `accepted + 1` of each row are valid)
    logprobs: Tensor  # [B, D + 1] their sampling log-probabilities
    path: Tensor  # [B, D] tree indices of the accepted nodes (first `accepted` valid)
    accepted: Tensor  # [B] draft tokens accepted; accepted + 1 tokens are emitted


def verify_tree(logprobs: Tensor, tree: Tree, sampling: SamplingParams, uniforms: Tensor | None,
                depth: int | None = None) -> Verified:
    """logprobs [B, N, V]: the target's sampling distribution after each tree node; uniforms [B, D + 1]:
    the sampling noise of the positions the step can emit (the k-th emitted token uses column k, as
    plain decoding of that position would), or None for fresh randomness. `depth`: D, the tree's
    configured depth (static: every level is walked, with no early exit), else the deepest node's."""
    B, N = tree.tokens.shape
    D = int(tree.depth.max()) if depth is None else depth
    rows = torch.arange(B)
    cur = torch.zeros(B, dtype=torch.long)
    done = torch.zeros(B, dtype=torch.bool)
    accepted = torch.zeros(B, dtype=torch.long)
    tokens = torch.zeros(B, D + 1, dtype=torch.long)
    token_lp = torch.zeros(B, D + 1)
    path = torch.zeros(B, D, dtype=torch.long)
    not_root = torch.arange(N) > 0
    if tree.valid is not None:  # nodes left out of a ragged verify are never accepted
        not_root = not_root & tree.valid
    for step in range(D + 1):
        lp = logprobs[rows, cur]
        x = sample(lp, sampling, None if uniforms is None else uniforms[:, step])  # a target sample at the current node
        live = ~done
        tokens[:, step] = torch.where(live, x, tokens[:, step])
        token_lp[:, step] = torch.where(live, lp[rows, x], token_lp[:, step])
        match = (tree.parents == cur[:, None]) & (tree.tokens == x[:, None]) & not_root
        moved = match.any(-1) & live
        if step < D:
            child = match.to(torch.int8).argmax(-1)
            path[:, step] = torch.where(moved, child, path[:, step])
            cur = torch.where(moved, child, cur)
        accepted += moved.long()
        done |= ~moved
        if depth is None and done.all():
            break
    return Verified(tokens, token_lp, path, accepted)
