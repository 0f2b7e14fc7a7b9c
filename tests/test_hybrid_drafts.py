"""Hybrid draft trees (tree.hybrid_tree, speculation.drafts: index | hybrid): the merged tree's shape,
and losslessness whatever proposed a node's children: verification equals sequential keyed sampling
on any tree, the engine's tokens equal plain decoding's, and sampled tokens follow the target's
distribution at nodes the index proposed, right or wrong, alone or with the learned draft."""

import math
import random
from dataclasses import replace

import pytest
import torch

import fastgrpo.engines.embedded.engine as engine_module
from fastgrpo.engines.embedded.tree import INDEX, LEARNED, Tree, ancestor_mask, hybrid_tree, verify_tree
from fastgrpo.models.sampling import sample, sampling_logprobs
from fastgrpo.speculation.policy import Static
from fastgrpo.speculation.spec import SpecConfig
from fastgrpo.speculation.suffix_index import CandidateRows, Candidates, IndexLimits
from fastgrpo.types import Request, SamplingParams
from tests.conftest import first_divergence_is_a_near_tie
from tests.test_speculation import (MIXED_PROMPTS, VOCAB, engine_for, mixed_calls_scored, rank_fit_p,  # noqa: F401
                                    small_vocab, spread_vocab)

SAMPLINGS = [SamplingParams(temperature=1.0, max_new_tokens=30),
             SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=30)]


def learned_tree(paths: list[tuple[int, ...]], scores: list[float], root: int) -> Tree:
    """A one-row learned tree of these paths (parents listed before children) and draft log-probabilities."""
    index = {(): 0} | {p: i + 1 for i, p in enumerate(paths)}
    parents = torch.tensor([[0] + [index[p[:-1]] for p in paths]])
    depth = torch.tensor([[0] + [len(p) for p in paths]])
    return Tree(torch.tensor([[root] + [p[-1] for p in paths]]), parents, depth,
                ancestor_mask(parents, int(depth.max())), torch.tensor([[0.0] + scores]))


def candidates(paths: list[tuple[int, ...]], logp: list[float]) -> Candidates:
    index = {p: i for i, p in enumerate(paths)}
    return Candidates(tokens=[p[-1] for p in paths], parents=[index.get(p[:-1], -1) for p in paths],
                      depth=[len(p) for p in paths], logp=logp, counts=[1] * len(paths), match_len=2)


def node_paths(tree: Tree, b: int = 0) -> list[tuple[int, ...]]:
    paths: list[tuple[int, ...]] = [()]
    for j in range(1, tree.tokens.shape[1]):
        paths.append(paths[int(tree.parents[b, j])] + (int(tree.tokens[b, j]),))
    return paths


def test_a_path_both_sources_propose_is_one_node_scored_by_the_larger_estimate():
    learned = learned_tree([(3,), (4,), (3, 5), (3, 6)], [-0.1, -1.0, -0.5, -2.0], root=7)
    index = candidates([(3,), (3, 5), (3, 5, 2), (6,)], [-0.3, -0.4, -0.45, -3.0])
    tree = hybrid_tree(learned, CandidateRows.of([index]), torch.tensor([7]), num_verify=6)
    paths = node_paths(tree)
    assert tree.valid is None and len(paths) == 6
    # the five best of seven distinct paths: (3) -0.1, (3,5) -0.4, (3,5,2) -0.45, (4) -1.0, (3,6) -2.0; (6) -3.0 out
    want = {(3,): (-0.1, LEARNED | INDEX), (3, 5): (-0.4, LEARNED | INDEX), (3, 5, 2): (-0.45, INDEX),
            (4,): (-1.0, LEARNED), (3, 6): (-2.0, LEARNED)}
    got = {p: (round(float(tree.score[0, j]), 6), int(tree.source[0, j])) for j, p in enumerate(paths) if p}
    assert got == want
    for j, p in enumerate(paths):  # each node's parent is its path's prefix, its depth the path's length
        assert int(tree.depth[0, j]) == len(p) and (j == 0 or paths[int(tree.parents[0, j])] == p[:-1])
        siblings = [q[-1] for q in paths if q and q[:-1] == p[:-1]]
        assert not p or siblings.count(p[-1]) == 1  # a node's children are distinct tokens
    assert all(tree.mask[0, j, k] == (paths[k] == paths[j][: len(paths[k])]) for j in range(6) for k in range(6))


def test_rows_with_fewer_nodes_than_the_budget_verify_only_theirs():
    rows = [candidates([(1,), (1, 2)], [-0.1, -0.2]), Candidates()]
    tree = hybrid_tree(None, CandidateRows.of(rows), torch.tensor([5, 6]), num_verify=4)
    assert tree.valid.tolist() == [[True, True, True, False], [True, False, False, False]]
    assert node_paths(tree)[:3] == [(), (1,), (1, 2)]
    # a left-out node is never accepted, whatever the target samples there
    logprobs = torch.full((2, 4, VOCAB), -30.0)
    logprobs[:, :, 0] = 0.0  # the target always samples token 0: row 1's padding node is token 0
    result = verify_tree(logprobs, tree, SamplingParams(temperature=1.0), torch.rand(2, 3))
    assert result.accepted.tolist() == [0, 0]


