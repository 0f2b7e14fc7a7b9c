"""The merges of learned and index draft trees (tree.hybrid_tree: the batched tensor one and the C one)
against a reference written node by node: a dict of token paths per row, the rule of hybrid_tree's
docstring spelled out directly. Random learned trees and candidates, with paths the two sources share,
rows short of the budget, and calibrated and raw scores: the merged trees must be the same tree, node for
node; and the C merge's tree is the batched one's, tensor for tensor."""

import math
import random

import pytest
import torch

from fastgrpo.engines.embedded.tree import (INDEX, LEARNED, Tree, Verified, ancestor_mask, compiled_merge, hybrid_tree,
                                            observe_verified)
from fastgrpo.speculation.node_calibration import CLASSES, NodeCalibration, node_classes
from fastgrpo.speculation.suffix_index import CandidateRows, Candidates


def reference_merge(learned: Tree | None, candidates: list[Candidates], roots: list[int], num_verify: int,
                    calibration: NodeCalibration | None,
                    max_depth: int | None = None) -> list[list[tuple[tuple[int, ...], float, int, float]]]:
    """Each row's kept nodes, parents before children: (path, score, source bits, raw conditional); none
    deeper than `max_depth`."""
    out = []
    for b in range(len(roots)):
        nodes: dict[tuple[int, ...], list] = {}  # path -> [score, source bits, raw conditional], in proposal order
        if learned is not None:
            tokens, parents, score = (t[b].tolist() for t in (learned.tokens, learned.parents, learned.score))
            paths: list[tuple[int, ...]] = [()]
            for j in range(1, len(tokens)):
                paths.append(paths[parents[j]] + (tokens[j],))
                nodes[paths[j]] = [score[j], LEARNED, math.exp(score[j] - score[parents[j]])]
        c = candidates[b]
        for i, (path, logp) in enumerate(zip(c.paths(), c.logp)):
            conditional = math.exp(logp - (c.logp[c.parents[i]] if c.parents[i] >= 0 else 0.0))
            entry = nodes.setdefault(path, [logp, 0, 0.0])
            entry[0], entry[1], entry[2] = max(entry[0], logp), entry[1] | INDEX, max(entry[2], conditional)
        if calibration is not None:
            for path in sorted(nodes, key=len):
                entry = nodes[path]
                cls = int(node_classes(torch.tensor(bool(entry[1] & LEARNED)), torch.tensor(bool(entry[1] & INDEX)),
                                       torch.tensor(c.match_len)))
                entry[0] = (nodes[path[:-1]][0] if len(path) > 1 else 0.0) + math.log(
                    max(calibration.conditional(CLASSES[cls], entry[2]), 1e-12))
        allowed = [p for p in nodes if max_depth is None or len(p) <= max_depth]
        kept = sorted(allowed, key=lambda p: (-nodes[p][0], len(p)))[: num_verify - 1]
        out.append([(p, *nodes[p]) for p in sorted(kept, key=len)])
    return out


def random_learned(rng: random.Random, rows: int, k: int, depth: int, vocab: int) -> Tree:
    """EAGLE-shaped trees: each level's nodes under the previous level's, distinct tokens among siblings,
    cumulative log-probabilities falling with depth (some not at all: exact ties with shallower nodes)."""
    tokens, parents, depths, scores = [], [], [], []
    for _ in range(rows):
        tok, par, dep, sc = [rng.randrange(vocab)], [0], [0], [0.0]
        frontier = [0]
        for d in range(1, depth + 1):
            new = []
            for p in frontier:
                for t in rng.sample(range(vocab), k):
                    tok.append(t), par.append(p), dep.append(d), sc.append(sc[p] + math.log(rng.choice([1.0, rng.uniform(0.05, 1.0)])))
                    new.append(len(tok) - 1)
            frontier = rng.sample(new, min(k, len(new)))
        tokens.append(tok), parents.append(par), depths.append(dep), scores.append(sc)
    parents_t, depth_t = torch.tensor(parents), torch.tensor(depths)
    return Tree(torch.tensor(tokens), parents_t, depth_t, ancestor_mask(parents_t, depth), torch.tensor(scores))


