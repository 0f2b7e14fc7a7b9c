"""The speculation policies as units, on synthetic step costs (no engine): `aware` choosing the shape of
highest predicted goodput, its margin, online acceptance and per-bucket corrections, probes and their
budget; the per-sequence verify budget; the cost model's fitting and pricing."""

import itertools

import numpy as np
import pytest
import torch

from fastgrpo.speculation.cost_model import CostModel
from fastgrpo.speculation.per_sequence import AwarePerSequence
from fastgrpo.speculation.policy import Aware, candidate_configs, context_level
from fastgrpo.speculation.spec import SpecConfig


def plain_once(aware, *running):
    """One plain step at each concurrency, taking exactly its calibrated time (a bucket's first step is
    plain, and one that matches the calibration leaves every prediction as calibrated)."""
    for r in running:
        assert aware.choose(r) is None
        aware.observe(None, r, r, aware.costs.target(r))


def synthetic_costs():
    # memory-bound (flat) up to 64 tokens per forward, then compute-bound (linear); the draft is cheap
    target = {t: 0.010 * max(1.0, t / 64) for t in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)}
    draft = {t: 0.001 * max(1.0, t / 64) for t in target}
    return CostModel(target, draft)


def test_aware_chooses_the_shape_of_highest_predicted_goodput_or_plain_decoding():
    """Against a search written here: at each concurrency the best candidate by goodput, taken only if
    it beats plain decoding by the margin."""
    aware = Aware(synthetic_costs())
    plain_once(aware, 1, 2, 4, 8, 16, 32, 64, 128, 256)
    choices = {}
    for running in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        best = max(aware.candidates, key=lambda c: aware.goodput(c, running))
        expected = best if aware.goodput(best, running) > aware.goodput(None, running) * (1 + aware.margin) else None
        choices[running] = aware.choose(running)
        assert choices[running] == expected, running
    assert choices[1] is not None and choices[1].depth >= 3  # the tail: speculate deep
    assert choices[256] is None  # saturated: plain decoding
    assert len({c for c in choices.values()}) >= 3  # the shape follows the concurrency


def test_aware_speculates_only_for_a_gain_above_its_margin():
    chain = SpecConfig(1, 1, 2)
    gain = Aware(synthetic_costs(), [chain]).goodput(chain, 1) / Aware(synthetic_costs(), [chain]).goodput(None, 1)
    assert gain > 1.1
    for margin, choice in ((gain - 1 - 0.01, chain), (gain - 1 + 0.01, None)):
        aware = Aware(synthetic_costs(), [chain], margin=margin)
        plain_once(aware, 1)
        assert aware.choose(1) == choice


def test_aware_learns_acceptance_online():
    aware = Aware(synthetic_costs())
    deep = SpecConfig(6, 1, 7)
    before = aware.acceptance.expected(deep)
    for _ in range(50):  # a draft that is always right
        aware.observe(deep, 1, 7, 0.012, accepted=[6])
    assert aware.acceptance.expected(deep) > before + 2
    shallow = SpecConfig(2, 1, 3)
    for _ in range(50):  # and one that never is
        aware.observe(shallow, 1, 1, 0.012, accepted=[0])
    assert aware.acceptance.expected(shallow) < 1.3


def test_evidence_from_a_wide_tree_carries_to_every_width():
    """Steps of a width-8 tree (d3k8n25) whose levels a draft passes as the simulator's law says, with a
    first candidate right half the time: each level passed with chance 1 - 0.5 * 8^-0.7 = 0.884. The
    model learns the first candidate's 0.5, not the tree's 0.884, so it predicts a chain's steps (whose
    levels pass half the time) and the tree's own alike, within 3%. Counting the tree's pass rate as
    alpha, as before, the chain was promised 3.4 tokens a step where it emits 1.9."""
    import random

    model = Aware(synthetic_costs(), acceptance_prior=0.9).acceptance  # a prior far from the truth
    wide, chain, rng = SpecConfig(3, 8, 25), SpecConfig(3, 1, 4), random.Random(0)
    level = 1 - 0.5 * 8**-0.7
    for _ in range(1500):  # 24,000 rows: alpha's estimate within 0.01 (a standard error)
        accepted = []
        for _ in range(16):
            a = 0
            while a < 3 and rng.random() < level:
                a += 1
            accepted.append(a)
        model.observe(wide, accepted)
    assert [model.alpha(d) for d in (1, 2, 3)] == pytest.approx([0.5] * 3, abs=0.04)
    assert model.expected(chain) == pytest.approx(1 + 0.5 + 0.25 + 0.125, rel=0.03)
    assert model.prior(wide) == pytest.approx(1 + level + level**2 + level**3, rel=0.03)