def target_logprobs(prefix: tuple[int, ...], sampling: SamplingParams) -> torch.Tensor:
    """A synthetic target: its next-token distribution after `prefix`, a fixed function of the prefix."""
    g = torch.Generator().manual_seed(hash(prefix) % (2**31))
    return sampling_logprobs(2.0 * torch.randn(VOCAB, generator=g), sampling)


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["t1", "t0.7-k5-p0.9"])
def test_verification_emits_the_plain_samples_whatever_proposed_the_children(sampling):
    """On any merged tree (index candidates right, wrong, or the learned draft's own), verification
    emits exactly the tokens sequential sampling with the same per-position noise emits: the children
    decide only how many of them one verify yields. Checked against the plain sequence, computed apart."""
    rng = random.Random(0)
    depth_seen, index_accepted, learned_accepted = 0, 0, 0
    for trial in range(300):
        u = torch.rand(1, 8, generator=torch.Generator().manual_seed(trial))
        plain, prefix = [], ()
        for k in range(8):  # the plain sequence: position k sampled with noise u[k]
            x = int(sample(target_logprobs(prefix, sampling)[None], sampling, u[:, k])[0])
            plain.append(x)
            prefix += (x,)

        def some_paths(n, right_len):
            """`right_len` tokens of the plain sequence, then random branches (mostly wrong)."""
            paths = [tuple(plain[:d]) for d in range(1, right_len + 1)]
            while len(paths) < n:
                base = rng.choice([()] + paths)
                if len(base) < 6:
                    p = base + (rng.randrange(VOCAB),)
                    if p not in paths:
                        paths.append(p)
            return sorted(paths, key=len)

        lpaths = some_paths(rng.randint(1, 8), rng.randint(0, 2))
        learned = learned_tree(lpaths, sorted((-rng.random() * len(p) for p in lpaths), reverse=True), root=1)
        ipaths = some_paths(rng.randint(0, 8), rng.randint(0, 6)) + rng.sample(lpaths, min(2, len(lpaths)))
        ipaths = sorted(set(ipaths), key=len)
        index = candidates(ipaths, [-0.3 * len(p) - 0.01 * rng.random() for p in ipaths])
        tree = hybrid_tree(learned if trial % 4 else None, CandidateRows.of([index]), torch.tensor([1]), rng.randint(2, 12))
        paths = node_paths(tree)
        logprobs = torch.stack([target_logprobs(p, sampling) for p in paths])[None]
        result = verify_tree(logprobs, tree, sampling, u[:, : int(tree.depth.max()) + 1])
        a = int(result.accepted)
        assert result.tokens[0, : a + 1].tolist() == plain[: a + 1]
        assert [paths[j] for j in result.path[0, :a].tolist()] == [tuple(plain[:d]) for d in range(1, a + 1)]
        assert tuple(plain[: a + 1]) not in paths  # it stopped where no child held the sample
        depth_seen = max(depth_seen, a)
        sources = tree.source[0, result.path[0, :a]].tolist()
        index_accepted += sum(s == INDEX for s in sources)
        learned_accepted += sum(s & LEARNED > 0 for s in sources)
    assert depth_seen >= 4 and index_accepted >= 100 and learned_accepted >= 20


class RecordingTrees:
    """The merged trees an engine verifies, and the accepted nodes' sources."""

    def __init__(self, monkeypatch):
        self.trees, self.accepted_sources = [], []
        verify = engine_module.verify_tree

        def recording(logprobs, tree, *args):
            result = verify(logprobs, tree, *args)
            if tree.source is not None:
                self.trees.append(tree)
                for b, a in enumerate(result.accepted.tolist()):
                    self.accepted_sources += tree.source[b, result.path[b, :a]].tolist()
            return result

        monkeypatch.setattr(engine_module, "verify_tree", recording)

    def proposed(self, bits: int) -> int:
        return sum(int(((t.source == bits) & (t.valid if t.valid is not None else True)).sum()) for t in self.trees)


def wrong_history(engine, prompts, rng: random.Random) -> None:
    """Fill the engine's index with random responses of these prompts (wrong candidates, mostly)."""
    for p in prompts:
        for _ in range(4):
            r = engine.index.open(tuple(p), p)
            r.extend([rng.randrange(2, VOCAB) for _ in range(30)])
            r.close()


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0, max_new_tokens=30)] + SAMPLINGS,
                         ids=["greedy", "t1", "t0.7-k5-p0.9"])
