"""Static steps of trees cut per sequence (speculation.policy: aware_per_sequence, drafts: learned): the learned
draft's step function, the policy's choice of nodes on the host at one of the widths the verify runs, the cut
trees moved to the front of their rows, then a verify step of that width. The same tokens and acceptance as
the eager engine's ragged verify of the same nodes (and plain decoding's tokens), no host sync inside either
step function, narrower verify steps where the policy cut, and `aware_per_sequence` itself running static."""

import math

import pytest
import torch

from fastgrpo.engines.embedded.steps import cut_tree, node_widths
from fastgrpo.engines.embedded.tree import Tree
from fastgrpo.speculation.cost_model import CostModel
from fastgrpo.speculation.per_sequence import AwarePerSequence
from fastgrpo.speculation.policy import Static
from fastgrpo.speculation.spec import SpecConfig
from fastgrpo.types import Request
from tests.test_speculation_policy import linear_costs
from tests.test_static_steps import SAMPLINGS, assert_same, audited, dense, engine, host_time_tool, prompts  # noqa: F401


def test_a_cut_tree_moves_each_rows_kept_nodes_to_its_front_and_takes_the_narrowest_width():
    """Two rows of a 6-node tree (root 0; nodes 1, 2 under it; 3 under 1; 4 under 3; 5 under 2). Row 0 keeps
    1, 2, 5: columns root, 1, 2, 5, its parents renumbered (5's parent 2 is now column 2). Row 1 keeps 1, 3, 4,
    but its draft was not finite: its root alone. Four nodes need width 4 on the ladder of 6 (1, 2, 4, 6)."""
    parents = torch.tensor([[0, 0, 0, 1, 3, 2]] * 2)
    depth = torch.tensor([[0, 1, 1, 2, 3, 2]] * 2)
    tree = Tree(torch.tensor([[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25]]), parents, depth,
                torch.empty(2, 6, 0, dtype=torch.bool), torch.tensor([[0.0, -1, -2, -3, -4, -5]] * 2))
    chosen = torch.tensor([[True, True, False, False, True], [True, False, True, True, False]])
    assert node_widths(6) == [1, 2, 4, 6] and node_widths(12) == [1, 2, 4, 6, 8, 12]
    cut = cut_tree(tree, chosen, finite=torch.tensor([True, False]))
    assert cut.tokens[0].tolist() == [10, 11, 12, 15] and cut.tokens.shape == (2, 4)
    assert cut.parents[0].tolist() == [0, 0, 0, 2] and cut.depth[0].tolist() == [0, 1, 1, 2]
    assert cut.score[0].tolist() == [0.0, -1, -2, -5]
    assert cut.valid.tolist() == [[True] * 4, [True, False, False, False]]
    assert cut.tokens[1, 0] == 20 and cut.parents[1].tolist() == [0, 0, 0, 0]  # left-out columns: no parent
    every = cut_tree(tree, torch.ones(2, 5, dtype=torch.bool))  # the whole tree: width 6, nothing moved
    assert every.tokens.tolist() == tree.tokens.tolist() and every.parents.tolist() == parents.tolist()


def test_at_a_static_engines_widths_the_budget_picks_the_width_of_highest_predicted_goodput():
    """Three rows of a 6-node tree (two children of the root, three grandchildren), against each width a
    static verify offers (1, 2, 4, 6 nodes a row, root included), scored by the goodput the policy
    maximises: expected tokens (B + each row's w - 1 most probable nodes' draft probabilities) over draft +
    verify seconds of B w tokens. The choice is the best width, every row keeps exactly its w - 1 most
    probable nodes, and a kept grandchild keeps its parent."""
    config = SpecConfig(2, 2, 6)  # drafted in 2 levels: 2 ms of draft
    depth = torch.tensor([[1, 1, 2, 2, 2]] * 3)
    parent = [None, None, 0, 0, 1]  # the grandchildren's parents among the nodes
    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        first = torch.rand(3, 2, generator=g)
        p = torch.cat([first, first[:, [0, 0, 1]] * torch.rand(3, 3, generator=g)], 1)
        policy = AwarePerSequence(linear_costs(per_token=float(torch.rand(1, generator=g)) * 0.004), margin=0.0)
        chosen = policy.select(p.log(), depth, config, 3, widths=node_widths(6))

        def goodput(w: int) -> float:
            top = sum(sum(sorted(p[b].tolist(), reverse=True)[:w - 1]) for b in range(3))
            return (3 + top) / (0.002 + policy.costs.target(3 * w))

        kept = chosen.sum(1).tolist()
        assert len(set(kept)) == 1 and kept[0] + 1 in (1, 2, 4, 6), trial
        assert goodput(kept[0] + 1) == pytest.approx(max(map(goodput, (1, 2, 4, 6))), rel=1e-9), trial
        for b in range(3):
            assert sorted(p[b][chosen[b]].tolist()) == sorted(p[b].tolist())[5 - kept[0]:]
            assert all(not chosen[b, j] or chosen[b, parent[j]] for j in (2, 3, 4))