def random_candidates(rng: random.Random, learned: Tree | None, b: int, vocab: int) -> Candidates:
    """Continuations of up to 12 nodes, some along the learned tree's paths (shared nodes), the rest new."""
    shared: list[tuple[int, ...]] = []
    if learned is not None:
        paths: list[tuple[int, ...]] = [()]
        for j in range(1, learned.tokens.shape[1]):
            paths.append(paths[int(learned.parents[b, j])] + (int(learned.tokens[b, j]),))
        shared = rng.sample(paths[1:], rng.randint(0, min(4, len(paths) - 1)))
    chosen: set[tuple[int, ...]] = set()
    for p in shared:  # with their prefixes: the candidates are ancestor-closed
        chosen |= {p[:d] for d in range(1, len(p) + 1)}
    for _ in range(rng.randint(0, 8)):
        base = rng.choice([()] + sorted(chosen))
        if len(base) < 5:
            chosen.add(base + (rng.randrange(vocab),))
    ordered = sorted(chosen, key=lambda p: (len(p), p))
    logp: dict[tuple[int, ...], float] = {}
    for p in ordered:
        # repeated conditionals make exact ties (1.0: a child ties its parent); none inside a calibration bucket's
        # edge (k / 10, 0 < k < 10), where the last
        # bit of exp() decides the bucket
        logp[p] = logp.get(p[:-1], 0.0) + math.log(rng.choice([1.0, 0.97, 0.55, rng.uniform(0.05, 1.0)]))
    ordered.sort(key=lambda p: -logp[p])  # best first, as the index proposes them (parents first: ties by depth)
    ordered.sort(key=len)
    position = {p: i for i, p in enumerate(ordered)}
    return Candidates(tokens=[p[-1] for p in ordered], parents=[position.get(p[:-1], -1) for p in ordered],
                      depth=[len(p) for p in ordered], logp=[logp[p] for p in ordered], counts=[1] * len(ordered),
                      match_len=rng.randint(1, 8) if ordered else 0)


def merged_rows(tree: Tree) -> list[list[tuple[tuple[int, ...], float, int, float]]]:
    out = []
    for b in range(tree.tokens.shape[0]):
        paths: list[tuple[int, ...]] = [()]
        row = []
        for j in range(1, tree.tokens.shape[1]):
            paths.append(paths[int(tree.parents[b, j])] + (int(tree.tokens[b, j]),))
            if tree.valid is None or bool(tree.valid[b, j]):
                row.append((paths[j], float(tree.score[b, j]), int(tree.source[b, j]), float(tree.raw[b, j])))
        out.append(row)
    return out