@pytest.mark.parametrize("drafts", ["hybrid", "index"])
def test_tokens_equal_plain_decoding_with_index_candidates_right_wrong_and_duplicated(
        small_vocab, monkeypatch, sampling, drafts):
    """Keyed sampling: each position's noise is fixed by (seed, request, position), so speculative
    decoding emits plain decoding's tokens (sampled: up to a float-rounding flip at a CDF boundary,
    checked by a full forward), whatever the index proposes: first wrong history (random responses of
    the same prompts), then live siblings, then the right one (the same call again: its history holds
    these very responses). The learned draft (random) and the index propose the same node often."""
    cfg, target, draft = small_vocab
    prompts = [[1, 3, 4], [1, 5, 5, 6], [1, 2]]
    reqs = [Request(prompts[i % 3], max_new_tokens=10 + (7 * i) % 21) for i in range(24)]
    plain = [c.token_ids for c in engine_for(cfg, target, None).generate(reqs, sampling, seed=9)]
    trees = RecordingTrees(monkeypatch)
    engine = engine_for(cfg, target, draft, Static(SpecConfig(3, 2, 6)), max_batch=12)
    engine.set_drafts(drafts, IndexLimits(window=8, depth=6))
    wrong_history(engine, prompts, random.Random(0))
    first = [c.token_ids for c in engine.generate(reqs, sampling, seed=9)]
    accepted_first = engine.stats()["index_accepted"]
    again = [c.token_ids for c in engine.generate(reqs, sampling, seed=9)]
    stats = engine.stats()
    accept_again = stats["accept_len"]
    # every step speculated: each one's rows and host seconds, which together are all the index's and merge's
    rows = [r for r, _, _ in stats["host_steps"]]
    assert len(rows) == stats["spec_steps"] and sum(rows) == stats["spec_seq_steps"]
    assert sum(h for _, h, _ in stats["host_steps"]) == pytest.approx(stats["index_s"] + stats["merge_s"], rel=1e-9)
    assert all(hidden == 0.0 for _, _, hidden in stats["host_steps"])  # an eager step hides none of it
    for out in (first, again):
        same = sum(a == b for a, b in zip(out, plain))
        assert same >= 22 if not sampling.greedy else same == 24
        for i, (a, b) in enumerate(zip(out, plain)):
            assert first_divergence_is_a_near_tie(target, reqs[i].prompt_ids, a, b, sampling, 9, i), i
    assert engine.stats()["index_accepted"] > accepted_first  # the right history was accepted more...
    assert accept_again > 2.0  # ...deep (the repeated call's own responses are in the index)
    assert trees.proposed(INDEX) > 100  # index-only nodes, right and wrong
    assert trees.accepted_sources.count(INDEX) > 50
    if drafts == "hybrid":
        assert trees.proposed(LEARNED) > 100 and trees.proposed(LEARNED | INDEX) > 10  # merged duplicates


class SelectEverything(Static):
    """A per-sequence budget that keeps every node it is offered, padding included."""

    def select(self, scores, depth, config, running):
        self.offered = getattr(self, "offered", 0) + scores.numel()
        return torch.ones_like(scores, dtype=torch.bool)


def test_a_per_sequence_budget_cannot_bring_back_the_padding_of_rows_with_fewer_nodes(small_vocab, monkeypatch):
    """Index rows with fewer candidates than the budget pad with nodes they do not verify; the engine
    keeps them out whatever a per-sequence budget selects. Greedy output equals plain decoding's."""
    cfg, target, draft = small_vocab
    reqs = [Request([1, 3, 4], max_new_tokens=25) for _ in range(8)] + [Request([1, 2], max_new_tokens=20)] * 4
    greedy = SamplingParams(temperature=0.0, max_new_tokens=25)
    plain = [c.token_ids for c in engine_for(cfg, target, None).generate(reqs, greedy)]
    trees = RecordingTrees(monkeypatch)
    policy = SelectEverything(SpecConfig(3, 2, 6))
    engine = engine_for(cfg, target, draft, policy, max_batch=12)
    engine.set_drafts("index", IndexLimits(window=4, depth=2))  # chains of at most 2: fewer nodes than 5
    for _ in range(2):
        assert [c.token_ids for c in engine.generate(reqs, greedy)] == plain
    padding = [(t.source == 0) & (torch.arange(t.source.shape[1]) > 0) for t in trees.trees]
    assert policy.offered > 0 and sum(int(p.sum()) for p in padding) > 100
    assert not any((t.valid & p).any() for t, p in zip(trees.trees, padding))  # never verified
    assert engine.stats()["index_accepted"] > 0