def test_a_step_without_its_time_teaches_acceptance_and_nothing_of_cost():
    """A step that captured a CUDA graph reaches `observe` with no seconds: acceptance learns its tokens,
    while corrections, step fits and probes stay as they were (its time, an eager run and a recording,
    would price every later step of its shape far too high)."""
    aware = Aware(synthetic_costs())
    plain_once(aware, 4)
    tree = aware.choose(4)
    assert tree is not None
    aware.observe(tree, 4, 12, aware.predicted_seconds(tree, 4), accepted=[2] * 4)
    state = (dict(aware.correction), {b: dict(f.shapes) for b, f in aware.fits.items()}, dict(aware._since))
    count = aware.acceptance.count[tree]
    for _ in range(3):
        aware.observe(tree, 4, 16, None, accepted=[3] * 4)
        aware.observe(None, 4, 4, None)
    assert (dict(aware.correction), {b: dict(f.shapes) for b, f in aware.fits.items()}, dict(aware._since)) == state
    assert aware.acceptance.count[tree] == count + 12


def test_aware_keeps_its_tree_until_another_is_clearly_faster():
    """A bucket keeps the tree it speculates with while another is predicted faster by less than
    `switch_margin` (1%): near the best, trees differ by less than the prices' noise, and on a GPU each
    tree new to a bucket costs a graph capture. A tree predicted 5% faster is taken."""
    import numpy as np

    first, second = SpecConfig(2, 2, 4), SpecConfig(3, 2, 6)
    aware = Aware(synthetic_costs(), candidates=[first, second])
    rates = {"now": np.array([1e9, 0.99e9])}
    aware._rates = lambda running: rates["now"]  # the search's predicted goodputs, set here
    plain_once(aware, 4)

    def speculate(steps):
        chosen = []
        for _ in range(steps):
            c = aware.choose(4)
            chosen.append(c)
            aware.observe(c, 4, 8, 0.01, accepted=[1] * 4)
        return chosen[-1]

    assert speculate(20) == first
    rates["now"] = np.array([1e9, 1.005e9])  # the other 0.5% ahead: kept
    assert speculate(40) == first
    rates["now"] = np.array([1e9, 1.05e9])  # 5% ahead: taken
    assert speculate(40) == second


def test_aware_corrects_its_cost_model_per_concurrency():
    """Speculation measured slower than predicted at 16 sequences turns it off there, and only there."""
    aware = Aware(synthetic_costs())
    plain_once(aware, 16, 1)
    spec16, spec1 = aware.choose(16), aware.choose(1)
    assert spec16 is not None and spec1 is not None
    before16, before1 = aware.predicted_seconds(spec16, 16), aware.predicted_seconds(spec1, 1)
    for _ in range(48):
        c = aware.choose(16)
        if c is None:
            aware.observe(None, 16, 16, aware.predicted_seconds(None, 16))
        else:  # each speculative step takes three times its prediction
            aware.observe(c, 16, 16, 3 * aware.predicted_seconds(c, 16), accepted=[0] * 16)
    assert aware.choose(16) is None
    assert aware.choose(1) is not None  # what was learned at 16 sequences leaves 1 sequence alone
    # the slow steps priced at 16 sequences, not at 1
    assert aware.predicted_seconds(spec1, 1) == before1 and aware.predicted_seconds(spec16, 16) > 2 * before16


def test_aware_probes_plain_decoding_when_its_calibration_overrates_it():
    """A calibration that makes plain decoding look slow (here: 4x too slow at 16 sequences) would have
    `aware` speculate; its first step there is plain, which measures that, so it decodes plainly and
    only probes speculation now and then."""
    costs = synthetic_costs()
    aware = Aware(costs, probe_every=32)
    real_off = costs.target(16) / 4
    assert max(aware.goodput(c, 16) for c in aware.candidates) > aware.goodput(None, 16) * (1 + aware.margin)  # the calibration
    chosen = []
    for _ in range(200):
        c = aware.choose(16)
        chosen.append(c)
        if c is None:
            aware.observe(None, 16, 16, real_off)
        else:  # speculation costs what the calibration says and accepts one draft token per step
            raw = aware._calibrated_seconds(c, 16)
            aware.observe(c, 16, 32, raw, accepted=[1] * 16)
    assert aware.choose(16) is None
    assert sum(c is not None for c in chosen[-100:]) <= 100 // 32 + 1  # probes only


