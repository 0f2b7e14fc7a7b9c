"""Static steps of merged trees (speculation.drafts: index | hybrid): the learned draft's step function
(hybrid), the host's merge with the suffix index's candidates, then a verify step of the tree the host
built. The same tokens, acceptance and calibration counts as the eager engine (and plain decoding's
tokens), no host sync inside either step function, about the learned step's op count, trees deeper than the
draft window allows cut to it, the host's merge into the verify's input in C the same as by tensor
operations, and the host work between the two step functions timed by its tool."""

import random

import pytest
import torch

from fastgrpo.engines.embedded.engine import EmbeddedEngine
from fastgrpo.engines.embedded.steps import depth_bucket, merged_rows, tree_rows
from fastgrpo.engines.embedded.tree import Tree, ancestor_mask, compiled_merge_rows
from fastgrpo.models.policy import new_policy
from fastgrpo.speculation.policy import Static
from fastgrpo.speculation.spec import SpecConfig
from fastgrpo.speculation.suffix_index import CandidateRows, IndexLimits
from fastgrpo.types import Request
from tests.test_families import trained_draft
from tests.test_hybrid_merge import calibration_of, depth_limit, random_case
from tests.test_moe_engine import hf_model, qwen3_moe
from tests.test_static_steps import SAMPLINGS, STOPS, assert_same, audited, dense, engine, host_time_tool, prompts  # noqa: F401