def test_every_draft_source_takes_static_steps_where_the_draft_window_holds_the_learned_tree(small_vocab):
    cfg, target, draft = small_vocab
    engine = engine_for(cfg, target, draft, Static(SpecConfig(2, 2, 3)))
    engine.steps = object()  # stands for a static engine's step functions
    deep = SpecConfig(16, 2, 3)  # a learned tree deeper than the draft window (16 states) holds
    assert engine._static_takes(SpecConfig(2, 2, 3)) and not engine._static_takes(deep)
    engine.set_drafts("hybrid")
    assert engine._static_takes(SpecConfig(2, 2, 3)) and not engine._static_takes(deep)
    engine.set_drafts("index")  # no learned tree: index chains deeper than the window are cut to it
    assert engine._static_takes(deep) and engine._static_takes(None)
    engine.set_drafts("learned")
    assert engine.index is None and engine._static_takes(SpecConfig(2, 2, 3))
    with pytest.raises(ValueError, match="drafts"):
        engine.set_drafts("ngram")


# -- distribution ----------------------------------------------------------------------------------
def hybrid_sampled_tokens(cfg, target, draft, sampling, calls, monkeypatch):
    """Calls of 128 requests of MIXED_PROMPTS (2 to 12 new tokens) through a hybrid engine whose index
    starts with random (wrong) responses of those prompts and then gathers the calls' own: every
    emitted token with the target's logits before it (a full forward over its prefix) and, for tokens a
    verify step sampled below the root, the source bits of the node it was sampled at (else None)."""
    engine = engine_for(cfg, target, draft, Static(SpecConfig(4, 3, 12)), max_batch=48)
    engine.set_drafts("hybrid", IndexLimits(window=8, depth=6))
    wrong_history(engine, MIXED_PROMPTS, random.Random(1))
    where, last = {}, []
    verify, speculate = engine_module.verify_tree, engine._speculate

    def recording_verify(logprobs, tree, *args):
        result = verify(logprobs, tree, *args)
        last.append((tree, result))
        return result

    def recording_speculate(running, config, sampling_, seed):
        before = [(s, len(s.tokens)) for s in running]
        last.clear()
        out = speculate(running, config, sampling_, seed)
        if last:
            tree, result = last.pop()
            for b, (s, n) in enumerate(before):
                nodes = [0] + result.path[b, : len(s.tokens) - n - 1].tolist()
                for k, node in enumerate(nodes[: len(s.tokens) - n]):
                    where[(seed, s.index, n + k)] = int(tree.source[b, node]) if node else None
        return out

    monkeypatch.setattr(engine_module, "verify_tree", recording_verify)
    monkeypatch.setattr(engine, "_speculate", recording_speculate)
    return mixed_calls_scored(engine, target, sampling, calls, where, default="plain")


@pytest.mark.slow
@pytest.mark.parametrize("sampling, calls", [
    (SamplingParams(temperature=1.0, max_new_tokens=12), 24),
    (SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=12), 24),
], ids=["t1", "t0.7-k5-p0.9"])
def test_hybrid_tokens_follow_the_target_distribution(spread_vocab, monkeypatch, sampling, calls):
    """Tokens sampled at nodes only the index proposed, at nodes both sources proposed and at the
    learned draft's own are each draws from the target's sampling distribution given their prefix
    (rank_fit_p, tests/test_speculation.py), and the same tokens scored at 1.04x the temperature fail
    the fit (the test sees a bias that small)."""
    logits, tokens, found = hybrid_sampled_tokens(*spread_vocab, sampling, calls, monkeypatch)
    logprobs = sampling_logprobs(logits, sampling)
    assert not torch.isinf(logprobs.gather(-1, tokens[:, None])[:, 0]).any()
    verified = torch.tensor([w != "plain" for w in found])
    for bits in (INDEX, LEARNED, LEARNED | INDEX):
        at = torch.tensor([w == bits for w in found])
        assert int(at.sum()) >= 400, (bits, int(at.sum()))  # each kind of node was reached often
        assert rank_fit_p(logprobs[at], tokens[at]) > 1e-3, bits
    assert rank_fit_p(logprobs[verified], tokens[verified]) > 1e-3
    biased = sampling_logprobs(logits[verified], replace(sampling, temperature=1.04 * sampling.temperature))
    assert rank_fit_p(biased, tokens[verified]) < 1e-3


# -- config ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, key", [
    ("speculation.drafts=ngram", "speculation.drafts"),
    ("speculation.index_window=0", "speculation.index_window"),
    ("speculation.index_depth=0", "speculation.index_depth"),
    ("speculation.index_responses=0", "speculation.index_responses"),
    ("speculation.index_max_tokens=0", "speculation.index_max_tokens"),
    ("speculation.index_prior=-1", "speculation.index_prior"),
])
def test_bad_draft_sources_and_index_limits_name_the_key(override, key):
    from fastgrpo.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_the_config_sets_the_draft_source_and_the_index_limits():
    from fastgrpo.config import ConfigError, load_config

    c = load_config(None, ["speculation.drafts=hybrid", "speculation.index_window=12", "speculation.index_depth=5",
                           "speculation.index_responses=3", "speculation.index_max_tokens=1000",
                           "speculation.index_prior=0.5"])
    assert c.speculation.drafts == "hybrid"
    assert IndexLimits.of(c.speculation) == IndexLimits(window=12, depth=5, responses=3, max_tokens=1000, prior=0.5)
    assert load_config(None, []).speculation.drafts == "learned"
    with pytest.raises(ConfigError, match="speculation.drafts"):  # SGLang drafts with its own EAGLE
        load_config(None, ["speculation.drafts=index", "engine.backend=sglang"])