def test_aware_recovers_from_a_calibration_taken_while_the_machine_was_busy():
    """A calibration sweep taken while another process held a core times scheduler stalls, not
    forwards (seen here at two threads: ~250 ms per forward for 1 token and for 16 alike, so
    speculation looked free and `aware` lost 25% at 4 and 16 sequences). The online correction must
    undo an error of any size: once plain decoding is probed, `aware` decodes plainly where, on the
    real costs, speculation does not pay."""
    sizes = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    real = CostModel({t: 0.003 + 0.0006 * t for t in sizes}, {t: 0.0005 + 0.0001 * t for t in sizes})
    stalled = CostModel({t: s + 0.25 for t, s in real.target_s.items()}, {t: s + 0.05 for t, s in real.draft_s.items()})
    truth, aware = Aware(real), Aware(stalled, probe_every=32)
    plain_once(truth, 16)
    assert truth.choose(16) is None  # on the real costs speculation does not pay at 16 sequences
    assert max(aware.goodput(c, 16) for c in aware.candidates) > aware.goodput(None, 16) * (1 + aware.margin)  # stalled: it pays
    chosen = []
    for _ in range(300):
        c = aware.choose(16)
        chosen.append(c)
        # each step takes its real time; a draft that gets one token right per sequence and step
        seconds = truth.predicted_seconds(c, 16)
        aware.observe(c, 16, 16 if c is None else 32, seconds, accepted=None if c is None else [1] * 16)
    assert aware.choose(16) is None
    assert sum(c is not None for c in chosen[-100:]) <= 100 // 32 + 1  # probes only


def test_a_grpo_tail_searches_once_per_level_of_running_sequences_and_prices_each_count():
    """As a batch's rows finish one by one, the running count meets every value below the batch: the
    trees are searched once per quarter octave of it (40 to 35 running: one level; 34 and 33: the next),
    and the tree found is priced at each count (its goodput and step time at 37 rows, not at 40)."""
    aware = Aware(synthetic_costs())
    plain_once(aware, 64)
    searches = []
    rates = aware._rates
    aware._rates = lambda running: searches.append(running) or rates(running)
    for running in range(40, 32, -1):
        aware.choose(running, 500)
    assert searches == [40, 34]
    tree, rate, seconds, _ = aware._tree(37)
    assert tree is not None and tree == aware._tree(40)[0]
    assert rate == pytest.approx(aware.goodput(tree, 37)) and seconds == pytest.approx(aware.predicted_seconds(tree, 37))
    assert rate != pytest.approx(aware._tree(40)[1])


def test_between_searches_a_step_reads_no_curve_for_prices_it_already_took():
    """A step's prices (its calibrated forwards: plain's and the chosen tree's, each a few curve lookups) are
    asked two to four times a step; between two searches they are taken from the curves once per shape,
    running count and context level, and taken again after the next search (acceptance has moved)."""
    costs = synthetic_costs()
    aware = Aware(costs, acceptance_prior=0.8, probe_every=10_000)
    lookups = []
    at_context = costs.at_context
    costs.at_context = lambda *a: lookups.append(a) or at_context(*a)
    plain_once(aware, 4)
    c = aware.choose(4, 100)
    assert c is not None  # (speculation pays at 4 rows on these costs)
    aware.observe(c, 4, 8, aware._calibrated_seconds(c, 4), accepted=[1] * 4)  # after plain: the catch-up, unpriced
    c = aware.choose(4, 100)
    aware.observe(c, 4, 8, aware._calibrated_seconds(c, 4), accepted=[1] * 4)  # a kind's first: searched again

    def step(c):  # every drafted token accepted: no shape disappoints the prior, so the choice settles
        aware.observe(c, 4, 4 * (c.depth + 1), 1.1 * aware._calibrated_seconds(c, 4), accepted=[c.depth] * 4)
        return aware.choose(4, 100)

    c = aware.choose(4, 100)
    for _ in range(8):  # each shape's first measurement (a contrast's, `Aware._contrast`) searches again
        if c in aware.fits[4].shapes:
            break
        c = step(c)
    assert c in aware.fits[4].shapes
    for n in range(Aware.SEARCH_EVERY - 1):
        lookups.clear()
        c = step(c)
        assert lookups == [], n
    lookups.clear()
    c = step(c)  # the searches were forgotten after SEARCH_EVERY speculative steps
    assert lookups