class KeepSure(Static):
    """A fixed tree shape whose verify keeps each row's nodes of draft probability >= 0.3 (ancestor-closed:
    a path's probability never exceeds its parent's), whatever widths the engine offers: the eager engine
    verifies them ragged, the static one at the narrowest width holding every row's."""

    def select(self, scores, depth, config, running, widths=None):
        return scores >= math.log(0.3)


def verified_widths(e) -> list[int]:
    """The widths of `e`'s static verify steps, in order."""
    widths, verify = [], e.steps.verify

    def recorded(nodes, *args, **kwargs):
        widths.append(nodes)
        return verify(nodes, *args, **kwargs)

    e.steps.verify = recorded
    return widths


@pytest.mark.parametrize("name", ["greedy", pytest.param("t0.7-cut", marks=pytest.mark.slow)])
def test_static_steps_with_per_sequence_budgets_equal_eager_ones(dense, name):
    cfg, target, draft = dense
    sampling, ps = SAMPLINGS[name], prompts(7, seed=5)
    requests = [Request(p) for p in ps]
    off = engine(cfg, target, False).generate(requests, sampling, seed=9)
    eager_engine = engine(cfg, target, False, draft, KeepSure(SpecConfig(4, 4, 12)))
    eager = eager_engine.generate(requests, sampling, seed=9)
    static_engine = engine(cfg, target, True, draft, KeepSure(SpecConfig(4, 4, 12)))
    widths = verified_widths(static_engine)
    static = static_engine.generate(requests, sampling, seed=9)
    assert_same(target, ps, static, eager, sampling, 9)
    assert_same(target, ps, static, off, sampling, 9)
    stats = static_engine.stats()
    assert stats["static_steps"] == stats["decode_steps"] and stats["spec_steps"] > 0  # every step static
    assert stats["accept_len"] == eager_engine.stats()["accept_len"]  # the same nodes verified, the same accepted
    assert len(widths) == stats["spec_steps"] and set(widths) <= set(node_widths(12))
    assert min(widths) < 12  # where every row's kept nodes fit a narrower width, the verify ran at it
    if name == "greedy":
        assert stats["accept_len"] > 1.5


def test_static_per_sequence_steps_do_not_sync_inside_their_step_functions(dense):
    cfg, target, draft = dense
    e = engine(cfg, target, True, draft, KeepSure(SpecConfig(4, 4, 12)))
    audits = audited(e)
    e.generate([Request(p) for p in prompts(5, seed=1)], SAMPLINGS["t0.7-cut"], seed=1)
    assert {key[0] for key, _ in audits if isinstance(key[0], str)} >= {"draft", "verify"}
    assert all(not a.violations for _, a in audits)


def test_aware_per_sequence_runs_static_steps_and_cuts_where_verifying_is_dear(dense):
    """A cost model in which a verified token costs 1/256 of a plain step (far above this CPU's seconds, so
    measured times do not move it): the policy verifies narrower than the drafted trees on some steps, every
    step runs static, and the tokens stay plain decoding's (greedy)."""
    cfg, target, draft = dense
    requests = [Request(p) for p in prompts(6, seed=3)]
    off = engine(cfg, target, False).generate(requests, SAMPLINGS["greedy"], seed=2)
    grid = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    policy = AwarePerSequence(CostModel({t: 1e4 * (1 + t / 256) for t in grid}, {t: 1e3 for t in grid}), margin=0.0)
    e = engine(cfg, target, True, draft, policy)
    widths = verified_widths(e)
    out = e.generate(requests, SAMPLINGS["greedy"], seed=2)
    assert [o.token_ids for o in out] == [o.token_ids for o in off]
    stats = e.stats()
    assert stats["static_steps"] == stats["decode_steps"] > 0 and len(widths) == stats["spec_steps"] > 0
    # a static step verifies B (w - 1) of the B (N - 1) drafted nodes: fewer, where a narrower width ran
    assert 0 < policy.verified_nodes < policy.offered_nodes


def test_the_host_time_tool_times_a_cut_steps_host_work():
    """tools/step_host_time.py --cut at a small size: the host work between the draft's read-back and the
    verify's launch is timed at each level, and the budget cut (a random draft's nodes are rarely worth their
    verify under the tool's GPU-like prices)."""
    rows = host_time_tool("--cut", "--tokens", "8")
    for r in rows:
        assert r["waited_ms_per_step"] > 0 and 0 <= r["verified_share"] < 1
        assert r["waited_us_per_row"] == pytest.approx(1e3 * r["waited_ms_per_step"] / r["running"])
        assert 0 < r["select_warm_ms"] and 0 < r["select_in_step_ms"] < r["waited_ms_per_step"]  # the choice is in it