def test_build_engine_gives_the_engine_the_configured_draft_source(small_vocab, monkeypatch):
    import fastgrpo.engines.embedded.build as build
    from fastgrpo.config import load_config
    from fastgrpo.models.draft import DraftHead

    cfg, target, draft = small_vocab
    monkeypatch.setattr(build, "has_draft", lambda directory: True)
    monkeypatch.setattr(DraftHead, "load", classmethod(lambda cls, *args: draft))
    monkeypatch.setattr(build, "speculation_policy", lambda engine, c, mode: Static(SpecConfig(2, 2, 3)))
    run = load_config(None, ["speculation.policy=static", "speculation.drafts=index", "speculation.index_depth=3",
                             "model.max_context=64", "rollout.max_new_tokens=32", "rollout.max_batch=4",
                             "engine.steps=eager", "device=cpu"])
    text = type("Text", (), {"stop_ids": [VOCAB + 1]})()
    engine = build.build_engine(run, cfg, text, target.state_dict().items())
    assert engine.drafts == "index" and engine.index.limits == IndexLimits.of(run.speculation)


@pytest.mark.parametrize("steps,drafts", [("static", "hybrid"), ("eager", "hybrid"), ("static", "learned")])
def test_a_static_engine_warns_that_per_sequence_budgets_of_merged_trees_run_eagerly(small_vocab, monkeypatch, caplog,
                                                                                    steps, drafts):
    import fastgrpo.engines.embedded.build as build
    from fastgrpo.config import load_config
    from fastgrpo.models.draft import DraftHead

    cfg, target, draft = small_vocab
    monkeypatch.setattr(build, "has_draft", lambda directory: True)
    monkeypatch.setattr(DraftHead, "load", classmethod(lambda cls, *args: draft))
    monkeypatch.setattr(build, "speculation_policy", lambda engine, c, mode: Static(SpecConfig(2, 2, 3)))
    run = load_config(None, ["speculation.policy=aware_per_sequence", "model.max_context=64",
                             "rollout.max_new_tokens=32", "rollout.max_batch=4", f"engine.steps={steps}",
                             f"speculation.drafts={drafts}", "device=cpu"])
    build.build_engine(run, cfg, type("Text", (), {"stop_ids": [VOCAB + 1]})(), target.state_dict().items())
    assert ("runs its speculative steps eagerly" in caplog.text) == (steps == "static" and drafts == "hybrid")


# -- bench drafts ----------------------------------------------------------------------------------
def test_bench_drafts_pools_accepted_length_over_sequences_and_averages_replicates():
    from fastgrpo.bench.drafts import MODES, ratio_se, summarise

    r, se = ratio_se([6, 2, 0], [2, 2, 0])  # the third sequence never speculated: left out
    assert r == 2.0  # (6 + 2) / (2 + 2)
    # residuals e - r s: 2, -2; their variance 8 over n = 2, divided by the mean steps 2
    assert se == pytest.approx((8 / 2) ** 0.5 / 2)
    records = []
    for rep, (learned, hybrid) in enumerate([(2.0, 3.0), (3.0, 3.0)]):
        for mode in MODES:
            accept = {"learned": learned, "hybrid": hybrid}.get(mode, 1.5)
            records.append({"epoch": 0, "mode": mode, "seconds": 10.0 + rep, "accept_len": accept,
                            "index_share": 0.01, "host_share": 0.02, "index_accepted_share": 0.5, "identical": 1.0, "index_matched": 0.9,
                            "emitted": [int(10 * accept)], "steps": [10]})
    row = summarise(records, epochs=1)[0]
    assert row["learned_accept_len"] == 2.5 and row["learned_accept_len_se"] == pytest.approx(0.5)
    assert row["hybrid_over_learned_accepted"] == pytest.approx((2 / 1 + 2 / 2) / 2)  # accepted tokens: (a-1)/(b-1)
    assert row["hybrid_over_learned_seconds"] == 1.0 and row["off_seconds"] == 10.5


# -- calibration: what each source's nodes are worth, learned from verification ----------------------

def observe(calibration, outcomes: list[tuple[str, float, bool]]) -> None:
    """Count (class name, raw estimate, accepted) outcomes."""
    from fastgrpo.speculation.node_calibration import CLASSES

    classes, raw, accepted = zip(*outcomes)
    calibration.observe(torch.tensor([CLASSES.index(c) for c in classes]), torch.tensor(raw, dtype=torch.float64),
                      torch.tensor(accepted))