def test_aware_does_not_search_its_trees_again_at_every_plain_step():
    """A search over the candidate trees costs ~0.5 ms, several percent of a plain step: while `aware`
    decodes plainly (speculation not yet measured in the bucket), the best tree found once is kept, per
    level of context (one search per quarter octave of context, not one per step as the rows grow)."""
    sizes = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # a CPU-like curve: at 16 sequences plain decoding wins
    aware = Aware(CostModel({t: 0.003 + 0.0006 * t for t in sizes}, {t: 0.0005 + 0.0001 * t for t in sizes}))
    plain_once(aware, 16)
    assert aware.choose(16, 100) is None
    kept = aware._trees[(16, aware.context, None)]  # (None: the rows' lengths not known)
    for context in range(100, 140):  # 100 to 139 cached tokens: two levels (2^6.75 ~ 108, 2^7 = 128)
        assert aware.choose(16, context) is None
        aware.observe(None, 16, 16, aware.costs.target(16) * 1.1)
    assert aware._trees[(16, context_level(100), None)] is kept
    assert sorted(level for running, level, _ in aware._trees if running == 16) == [2**6.75, 2**7]


def test_aware_probes_less_often_while_probes_confirm_its_choice():
    """Each probe that confirms plain decoding doubles the wait before the next (up to a cap); when
    speculation turns out faster, a probe overturns the choice and aware speculates from then on."""
    costs = synthetic_costs()
    # probe_budget=1: the back-off alone (the probes' share of time is bounded by the next test)
    aware = Aware(costs, probe_every=16, max_probe_every=128, probe_budget=1.0)
    real_off = costs.target(16) / 4  # plain decoding is much faster than calibrated
    spec_factor = 1.0  # speculation costs what the calibration says...

    def step() -> SpecConfig | None:
        c = aware.choose(16)
        if c is None:
            aware.observe(None, 16, 16, real_off)
        else:  # accepting one draft token per sequence per step
            raw = aware._calibrated_seconds(c, 16)
            aware.observe(c, 16, 32, raw * spec_factor, accepted=[1] * 16)
        return c

    chosen = [step() for _ in range(1200)]
    switched = chosen.index(None)  # speculates until a probe of plain decoding measures it
    spec = [i for i, c in enumerate(chosen) if c is not None and i > switched]
    probes = [i for i in spec if i - 1 not in spec]
    assert all(i + 1 in spec and i + 2 not in spec for i in probes)  # a probe: the catch-up, then one measured
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[-4:] == [130] * 4  # the interval doubled to its cap (128 plain steps, then the probe's two)
    assert gaps[0] < gaps[1] < gaps[2]
    spec_factor = 0.05  # ...until it becomes 20x cheaper: the next probe must overturn the choice
    chosen = [step() for _ in range(500)]
    assert sum(c is not None for c in chosen[-100:]) >= 90


def test_aware_spends_at_most_its_probe_budget_probing_while_plain_decoding_wins():
    """At high concurrency a probe (a speculative step) costs several plain steps: aware probes rarely
    enough that the probes' extra time stays within `probe_budget` of the whole, by the costs it sees."""
    costs = synthetic_costs()
    for budget in (0.01, 0.05):
        aware = Aware(costs, probe_budget=budget)
        spent = {"plain": 0.0, "probe": 0.0}
        for _ in range(20_000):
            c = aware.choose(256)
            seconds = aware._calibrated_seconds(c, 256)
            spent["probe" if c else "plain"] += seconds
            aware.observe(c, 256, 256 if c is None else 256 * 2, seconds, accepted=None if c is None else [1] * 256)
        plain_step = costs.target(256)
        best = max(aware.candidates, key=lambda c: aware.goodput(c, 256))  # the tree a probe tries
        probes_extra = spent["probe"] - (spent["probe"] / aware.predicted_seconds(best, 256)) * plain_step
        assert spent["probe"] > 0  # it still probes
        assert probes_extra / (spent["plain"] + spent["probe"]) <= budget * 1.05


def linear_costs(per_token: float = 0.002) -> CostModel:
    """A target whose forward costs 10 ms plus `per_token` per token (a CPU: verifying is not free),
    and a draft of 1 ms per forward."""
    grid = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    return CostModel({t: 0.010 + per_token * t for t in grid}, {t: 0.001 for t in grid})