def test_a_host_tree_crosses_as_rows_of_tokens_parents_depths_and_verified_nodes():
    """One row: root 9, nodes 1 (token 4, depth 1), 2 (token 6 under 1, depth 2), 3 (token 8 under 2, depth 3)
    and 4 (the merge's padding, left out). Walking 2 levels, node 3 is left out too, and both become padding
    nodes (token 0 under the root at depth 1). The second row is a padded row: a root alone."""
    parents = torch.tensor([[0, 0, 1, 2, 0]])
    tree = Tree(torch.tensor([[9, 4, 6, 8, 0]]), parents, torch.tensor([[0, 1, 2, 3, 1]]), ancestor_mask(parents, 3),
                valid=torch.tensor([[True, True, True, True, False]]))
    rows = torch.full((2, 4, 5), 7)  # (what an earlier step left in the buffer)
    tree_rows(tree, rows.view(2, 20), depth=2)
    assert rows[0].tolist() == [[9, 4, 6, 0, 0], [0, 0, 1, 0, 0], [0, 1, 2, 1, 1], [1, 1, 1, 0, 0]]
    assert rows[1].tolist() == [[0] * 5, [0] * 5, [0, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert [depth_bucket(d, 11) for d in (0, 1, 3, 5, 7, 9, 12)] == [1, 1, 4, 6, 8, 11, 11]


@pytest.mark.skipif(compiled_merge_rows is None, reason="the compiled merge is not built here")
@pytest.mark.parametrize("calibrated", [False, True], ids=["raw", "calibrated"])
def test_the_compiled_merge_writes_the_rows_and_tree_of_the_tensor_route(calibrated):
    """`merged_rows` in one C call against unpacking, merging and writing the rows as tensor operations, on
    the merge tests' random trees packed as `propose` packs them: the same verify rows (padded rows after
    the running ones included), the same merged tree, deepest node and finiteness; with depth limits, a
    row's non-finite draft (every row then the index's candidates alone) and the index alone."""
    rng = random.Random(3)
    calibration = calibration_of(rng, calibrated)
    cases = {"learned": 0, "index alone": 0, "non-finite": 0, "limited": 0}
    for trial in range(60):
        learned, cands, roots, N = random_case(rng, trial)
        B, max_depth = len(roots), depth_limit(trial) or N - 1
        packed = None
        if learned is not None:
            finite = torch.ones(B, 1, dtype=torch.float64)
            if trial % 7 == 3:
                finite[rng.randrange(B)] = 0.0
            packed = torch.cat([t.double() for t in (learned.tokens, learned.parents, learned.depth, learned.score)]
                               + [finite], 1)
            cases["non-finite" if trial % 7 == 3 else "learned"] += 1
        else:
            cases["index alone"] += 1
        cases["limited"] += max_depth < N - 1
        rows = B + trial % 3
        outs, results = [], []
        for compiled in (False, True):
            out = torch.full((rows, 4 * N), 7, dtype=torch.long)  # (what an earlier step left in the buffer)
            results.append(merged_rows(packed, CandidateRows.of(cands), torch.tensor(roots), N, calibration, max_depth, out,
                                       compiled=compiled))
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), trial
        (reference, deepest, finite), (tree, c_deepest, c_finite) = results
        assert (c_deepest, c_finite) == (deepest, finite), trial
        assert finite == (packed is None or trial % 7 != 3)
        assert deepest <= max_depth and int(outs[1][:B, 2 * N:3 * N].max()) <= max(max_depth, 1)
        valid = torch.ones(B, N, dtype=torch.bool) if reference.valid is None else reference.valid
        assert torch.equal(tree.valid, valid), trial
        for name in ("tokens", "parents", "depth", "source", "raw", "match"):
            a, b = getattr(reference, name), getattr(tree, name)
            assert a.dtype == b.dtype and torch.equal(a, b), (trial, name)
    assert min(cases.values()) >= 4, cases


def test_merged_rows_refuses_a_buffer_the_verify_cannot_read():
    cands = random_case(random.Random(0), 0)[1]
    with pytest.raises(ValueError, match=r"int64 CPU tensor \[rows, 48\]"):
        merged_rows(None, CandidateRows.of(cands), torch.zeros(len(cands), dtype=torch.long), 12, None, 11,
                    torch.zeros(len(cands), 40, dtype=torch.long), compiled=compiled_merge_rows is not None)


def merged_engine(cfg, target, draft, drafts, tree, window=16, **engine_args):
    e = EmbeddedEngine(cfg, 6, 128, eos_id=STOPS, pad_id=0, policy=Static(tree), static_steps=True,
                       draft_window=window, **engine_args)
    e.update_weights(target.state_dict().items(), version=0)
    e.update_draft(draft.state_dict().items(), version=0)
    e.set_drafts(drafts, IndexLimits(window=8, depth=6))
    return e


@pytest.mark.parametrize("drafts", ["hybrid", "index"])
def test_merged_static_steps_emit_plain_decodings_tokens_and_accept_as_the_eager_engine(dense, drafts):
    """Two visits of prompts asked twice each (siblings first, then the first visit's answers as history):
    greedy tokens are plain decoding's, every decode step ran static, and the second visit accepts longer
    paths than the first, as the eager engine's does, by as much."""
    cfg, target, draft = dense
    ps = prompts(5, seed=8)
    requests = [Request(p) for _ in range(2) for p in ps]
    sampling = SAMPLINGS["greedy"]
    plain = engine(cfg, target, False).generate(requests, sampling, seed=3)
    static = merged_engine(cfg, target, draft, drafts, SpecConfig(3, 2, 8))
    eager = engine(cfg, target, False, draft, Static(SpecConfig(3, 2, 8)))
    eager.set_drafts(drafts, IndexLimits(window=8, depth=6))
    accepted = []
    for visit in range(2):
        got, want = static.generate(requests, sampling, seed=3), eager.generate(requests, sampling, seed=3)
        assert_same(target, ps + ps, got, plain, sampling, 3)
        assert_same(target, ps + ps, got, want, sampling, 3)
        s, w = static.stats(), eager.stats()
        assert s["static_steps"] == s["decode_steps"] == s["spec_steps"] > 0
        assert abs(s["accept_len"] - w["accept_len"]) < 0.05, (s["accept_len"], w["accept_len"])
        assert abs(s["index_accepted"] - w["index_accepted"]) <= 0.05 * w["index_accepted"]
        accepted.append(s["accept_len"])
        # every verified node's outcome counted into the calibration, the last step's included
        assert torch.equal(static.calibration.counts, eager.calibration.counts), (
            static.calibration.counts, eager.calibration.counts)
    assert accepted[1] > accepted[0] + 0.5  # the history's answers were accepted, deep


def test_the_index_is_tidied_while_a_static_step_computes_and_drafts_as_the_eager_ones(dense):
    """Four prompts asked three times in one call, each keeping its last response: a prompt's second and
    third finished responses put it over its limit mid-call. The static engine removes the oldest (`tidy`)
    while a step function computes (launched, not yet read back), once a step, as the eager engine does
    after its step: the same tokens, accepted nodes, calibration counts and histories."""
    cfg, target, draft = dense
    ps = prompts(4, seed=8)
    requests = [Request(p) for _ in range(3) for p in ps]
    sampling, limits = SAMPLINGS["greedy"], IndexLimits(window=8, depth=6, responses=1)
    static = merged_engine(cfg, target, draft, "hybrid", SpecConfig(3, 2, 8))
    static.set_drafts("hybrid", limits)
    eager = engine(cfg, target, False, draft, Static(SpecConfig(3, 2, 8)))
    eager.set_drafts("hybrid", limits)
    launched, tidied = [False], []
    run, read_back, tidy = static.graphs.run, static._read_back, static.index.tidy

    def run_and_mark(key, step):
        launched[0] = True
        return run(key, step)

    def read_back_and_mark(*args, **kwargs):
        launched[0] = False
        return read_back(*args, **kwargs)

    def tidy_and_record():
        over = any(len(e.history) > limits.responses for e in static.index.prompts.values())
        tidied.append((static._in_step, launched[0], over))
        tidy()

    static.graphs.run, static._read_back, static.index.tidy = run_and_mark, read_back_and_mark, tidy_and_record
    got, want = static.generate(requests, sampling, seed=3), eager.generate(requests, sampling, seed=3)
    assert_same(target, ps * 3, got, want, sampling, 3)
    assert sum(over for in_step, _, over in tidied if in_step) >= 2  # prompts went over their limit mid-call
    assert all(at_launch for in_step, at_launch, over in tidied if in_step)
    s, w = static.stats(), eager.stats()
    assert s["static_steps"] == s["decode_steps"] and s["index_accepted"] == w["index_accepted"] > 0
    assert torch.equal(static.calibration.counts, eager.calibration.counts)
    for key, entry in static.index.prompts.items():  # within its limit when the call returns, as the eager one's
        assert len(entry.history) == limits.responses and static.index.history(key) == eager.index.history(key)


@pytest.mark.parametrize("drafts", ["hybrid", "index"])
def test_no_merged_step_function_syncs_or_copies_host_data(dense, drafts):
    """The learned draft's step and the verify step pass the strict audit (the merge between them is host
    work by design: the tree crosses to the device before the verify step, not inside it)."""
    cfg, target, draft = dense
    e = merged_engine(cfg, target, draft, drafts, SpecConfig(4, 4, 12))
    requests = [Request(p) for _ in range(2) for p in prompts(3, seed=1)]
    for name in ("t0.7-cut", "greedy"):
        audits = audited(e)
        e.generate(requests, SAMPLINGS[name], seed=1)
        assert {key[0] for key, _ in audits} == ({"draft", "verify"} if drafts == "hybrid" else {"verify"})
        assert all(not a.violations for _, a in audits)


def test_trees_deeper_than_the_draft_window_holds_are_cut_to_it(dense):
    """A draft window of 3 keeps 3 pending states a row, so a static verify walks at most 2 levels; the
    index's chains reach 6 (and the learned tree of depth 2 fits). Deeper nodes are left out, tokens stay
    plain decoding's."""
    cfg, target, draft = dense
    ps = prompts(4, seed=2)
    requests = [Request(p) for _ in range(2) for p in ps]
    sampling = SAMPLINGS["greedy"]
    plain = engine(cfg, target, False).generate(requests, sampling, seed=1)
    e = merged_engine(cfg, target, draft, "hybrid", SpecConfig(2, 3, 10), window=3)
    depths, run = [], e.graphs.run
    e.graphs.run = lambda key, step: (depths.append(key[2]) if key[0] == "verify" else None) or run(key, step)
    for _ in range(2):
        assert_same(target, ps + ps, e.generate(requests, sampling, seed=1), plain, sampling, 1)
        assert e.stats()["static_steps"] == e.stats()["decode_steps"]
    assert depths and max(depths) == 2


def test_a_non_finite_learned_draft_leaves_the_index_alone_for_the_step(dense, caplog):
    """A NaN draft cannot raise inside its step function: the host sees the row's flag after reading its
    tree back and merges the index's candidates alone. Tokens are plain decoding's, and the second visit
    still accepts the first visit's answers, all from the index."""
    cfg, target, draft = dense
    ps = prompts(4, seed=6)
    requests = [Request(p) for _ in range(2) for p in ps]
    sampling = SAMPLINGS["greedy"]
    plain = engine(cfg, target, False).generate(requests, sampling, seed=2)
    e = merged_engine(cfg, target, draft, "hybrid", SpecConfig(3, 2, 8))
    e.update_draft([(k, torch.full_like(v, float("nan")) if k == "norm" else v) for k, v in draft.state_dict().items()],
                   version=1)
    for _ in range(2):
        assert_same(target, ps + ps, e.generate(requests, sampling, seed=2), plain, sampling, 2)
    stats = e.stats()
    assert stats["static_steps"] == stats["decode_steps"] and stats["accept_len"] > 2.0
    # every accepted token was the index's (the count also holds nodes accepted past a row's stop)
    assert stats["index_accepted"] >= stats["spec_emitted"] - stats["spec_seq_steps"] > 0
    assert "the index's candidates alone" in caplog.text


def test_merged_static_steps_capture_the_states_eager_steps_capture(dense):
    """Online draft learning reads the target's state at every position from generate(capture=True),
    whichever source proposed the accepted nodes."""
    cfg, target, draft = dense
    ps = prompts(4, seed=7)
    requests = [Request(p) for _ in range(2) for p in ps]
    sampling = SAMPLINGS["t1"]
    eager = engine(cfg, target, False, draft, Static(SpecConfig(3, 2, 8)))
    eager.set_drafts("hybrid", IndexLimits(window=8, depth=6))
    static = merged_engine(cfg, target, draft, "hybrid", SpecConfig(3, 2, 8))
    for _ in range(2):
        a = eager.generate(requests, sampling, seed=3, capture=True)
        b = static.generate(requests, sampling, seed=3, capture=True)
    assert static.stats()["index_accepted"] > 0
    for p, x, y in zip(ps + ps, a, b):
        assert x.token_ids == y.token_ids
        assert x.hidden.shape == y.hidden.shape == (len(p) + len(x.token_ids) - 1, cfg.hidden_size)
        assert torch.allclose(x.hidden, y.hidden, atol=1e-4)


def test_a_mixture_of_experts_keeps_the_routing_of_merged_trees_accepted_nodes():
    """Routing replay through merged static steps: each kept position's experts are those its verify ran,
    as the eager engine records them."""
    cfg = qwen3_moe()
    hf = hf_model(cfg)
    ps = prompts(3, seed=3)
    draft = trained_draft(cfg, hf, ps)
    requests = [Request(p) for _ in range(2) for p in ps]
    runs = []
    for static in (False, True):
        e = EmbeddedEngine(cfg, 6, 128, eos_id=STOPS, pad_id=0, policy=Static(SpecConfig(3, 2, 6)), static_steps=static)
        e.update_weights(hf.state_dict().items(), version=0)
        e.update_draft(draft.state_dict().items(), version=0)
        e.set_drafts("hybrid", IndexLimits(window=8, depth=6))
        for _ in range(2):
            out = e.generate(requests, SAMPLINGS["t1"], seed=2, routing=True)
        runs.append((out, e.stats()))
    (eager, _), (static, stats) = runs
    assert stats["static_steps"] == stats["decode_steps"] and stats["index_accepted"] > 0
    assert_same(hf, ps + ps, static, eager, SAMPLINGS["t1"], 2)
    for a, b in zip(static, eager):
        if a.token_ids == b.token_ids:
            assert torch.equal(a.routing, b.routing)


def test_a_merged_step_dispatches_about_what_the_learned_step_of_its_shape_does(dense):
    """Ops (every aten call, views included) of d4k4n12 at two depths of the same model: the draft's step
    none per target layer, and the two step functions together at most 40 more than the learned step
    (measured: 540 + 360 against 876 at 2 layers; the packing of the draft's tree and the verify's ancestor
    mask). An op per row or per node breaks this."""
    cfg, _, draft = dense
    ops = {}
    for layers in (2, 4):
        c = cfg.__class__(**{**cfg.to_dict(), "num_hidden_layers": layers})
        t = new_policy(c, seed=1).eval()
        learned = engine(c, t, True, draft, Static(SpecConfig(4, 4, 12)))
        for name, e in (("learned", learned), ("hybrid", merged_engine(c, t, draft, "hybrid", SpecConfig(4, 4, 12)))):
            audits = audited(e)
            e.generate([Request(p) for p in prompts(4, seed=1)], SAMPLINGS["t1"], seed=1)
            for key, a in audits:
                step = key[0] if isinstance(key[0], str) else name
                ops[(layers, step)] = max(ops.get((layers, step), 0), a.total)
    assert ops[(2, "draft")] == ops[(4, "draft")]
    for layers in (2, 4):
        assert ops[(layers, "draft")] + ops[(layers, "verify")] <= ops[(layers, "learned")] + 40, ops


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graphs_replay_merged_steps(dense):
    """On a GPU the draft's and the verify's graphs replay, the merged tree crossing through a pinned
    buffer: the same tokens with graphs on and off, over two visits (the index's history)."""
    cfg, target, draft = dense
    requests = [Request(p) for _ in range(2) for p in prompts(5, seed=2)]
    runs = []
    for graphs in (False, True):
        e = merged_engine(cfg, target, draft, "hybrid", SpecConfig(4, 4, 12), device="cuda", graphs=graphs)
        runs.append([e.generate(requests, SAMPLINGS["t1"], seed=4) for _ in range(2)])
    assert e.graphs.captures > 0 and e.graphs.replays > e.graphs.captures and e.stats()["index_accepted"] > 0
    for off, on in zip(*runs):
        assert [o.token_ids for o in off] == [o.token_ids for o in on]


def test_the_host_time_tool_splits_a_merged_steps_host_work():
    """tools/step_host_time.py --merged at a small size: both parts of the host work between a merged
    step's step functions are timed at each level, and the index drafted (its second call on)."""
    rows = host_time_tool("--merged", "--tokens", "8")
    for r in rows:
        assert r["overlapped_ms_per_step"] > 0 and r["waited_ms_per_step"] > 0 and r["index_accepted"] > 0
        assert r["waited_us_per_row"] == pytest.approx(1e3 * r["waited_ms_per_step"] / r["running"])