def outcomes(classes, raw, accepted) -> list[tuple[str, float, bool]]:
    """`calibration_outcomes`' tensors as (class name, raw estimate, accepted) per node."""
    from fastgrpo.speculation.node_calibration import CLASSES

    return [(CLASSES[c], r, a) for c, r, a in zip(classes.tolist(), raw.tolist(), accepted.tolist())]


def test_node_calibration_starts_at_the_raw_estimate_and_learns_each_class_apart():
    from fastgrpo.speculation.node_calibration import INDEX_LONG, LEARNED_CLASS, NodeCalibration

    cal = NodeCalibration(buckets=10, prior=4.0)
    assert cal.conditional(LEARNED_CLASS, 0.85) == pytest.approx(0.85)  # nothing seen: the raw estimate
    # the learned draft's 0.8-0.9 nodes accepted 1 time in 4 (overconfident); the index's long matches at a raw
    # 0.3-0.4, 9 times in 10 (cautious)
    observe(cal, [(LEARNED_CLASS, 0.85, i % 4 == 0) for i in range(400)])
    observe(cal, [(INDEX_LONG, 0.35, i % 10 != 0) for i in range(400)])
    assert cal.conditional(LEARNED_CLASS, 0.85) == pytest.approx((100 + 4 * 0.85) / 404)
    assert cal.conditional(INDEX_LONG, 0.35) == pytest.approx((360 + 4 * 0.35) / 404)
    assert cal.conditional(LEARNED_CLASS, 0.35) == pytest.approx(0.35)  # another bucket: still the raw estimate
    assert cal.summary() == {LEARNED_CLASS: pytest.approx(0.25), INDEX_LONG: pytest.approx(0.9)}
    with pytest.raises(ValueError, match="buckets"):
        NodeCalibration(buckets=0)


def test_a_calibrated_merge_spends_the_budget_on_the_source_verification_found_better():
    """Raw estimates favour the learned branch (0.9 against the index's 0.35 at every level); once
    verification has found the learned draft's 0.9s accepted a quarter of the time and the index's long
    matches 90%, the calibrated merge keeps the index's branch instead (path probabilities by hand:
    learned 0.25, 0.0625; index 0.9, 0.81, 0.729)."""
    from fastgrpo.speculation.node_calibration import INDEX_LONG, LEARNED_CLASS, NodeCalibration

    learned = learned_tree([(3,), (3, 4)], [math.log(0.9), 2 * math.log(0.9)], root=7)
    index = candidates([(5,), (5, 6), (5, 6, 8)], [math.log(0.35), 2 * math.log(0.35), 3 * math.log(0.35)])
    index.match_len = 6
    raw = hybrid_tree(learned, CandidateRows.of([index]), torch.tensor([7]), num_verify=4)
    assert node_paths(raw)[1:] == [(3,), (5,), (3, 4)]
    cal = NodeCalibration(prior=1e-6)
    observe(cal, [(LEARNED_CLASS, 0.9, i % 4 == 0) for i in range(100)] +
            [(INDEX_LONG, 0.35, i % 10 != 0) for i in range(100)])
    tree = hybrid_tree(learned, CandidateRows.of([index]), torch.tensor([7]), num_verify=4, calibration=cal)
    assert node_paths(tree)[1:] == [(5,), (5, 6), (5, 6, 8)]
    assert [round(math.exp(float(s)), 4) for s in tree.score[0, 1:]] == [0.9, 0.81, 0.729]
    assert tree.raw[0, 1:].tolist() == pytest.approx([0.35, 0.35, 0.35]) and tree.match.tolist() == [6]


def test_calibration_counts_the_nodes_whose_parent_was_reached():
    """Tree: root -> a(1) -> b(2), root -> c(3); b's walk accepted a then stopped: a accepted, b rejected
    (its parent reached), c rejected (its parent, the root, reached)."""
    from fastgrpo.engines.embedded.tree import calibration_outcomes
    from fastgrpo.speculation.node_calibration import BOTH, INDEX_SHORT, LEARNED_CLASS

    tree = learned_tree([(3,), (3, 4), (5,)], [-0.1, -0.2, -1.0], root=7)
    tree = replace(tree, source=torch.tensor([[0, LEARNED, LEARNED | INDEX, INDEX]], dtype=torch.int8),
                   raw=torch.tensor([[0.0, 0.9, 0.8, 0.3]]), match=torch.tensor([1]))
    got = outcomes(*calibration_outcomes(tree, torch.tensor([[1, 0]]), torch.tensor([1])))
    assert [(c, round(r, 3), a) for c, r, a in got] == [(LEARNED_CLASS, 0.9, True), (BOTH, 0.8, False),
                                                        (INDEX_SHORT, 0.3, False)]
    # nothing accepted: only the root's children were reached
    none = calibration_outcomes(tree, torch.tensor([[0, 0]]), torch.tensor([0]))
    assert [(c, a) for c, _, a in outcomes(*none)] == [(LEARNED_CLASS, False), (INDEX_SHORT, False)]