def test_per_sequence_budget_verifies_the_set_of_nodes_of_highest_predicted_goodput():
    """Against every ancestor-closed choice of nodes in three rows' trees (two children of the root,
    one grandchild under the first), scored by the goodput the policy maximises: expected tokens
    (B + the verified nodes' draft probabilities) over draft + verify seconds. The choice is the best
    of all 216, so never below verifying every node (aware's uniform tree) or none."""
    config = SpecConfig(2, 2, 4)  # drafted in 2 levels: 2 ms of draft
    depth = torch.tensor([[1, 1, 2]] * 3)
    closed = [(), (0,), (1,), (0, 1), (0, 2), (0, 1, 2)]  # node 2's parent is node 0
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        first = torch.rand(3, 2, generator=g)
        p = torch.stack([first[:, 0], first[:, 1], first[:, 0] * torch.rand(3, generator=g)], 1)
        policy = AwarePerSequence(linear_costs(per_token=float(torch.rand(1, generator=g)) * 0.004), margin=0.0)
        chosen = policy.select(p.log(), depth, config, 3)

        def goodput(nodes) -> float:
            return (3 + sum(float(p[b, j]) for b, row in enumerate(nodes) for j in row)) / (
                0.002 + policy.costs.target(3 + sum(map(len, nodes))))

        best = max(goodput(combo) for combo in itertools.product(closed, repeat=3))
        got = goodput([tuple(j for j in range(3) if chosen[b, j]) for b in range(3)])
        assert got == pytest.approx(best, rel=1e-9), trial
        assert all(not chosen[b, 2] or chosen[b, 0] for b in range(3))  # a kept grandchild keeps its parent


def test_per_sequence_budget_cuts_a_tree_only_for_a_clear_predicted_gain():
    """Near a tie (cutting the least likely node gains less than the 5% margin) the whole tree is
    verified, as aware would; with a large predicted gain the unlikely nodes are cut."""
    config, depth = SpecConfig(2, 1, 3), torch.tensor([[1, 2]])
    scores = torch.tensor([[0.9, 0.05]]).log()
    tie = AwarePerSequence(linear_costs(per_token=0.0005))  # a node costs 5% of a step: cutting gains ~1%
    assert tie.select(scores, depth, config, 1).all()
    assert not AwarePerSequence(linear_costs(per_token=0.0005), margin=0.0).select(scores, depth, config, 1).all()
    dear = AwarePerSequence(linear_costs(per_token=0.005))  # half a step per node: cut the 5% one
    assert dear.select(scores, depth, config, 1).tolist() == [[True, False]]


def test_per_sequence_budget_goes_to_the_rows_the_draft_is_sure_of_and_learns_its_calibration():
    """Rows whose drafts are confident get their trees verified, the others none; a draft that is
    over-confident (its nodes are never accepted) is believed less and less, until nothing is verified."""
    config = SpecConfig(3, 1, 4)  # chains of 3
    depth = torch.tensor([[1, 2, 3]] * 4)
    sure, unsure = torch.tensor([0.95, 0.9, 0.85]).log(), torch.tensor([0.2, 0.05, 0.01]).log()
    scores = torch.stack([sure, unsure, sure, unsure])
    policy = AwarePerSequence(linear_costs(per_token=0.003))
    chosen = policy.select(scores, depth, config, 4)
    assert chosen[[0, 2]].all() and not chosen[[1, 3]].any()
    verified = []
    for _ in range(60):
        chosen = policy.select(scores, depth, config, 4)
        verified.append(int(chosen.sum()))
        policy.observe(config, 4, 4, 0.02, accepted=[0] * 4)
    assert verified[0] == 6 and verified[-1] == 0 and policy.calibration < 0.2


