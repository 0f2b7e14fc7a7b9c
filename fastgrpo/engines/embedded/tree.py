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

Both functions run eagerly (shapes from the data: the engine's eager step) or statically (`ctx` and
`depth` given: every shape fixed by the tree's configuration and the step's context bucket, no value read
back to the host), which a graph-captured step (`steps.py`) needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fastgrpo.engines.embedded.model import KVCache, block_mask, cache_kv
from fastgrpo.models.sampling import sample
from fastgrpo.speculation.spec import SpecConfig
from fastgrpo.types import SamplingParams
from fastgrpo.models.draft import DraftHead


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

    def restricted(self, nodes: Tensor) -> Tree:
        """This tree verifying only `nodes` [B, N - 1] of each row's non-root nodes (an ancestor-closed
        set): the others are neither attended to nor accepted, and cost no matmul work."""
        valid = torch.cat([torch.ones(len(nodes), 1, dtype=torch.bool), nodes], 1)
        # a left-out node still sees itself: no query row is wholly masked (attention would give NaN)
        eye = torch.eye(valid.shape[1], dtype=torch.bool)
        return Tree(self.tokens, self.parents, self.depth, self.mask & (valid[:, None, :] | eye), self.score, valid)


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