def calibration_of(rng: random.Random, calibrated: bool) -> NodeCalibration | None:
    """None, or counts that move every class away from its raw estimates."""
    if not calibrated:
        return None
    calibration = NodeCalibration(prior=2.0)
    classes = torch.tensor([rng.randrange(len(CLASSES)) for _ in range(2000)])
    raw = torch.rand(2000, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    calibration.observe(classes, raw, torch.rand(2000, generator=torch.Generator().manual_seed(3)) < 0.3 + 0.15 * classes)
    return calibration


def random_case(rng: random.Random, trial: int) -> tuple[Tree | None, list[Candidates], list[int], int]:
    rows, vocab = rng.randint(1, 4), rng.choice([3, 6, 50])
    learned = None if trial % 5 == 0 else random_learned(rng, rows, rng.randint(1, 3), rng.randint(1, 4), vocab)
    cands = [random_candidates(rng, learned, b, vocab) for b in range(rows)]
    return learned, cands, [rng.randrange(vocab) for _ in range(rows)], rng.randint(2, 14)


def depth_limit(trial: int) -> int | None:
    """None (no limit) for two trials in three, else 1-3 levels: below the random trees' 4-5."""
    return None if trial % 3 else 1 + trial % 4 % 3


MERGES = [pytest.param(False, id="batched"),
          pytest.param(True, id="compiled", marks=pytest.mark.skipif(compiled_merge is None, reason="not built"))]


@pytest.mark.parametrize("compiled", MERGES)
@pytest.mark.parametrize("calibrated", [False, True], ids=["raw", "calibrated"])
def test_the_merge_keeps_the_reference_nodes(calibrated, compiled):
    rng = random.Random(1)
    calibration = calibration_of(rng, calibrated)
    shared = limited = 0
    for trial in range(60):
        learned, cands, roots, num_verify = random_case(rng, trial)
        rows, max_depth = len(roots), depth_limit(trial)
        tree = hybrid_tree(learned, CandidateRows.of(cands), torch.tensor(roots), num_verify, calibration, compiled=compiled,
                           max_depth=max_depth)
        want = reference_merge(learned, cands, roots, num_verify, calibration, max_depth)
        limited += max_depth is not None and want != reference_merge(learned, cands, roots, num_verify, calibration)
        got = merged_rows(tree)
        assert tree.tokens.shape == (rows, num_verify) and tree.tokens[:, 0].tolist() == roots
        for g, w in zip(got, want):
            assert [n[0] for n in g] == [n[0] for n in w]  # the same paths, in the same order
            assert [n[2] for n in g] == [n[2] for n in w]
            assert [n[1] for n in g] == pytest.approx([n[1] for n in w], rel=1e-6, abs=1e-6)
            assert [n[3] for n in g] == pytest.approx([n[3] for n in w], rel=1e-6, abs=1e-6)
            shared += sum(n[2] == LEARNED | INDEX for n in g)
        assert tree.match.tolist() == [c.match_len for c in cands]
        depth = tree.depth.masked_fill(~tree.valid, 99) if tree.valid is not None else tree.depth
        assert bool((depth[:, 1:].diff(dim=1) >= 0).all())  # parents before children, padding last
    assert shared >= 20  # the merge of shared paths was exercised
    assert limited >= 5  # and depth limits that changed the kept nodes


@pytest.mark.skipif(compiled_merge is None, reason="the compiled merge is not built here")
@pytest.mark.parametrize("calibrated", [False, True], ids=["raw", "calibrated"])
def test_the_compiled_merge_makes_the_batched_tree(calibrated):
    """Every field, padding and masks included, and the same `valid` (None when every row fills the budget)."""
    rng = random.Random(2)
    calibration = calibration_of(rng, calibrated)
    for trial in range(60):
        learned, cands, roots, num_verify = random_case(rng, trial)
        args = (learned, CandidateRows.of(cands), torch.tensor(roots), num_verify, calibration)
        max_depth = depth_limit(trial)
        batched = hybrid_tree(*args, compiled=False, max_depth=max_depth)
        compiled = hybrid_tree(*args, compiled=True, max_depth=max_depth)
        for name in ("tokens", "parents", "depth", "mask", "score", "valid", "source", "raw", "match"):
            a, b = getattr(batched, name), getattr(compiled, name)
            assert (a is None) == (b is None), (trial, name)
            if a is not None:
                assert a.dtype == b.dtype and torch.equal(a, b), (trial, name)


@pytest.mark.skipif(compiled_merge is None, reason="the compiled merge is not built here")
def test_the_compiled_merge_refuses_candidates_out_of_order():
    late_parent = Candidates(tokens=[1, 2], parents=[1, -1], depth=[2, 1], logp=[-0.1, -0.2], counts=[1, 1], match_len=2)
    with pytest.raises(ValueError, match="must come before it"):
        hybrid_tree(None, CandidateRows.of([late_parent]), torch.tensor([0]), 4, compiled=True)
    with pytest.raises(ValueError, match="candidate rows"):
        hybrid_tree(None, CandidateRows.of([]), torch.tensor([0]), 4, compiled=True)


def random_verified(rng: random.Random, tree: Tree) -> Verified:
    """An accepted path per row: from the root, a random verified child at each level, stopping at random."""
    B, N = tree.tokens.shape
    D = int(tree.depth.max())
    path, accepted = torch.zeros(B, D, dtype=torch.long), torch.zeros(B, dtype=torch.long)
    for b in range(B):
        node, k = 0, 0
        while k < D:
            children = [j for j in range(1, N) if int(tree.parents[b, j]) == node
                        and (tree.valid is None or bool(tree.valid[b, j]))]
            if not children or rng.random() < 0.3:
                break
            node = rng.choice(children)
            path[b, k], k = node, k + 1
        accepted[b] = k
    return Verified(torch.zeros(B, D + 1, dtype=torch.long), torch.zeros(B, D + 1), path, accepted)


@pytest.mark.skipif(compiled_merge is None, reason="the compiled merge is not built here")
def test_the_compiled_count_of_verified_nodes_is_the_tensor_one():
    """The same calibration counts (every class and bucket, accepted and reached) from the merged trees of the
    cases above, each verified along a random path, counted by both; and both return the accepted nodes the
    index proposed, as counted node by node along each row's path (also with no calibration to count into)."""
    counted = {False: calibration_of(random.Random(4), True), True: calibration_of(random.Random(4), True)}
    start = counted[False].counts.clone()
    rng = random.Random(5)
    from_index = 0
    for trial in range(60):
        learned, cands, roots, num_verify = random_case(rng, trial)
        tree = hybrid_tree(learned, CandidateRows.of(cands), torch.tensor(roots), num_verify, counted[False])
        result = random_verified(rng, tree)
        want = sum(int(tree.source[b, int(result.path[b, k])]) & INDEX > 0
                   for b in range(len(roots)) for k in range(int(result.accepted[b])))
        from_index += want
        for compiled, calibration in counted.items():
            assert observe_verified(calibration, tree, result.path, result.accepted, compiled=compiled) == want
            assert observe_verified(None, tree, result.path, result.accepted, compiled=compiled) == want
    assert from_index > 20
    assert torch.equal(counted[False].counts, counted[True].counts)
    added = counted[False].counts - start
    assert added[..., 1].sum() > 200 and added[..., 0].sum() > 50  # nodes reached, and accepted
    assert bool((added[..., 1] > 0).any(-1).all())  # every class counted