def test_a_cut_tree_teaches_acceptance_only_the_levels_it_verified():
    """Rows of a chain of 3 whose budget verified only its first level, and accepted it: the second
    and third levels were never tried, so the chance of accepting them is not lowered (counted as
    rejections, one-sequence runs of cut trees made every deeper tree look worse and turned the
    policy off at four sequences); a row that verified all three and rejected the second lowers it."""
    config, depth = SpecConfig(3, 1, 4), torch.tensor([[1, 2, 3]] * 4)
    policy = AwarePerSequence(linear_costs(per_token=0.003))
    before = [policy.acceptance.alpha(d) for d in (1, 2, 3)]
    sure, unsure = torch.tensor([0.95, 0.02, 0.01]).log(), torch.tensor([0.2, 0.05, 0.01]).log()
    for _ in range(20):
        chosen = policy.select(torch.stack([sure, unsure, sure, unsure]), depth, config, 4)
        assert chosen.sum(1).tolist() == [1, 0, 1, 0]  # the sure rows' first level only
        policy.observe(config, 4, 6, 0.02, accepted=[1, 0, 1, 0])
    assert policy.acceptance.alpha(1) > before[0]  # 40 tries of level one, all accepted
    # never tried: the pooled alpha of the levels tried (40 passes of 40, with the prior's 8 rows at 0.6)
    assert [policy.acceptance.alpha(d) for d in (2, 3)] == pytest.approx([(40 + 8 * 0.6) / 48] * 2)
    policy.select(torch.stack([sure] * 4), depth, config, 4)  # (a fresh select: every row verifies level 1)
    policy.observe(config, 4, 4, 0.02, accepted=[0, 0, 0, 0])
    whole = AwarePerSequence(linear_costs(per_token=0.0))  # verifying every level of every row
    whole.select(torch.stack([sure] * 4), depth, config, 4)
    whole.observe(config, 4, 8, 0.02, accepted=[1, 1, 1, 1])  # each rejects level two
    assert whole.acceptance.alpha(2) < before[1]


def test_cost_model_ignores_a_noisy_calibration_point():
    """A sample slowed by a busy machine (64 tokens measured slower than 128) must not make plain
    decoding at 64 sequences look expensive."""
    target = {1: 0.007, 16: 0.018, 64: 0.093, 128: 0.066, 256: 0.104}
    costs = CostModel(target, {t: 0.001 for t in target})
    assert costs.target(64) == 0.066 and costs.target(128) == 0.066 and costs.target(16) == 0.018
    assert all(costs.target(a) <= costs.target(b) for a, b in zip(range(1, 300), range(2, 301)))


def test_one_size_is_priced_as_the_curve_prices_many():
    """`aware` asks one size at a time (plain Python), the per-sequence budget many at once
    (numpy): the same curve below, between and beyond its points, at fractional sizes."""
    costs = CostModel({1: 1e-3, 4: 1.5e-3, 64: 8e-3, 512: 9e-2}, {1: 2e-4, 64: 1e-3})
    sizes = [0.5, 1, 2.7, 4, 33.3, 64, 100.25, 512, 900.5]
    many = costs.target_many(np.array(sizes)).tolist()
    assert [costs.target(t) for t in sizes] == pytest.approx(many, rel=1e-12)
    assert costs.target(0.5) == 1e-3 and costs.target(900.5) == pytest.approx(9e-2 + (9e-2 - 8e-3) * 388.5 / 448)
    assert costs.draft(32.5) == pytest.approx(2e-4 + (1e-3 - 2e-4) * 31.5 / 63)


def test_a_forward_of_fewer_rows_is_priced_below_the_sweeps_point_of_as_many_tokens():
    """The sweep's 16 tokens are 16 rows of one; a tree's 16 tokens in one row read one row's cache."""
    grid = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    costs = CostModel({t: 0.002 + 0.0002 * t for t in grid}, {t: 0.001 for t in grid}, target_row_s=0.0001)
    assert costs.target(16) == pytest.approx(0.0052)  # the sweep's shape, as before
    assert costs.target(16, rows=1) == pytest.approx(0.0052 - 15 * 0.0001)
    assert costs.target(256, rows=16) == pytest.approx(0.002 + 0.0002 * 256 - 48 * 0.0001)
    assert costs.target(2, rows=1) >= costs.target(1)  # never below the cheapest forward
    many = costs.target_many(np.array([1, 4, 16, 100]), rows=1)
    assert many.tolist() == pytest.approx([costs.target(t, rows=1) for t in (1, 4, 16, 100)])
    assert CostModel.from_json(costs.to_json()).target(16, rows=1) == pytest.approx(costs.target(16, rows=1))