def test_a_resumed_run_drafts_from_the_index_its_checkpoint_kept(tmp_path, tiny_policy, tiny_draft):
    """`speculation.drafts=hybrid`: each checkpoint holds the engine's suffix index (its prompts' finished
    responses); a resumed run's engine starts with that index, not an empty one."""
    import json

    from fastgrpo.run_setup import setup_run
    from fastgrpo.train import train
    from tests.conftest import tiny_config

    cfg = tiny_config(tmp_path, tiny_policy, **{"speculation.drafts": "hybrid", "speculation.policy": "static",
                                                "draft.path": str(tiny_draft),
                                                "grpo.steps": 2, "checkpoint.every": 1, "draft.online": "off",
                                                "tracking.enabled": "false"})
    result = train(cfg)
    saved = json.loads((result.checkpoint / "suffix_index_rank0.json").read_text())
    histories = {tuple(p["key"]): p["history"] for p in saved["prompts"]}
    # 2 steps x 4 prompts, each prompt's group of 4 finished responses kept (and the evaluated prompts' answers:
    # evaluation runs on the same engine)
    assert sum(len(h) == 4 for h in histories.values()) >= 8
    run = setup_run(cfg, resume=True)
    assert run.step == 2 and list(run.engine.index.prompts) == list(histories)
    assert all(run.engine.index.history(k) == h for k, h in histories.items())


def test_the_simulated_hybrid_step_pays_its_host_work_per_step_and_running_row():
    """bench drafts' SIMULATED part: a hybrid step costs the roofline's step plus its host work, fitted to
    the measured steps as a cost per step and per running row; plain steps cost the same as without; the
    replicates' sweeps pool into one fit."""
    from fastgrpo.bench.drafts_simulated import HostModel, HostWork, merge_sweeps
    from fastgrpo.speculation.roofline import ACCELERATORS, MODELS, Roofline

    costs = Roofline(ACCELERATORS["h100"], MODELS["llama3-8b"])
    priced = HostWork(costs, HostModel(1e-3, 1e-4))
    c = SpecConfig(4, 4, 12)
    assert priced.spec_step(c, 32, 5, 1000, 32000) == pytest.approx(costs.spec_step(c, 32, 5, 1000, 32000) + 1e-3 + 32e-4)
    assert priced.decode_step(32, 1000, 32000) == costs.decode_step(32, 1000, 32000) and priced.padded == costs.padded
    # steps on the line 1 ms + 100 us a row, in two replicates, of which 40 us a row hidden behind the draft
    sweeps = [{"learned": {"accepted": {c: [1, 2]}, "host_steps": []},
               "hybrid": {"accepted": {c: [3]}, "host_steps": [(10, 2e-3, 4e-4), (20, 3e-3, 8e-4)]}},
              {"learned": {"accepted": {c: [4]}, "host_steps": []},
               "hybrid": {"accepted": {c: [5, 6]}, "host_steps": [(30, 4e-3, 1.2e-3), (40, 5e-3, 1.6e-3)]}}]
    pooled = merge_sweeps(sweeps)
    assert pooled["learned"]["accepted"][c] == [1, 2, 4] and pooled["hybrid"]["accepted"][c] == [3, 5, 6]
    assert pooled["hybrid"]["host"].per_step == pytest.approx(1e-3)
    assert pooled["hybrid"]["host"].per_row == pytest.approx(1e-4)
    assert pooled["hybrid"]["hidden"] == HostModel(pytest.approx(0.0, abs=1e-12), pytest.approx(4e-5))
    assert pooled["hybrid"]["waited"] == HostModel(pytest.approx(1e-3), pytest.approx(6e-5))
    assert pooled["hybrid"]["hidden_share"] == pytest.approx(4e-3 / 14e-3)
    assert pooled["learned"]["host"] == HostModel(0.0, 0.0) and pooled["hybrid"]["host_steps"] == 4


def test_a_static_engines_schedule_pays_the_lookups_only_where_they_outlast_the_drafts_forwards():
    """HostWork with a hidden part (a static engine's schedule): the waited part on every speculative step; the hidden part beyond the draft's forwards
    (the roofline's `drafting`), from both sides of it."""
    from fastgrpo.bench.drafts_simulated import HostModel, HostWork
    from fastgrpo.speculation.roofline import ACCELERATORS, MODELS, Roofline

    costs = Roofline(ACCELERATORS["h100"], MODELS["llama3-8b"])
    c, shape = SpecConfig(4, 4, 12), (32, 5, 1000, 32000)
    drafting, step = costs.drafting(c, *shape), costs.spec_step(c, *shape)
    assert 0 < drafting < step
    short = HostWork(costs, HostModel(1e-3, 0.0), HostModel(0.5 * drafting, 0.0))  # hidden entirely
    assert short.spec_step(c, *shape) == pytest.approx(step + 1e-3)
    long = HostWork(costs, HostModel(1e-3, 0.0), HostModel(drafting + 2e-3, 0.0))  # 2 ms outlast it
    assert long.spec_step(c, *shape) == pytest.approx(step + 3e-3)
    assert long.decode_step(32, 1000, 32000) == costs.decode_step(32, 1000, 32000)  # plain steps pay nothing