def test_the_aware_overhead_tool_reports_each_level():
    """tools/aware_overhead.py (aware's host time against the SIMULATED step it decides on) at a small size:
    every level reported, with positive times and a share that is their ratio."""
    from tools.aware_overhead import main

    result = main(["--running", "1,64", "--tokens", "256"])
    assert [r["running"] for r in result["levels"]] == [1, 64] and result["gpu"] == "H100 SXM"
    for r in result["levels"]:
        assert r["choose_us"] > 0 and r["observe_us"] > 0 and r["ahead_us"] > 0 and r["step_ms"] > 0
        assert 0 <= r["exposed_us"] <= r["ahead_us"]  # what of `ahead` the SIMULATED step does not hide
        assert r["share_of_step"] == pytest.approx((r["choose_us"] + r["observe_us"] + r["exposed_us"])
                                                   / (1e3 * r["step_ms"]))
    (eager,) = main(["--running", "1", "--tokens", "128", "--no-ahead"])["levels"]
    assert eager["ahead_us"] == eager["exposed_us"] == 0
    # against every fixed tree: the best of them is a real shape, and aware's own time costs it throughput
    (level,) = main(["--running", "4", "--tokens", "128", "--against-fixed"])["levels"]
    assert level["best_fixed"] in {"plain"} | {c.name for c in candidate_configs()}
    assert 0 < level["tok_s_with_host"] < level["tok_s"] and level["best_fixed_tok_s"] > 0
    # a GRPO batch: searches counted (at least the first; `ahead` searches up to four levels a step, `choose`
    # one), host time a share of the SIMULATED steps
    batch = main(["--batch", "8", "--max-tokens", "64", "--against-fixed"])
    assert batch["batch"] == 8 and 1 <= batch["searches"] <= 5 * batch["steps"] and 0 < batch["share_of_step"] < 1
    assert batch["best_fixed"] in {"plain"} | {c.name for c in candidate_configs()}
    assert batch["best_fixed_tok_s"] >= batch["plain_tok_s"] > 0 and batch["tok_s_with_host"] > 0


def searches_by_caller(aware: Aware) -> dict[str, int]:
    """Counts `aware`'s searches (each prices every candidate, `_rates`) by the call they ran in."""
    counts, rates, calls = {"choose": 0, "ahead": 0, "observe": 0}, aware._rates, []

    def counted(running):
        counts[calls[-1]] += 1
        return rates(running)

    def within(name):
        method = getattr(aware, name)

        def call(*args, **kwargs):
            calls.append(name)
            try:
                return method(*args, **kwargs)
            finally:
                calls.pop()
        setattr(aware, name, call)

    for name in counts:
        within(name)
    aware._rates = counted
    return counts


@pytest.mark.parametrize("batch", [False, True], ids=["fixed-running", "grpo-batch"])
def test_ahead_takes_the_searches_off_the_steps_and_chooses_as_well(batch):
    """An engine that calls `ahead` while the device runs each step (a static engine) gets the periodic
    search and those of the levels the next step reaches made there: `choose` and `observe`, which the
    steps wait for, search a few times where without it they search dozens of times (on a GRPO batch the
    first plain and the first tree step of each concurrency bucket still search at once, as a row count
    two or more below the last does). Deciding on searches a step older chooses as well: SIMULATED
    tokens/s within 3% of the searches made in `choose`, on the GPU check's policy at 16 running rows and
    on a GRPO batch of 32 rows."""
    from fastgrpo.bench.simulate.acceptance import AcceptanceProfile
    from fastgrpo.models.policy import policy_config
    from fastgrpo.speculation.roofline import ACCELERATORS, Roofline, model_shape, simulated_cost_model
    from tools.aware_overhead import drive, drive_batch

    cfg = policy_config("gpu", 296, 512, bos_id=1, eos_id=2, pad_id=0).to_dict()
    roofline = Roofline(ACCELERATORS["h100"], model_shape(cfg, name="policy-gpu"))
    costs, profile = simulated_cost_model(roofline), AcceptanceProfile([0.7], 0.7)
    rates, counts = {}, {}
    for ahead in (False, True):
        aware = Aware(costs, acceptance_prior=0.7)
        counts[ahead] = searches_by_caller(aware)
        run = (drive_batch(aware, roofline, profile, 32, 512, seed=1, ahead=ahead) if batch
               else drive(aware, roofline, profile, 16, 1024, seed=1, ahead=ahead))
        rates[ahead] = run["tokens"] / run["seconds"]
    assert counts[False]["ahead"] == 0 and counts[False]["choose"] >= 20
    left = counts[True]["choose"] + counts[True]["observe"]
    assert counts[True]["ahead"] >= 20 and left <= counts[False]["choose"] / (2 if batch else 4)
    assert rates[True] == pytest.approx(rates[False], rel=0.03)


def test_without_ahead_for_a_step_its_acceptance_and_search_wait_one_step_at_most():
    """Once an engine calls `ahead`, a step's accepted lengths are learned there and a due search waits
    for it; where the next step calls no `ahead` (an eager step of a static engine), the next choice but
    one learns them and searches."""
    aware = Aware(synthetic_costs(), acceptance_prior=0.7)
    tree = SpecConfig(2, 2, 4)
    aware.observe(None, 4, 4, 0.01)  # a bucket's first step is plain
    counts = searches_by_caller(aware)
    steps = 0
    while aware.choose(4, 100) is None:  # until it speculates, with `ahead` at every step
        aware.ahead(4, 100, None)
        aware.observe(None, 4, 4, 0.01)
        steps += 1
        assert steps < 100
    aware.ahead(4, 100, tree)
    aware.observe(tree, 4, 8, 0.012, [1, 1, 1, 1])  # right after plain steps: the draft's catch-up, unpriced
    aware.choose(4, 100)
    aware.ahead(4, 100, tree)
    aware.observe(tree, 4, 8, 0.012, [1, 1, 1, 1])  # the bucket's first priced tree step: searched anew, all learned
    learned = dict(aware.acceptance.count)
    aware.choose(4, 100)
    aware.ahead(4, 100, tree)
    aware.observe(tree, 4, 8, 0.012, [1, 1, 1, 1])
    assert aware.acceptance.count == learned  # deferred to the next `ahead`
    aware.choose(4, 100)
    aware.ahead(4, 100, tree)
    assert aware.acceptance.count[tree] == learned[tree] + 4
    for _ in range(Aware.SEARCH_EVERY - 1):  # a periodic search comes due, and no `ahead` follows
        aware.choose(4, 100)
        aware.ahead(4, 100, tree)
        aware.observe(tree, 4, 8, 0.012, [1, 1, 1, 1])
    before = dict(counts)
    aware.choose(4, 100)  # decides on the searches before the due one
    aware.observe(tree, 4, 8, 0.012, [1, 1, 1, 1])
    assert counts == before and aware.acceptance.count[tree] == learned[tree] + 4 * (Aware.SEARCH_EVERY - 1)
    aware.choose(4, 100)  # no `ahead` came: this one learns both steps and searches
    assert counts["choose"] == before["choose"] + 1
    assert aware.acceptance.count[tree] == learned[tree] + 4 * (Aware.SEARCH_EVERY + 1)


@pytest.mark.parametrize("policy", [Aware, AwarePerSequence])
def test_a_search_prices_every_shape_as_goodput_does(policy):
    """The search's pricing of every candidate at once (`Aware._rates`, numpy) gives each `goodput`'s figure
    (to rounding: numpy's power may differ from Python's in the last bit), after observations that moved the
    acceptance, the fits and the corrections, at several contexts."""
    import random

    rng = random.Random(3)
    aware = policy(synthetic_costs(), acceptance_prior=0.7)
    for step in range(400):
        running = rng.choice([1, 3, 8, 40])
        config = aware.choose(running, 50 + step)
        accepted = None if config is None else [rng.randint(0, config.depth) for _ in range(running)]
        emitted = running if config is None else sum(a + 1 for a in accepted)
        aware.observe(config, running, emitted, 0.01 * rng.uniform(0.8, 1.5), accepted)
    aware._forget_searches()  # (a search reads acceptance as it was at the first search since)
    for running in (1, 3, 8, 40):
        for context in (None, 80.0, 900.0):
            aware.context = context
            assert aware._rates(running).tolist() == pytest.approx([aware.goodput(c, running) for c in aware.candidates],
                                                                   rel=1e-12)


def test_a_speculative_step_right_after_a_plain_one_does_not_price_its_shape():
    """The first speculative step after plain ones also catches the draft up on the states they added: measured
    at 10x its calibrated time it moves neither the step fit nor the correction, and speculation stays chosen;
    the next speculative step (no catch-up) measured so is taken, and plain decoding wins."""
    aware = Aware(synthetic_costs(), acceptance_prior=0.8, probe_every=10_000)
    plain_once(aware, 4)
    corrections = dict(aware.correction)
    for priced in (False, True):
        c = aware.choose(4, 100)
        assert c is not None
        aware.observe(c, 4, 8, 10 * aware._calibrated_seconds(c, 4), accepted=[1] * 4)
        assert (aware._fit(4).shapes == {} and aware.correction == corrections) is not priced
    assert aware.choose(4, 100) is None