def test_the_host_fit_never_prices_a_term_below_zero():
    from fastgrpo.bench.drafts_simulated import HostModel

    # falling with rows (noise): the mean as a fixed cost
    assert HostModel.fit([(10, 3e-3), (20, 1e-3)]) == HostModel(pytest.approx(2e-3), 0.0)
    # a line through a negative intercept (-1 ms + 200 us a row): refitted through the origin,
    # sum(r * h) / sum(r^2) = (10 * 1e-3 + 20 * 3e-3) / 500 = 140 us a row
    fit = HostModel.fit([(10, 1e-3), (20, 3e-3)])
    assert fit.per_step == 0.0 and fit.per_row == pytest.approx(1.4e-4)
    assert HostModel.fit([(8, 4e-3)]) == HostModel(0.0, pytest.approx(5e-4))  # one step: per row


def test_the_host_budget_is_where_the_simulated_time_crosses_the_target():
    """bench drafts' host budget: the bisection finds the share of the measured host work at which a time
    growing with it crosses the target (10 s + 4 s at the whole of it, against 11 s: a quarter), says
    `high` when the target is met there, and None when even no host work misses it."""
    from fastgrpo.bench.drafts_simulated import host_budget

    seconds_at = lambda share: 10.0 + 4.0 * share  # noqa: E731
    found = host_budget(seconds_at, 11.0, high=1.0, steps=10)
    assert 0.25 - 1 / 2**10 <= found <= 0.25 * (1 + 1e-9)
    assert host_budget(seconds_at, 15.0, high=1.0) == 1.0
    assert host_budget(seconds_at, 9.0, high=1.0) is None


def test_the_simulated_table_says_where_no_share_of_the_host_work_is_affordable():
    from fastgrpo.bench.drafts_simulated import markdown

    seconds = {m: 10.0 for m in ("off", "aware", "aware_per_sequence", "static_best")} | {"static_best_shape": "d3k4n8"}
    sim = {"seconds": {c: seconds for c in ("learned", "hybrid", "hybrid_no_host")}, "case": "H100", "repetitions": 1,
           "longtail": {"mean": 3000, "sigma": 1.0, "max_new": 16384, "prompts": 64, "group": 8}, "max_running": 128,
           "profiles": {"learned": {"measured_samples": {"a": 1}}}, "host": {"per_step_s": 1e-3, "per_row_s": 1e-4, "steps": 9},
           "host_budget_share": {"1.00": 0.0, "1.15": None}}
    assert markdown(sim)[-1].endswith("1.00x at < 0.03 of it, 1.15x at - (not even without host work).")
    sim["host_budget_share"] = {"1.00": 0.5, "1.15": 0.25}
    assert markdown(sim)[-1].endswith("1.00x at <= 0.50 of it (0.50 ms a step + 50 us a row), "
                                      "1.15x at <= 0.25 of it (0.25 ms a step + 25 us a row).")


def test_the_simulated_table_shows_the_static_schedule_where_it_was_priced():
    from fastgrpo.bench.drafts_simulated import markdown

    seconds = {m: 10.0 for m in ("off", "aware", "aware_per_sequence", "static_best")} | {"static_best_shape": "d3k4n8"}
    faster = seconds | {"aware": 8.0}
    sim = {"seconds": {"learned": seconds, "hybrid": seconds, "hybrid_static": faster, "hybrid_no_host": seconds},
           "case": "H100", "repetitions": 1, "max_running": 128, "host_budget_share": {"1.00": 1.0},
           "longtail": {"mean": 3000, "sigma": 1.0, "max_new": 16384, "prompts": 64, "group": 8},
           "profiles": {"learned": {"measured_samples": {"a": 1}}},
           "host": {"per_step_s": 1e-3, "per_row_s": 1e-4, "steps": 9, "hidden_share": 0.25,
                    "waited": {"per_step": 1e-3, "per_row": 5e-5}, "hidden": {"per_step": 0.0, "per_row": 5e-5}}}
    lines = markdown(sim)
    assert "| `aware` | 10.0 | 10.0 | 1.00x | 8.0 | 1.25x | 10.0 | 1.00x |" in lines
    assert any("25% while a step function computed" in line and "1.00 ms a step + 50 us a row" in line
               for line in lines)
