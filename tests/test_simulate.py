"""`bench simulate`: the simulator schedules as the engine does, charges exactly its cost model, and
never hands a policy the truth; the TLT-style policy does what TLT does."""

from __future__ import annotations

import statistics

import numpy as np
import pytest

from fastgrpo.bench.simulate import (CONTEXT, PROFILE_CONFIGS, SWEEP, AcceptanceProfile, CpuCosts, DraftConfidence, Recorder,
                                     SimRequest, Workload, eagle_profile, fit_acceptance, price_engine_run,
                                     replay_steps, sim_policies, simulate, whole_tree_acceptance)
from fastgrpo.bench.simulate.gpu import run_policies
from fastgrpo.engines.embedded.engine import EmbeddedEngine
from fastgrpo.speculation.roofline import H100, LLAMA3_8B, Roofline, simulated_cost_model
from fastgrpo.models.policy import new_policy, policy_config
from fastgrpo.speculation.cost_model import CostModel
from fastgrpo.models.draft import DraftHead
from fastgrpo.speculation.per_sequence import AwarePerSequence
from fastgrpo.speculation.policy import Aware, Off, Static, candidate_configs
from fastgrpo.speculation.tlt import TLT
from fastgrpo.speculation.spec import SpecConfig
from fastgrpo.types import Request, SamplingParams

VOCAB = 8


class ToyCosts:
    """Costs simple enough to add up by hand."""

    name = "toy"
    padded = False

    def target(self, B, n, ctx_max, ctx_sum):
        return 1.0 + 0.1 * B * n

    def draft(self, B, n, ctx_max, ctx_sum):
        return 0.01 * B * n

    def decode_step(self, B, ctx_max, ctx_sum, speculating=False):
        return 1.0 + 0.1 * B

    def spec_step(self, c, B, width, ctx_max, ctx_sum):
        return 2.0 + 0.1 * B * c.num_verify

    def prefill(self, unique, width, joined):
        return 5.0 + unique

    def between_steps(self, B):
        return 0.0

    def per_call(self, sequences):
        return 0.0


def test_off_costs_exactly_the_sum_of_its_steps_and_refills_freed_rows():
    wl = Workload("toy", [SimRequest(0, 4, 2), SimRequest(1, 4, 3), SimRequest(2, 4, 5)], max_new=100, max_context=100)
    run = simulate(wl, ToyCosts(), None, Off(), max_batch=2, rng=np.random.default_rng(0))
    # prefill 0,1 (7) | step B=2 (1.2): 0 done | prefill 2 (6) | step B=2: 1 done | 3 steps B=1 (1.1 each)
    assert run.seconds == pytest.approx(7 + 1.2 + 6 + 1.2 + 3 * 1.1)
    assert run.decode_steps == 5 and run.prefill_s == pytest.approx(13)
    assert [b for _, b, _, _, _ in run.trace] == [2, 2, 1, 1, 1]
    assert run.finished_order == [0, 1, 2]
    assert run.emitted == (2 - 1) + (3 - 1) + (5 - 1)  # the first token of each comes from its prefill


def test_samples_of_one_prompt_share_its_prefill():
    reqs = [SimRequest(p, 10, 3) for p in range(2) for _ in range(4)]
    shared = simulate(Workload("g", reqs, 10, 100), ToyCosts(), None, Off(), 8, np.random.default_rng(0))
    alone = simulate(Workload("g", reqs, 10, 100), ToyCosts(), None, Off(), 8, np.random.default_rng(0),
                     share_prefill=False)
    assert shared.prefill_s == pytest.approx(5 + 2) and alone.prefill_s == pytest.approx(5 + 8)


class Replayed(AcceptanceProfile):
    """The engine's accepted lengths, step by step, in its row order."""

    def __init__(self, steps):
        super().__init__([0.5], 0.0)
        self.steps = list(steps)

    def draw(self, c, B, rng):
        acc = self.steps.pop(0)
        assert len(acc) == B
        return np.asarray(acc)


@pytest.mark.parametrize("speculate", [False, True])
def test_continuous_batching_matches_the_engine_step_for_step(speculate):
    cfg = policy_config("test", VOCAB, 64, bos_id=1, eos_id=VOCAB + 1, pad_id=0)
    target = new_policy(cfg, seed=3).eval()
    draft = DraftHead(cfg)
    draft.reset_parameters(seed=5)
    engine = EmbeddedEngine(cfg, 3, 64, eos_id=VOCAB + 1, pad_id=0)
    engine.update_weights(target.state_dict().items(), 0)
    engine.update_draft(draft.state_dict().items(), 0)
    rec = Recorder(Static(SpecConfig(2, 2, 4)) if speculate else Off())
    engine.set_speculation(rec)
    prompts = [[1, 3, 4], [1, 5], [1, 2, 2, 6], [1, 3, 4], [1, 7, 7], [1, 4]]
    lengths = [5, 2, 9, 4, 7, 3]
    out = engine.generate([Request(p, max_new_tokens=L) for p, L in zip(prompts, lengths)],
                          SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True), seed=2)
    assert [len(o.token_ids) for o in out] == lengths
    real = engine.stats()["trace"]

    wl = Workload("fixed", [SimRequest(i, len(p), L) for i, (p, L) in enumerate(zip(prompts, lengths))], 16, 64)
    accepted = [acc for _, config, _, _, _, acc in rec.log if config is not None]
    policy = Static(SpecConfig(2, 2, 4)) if speculate else Off()
    run = simulate(wl, ToyCosts(), Replayed(accepted), policy, 3, np.random.default_rng(0))
    assert [(b, c, e) for _, b, c, e, _ in run.trace] == [(b, c, e) for b, c, e, _ in real]
    if speculate:
        assert any(a for _, _, _, _, _, acc in rec.log for a in acc)  # some draft tokens were accepted


def test_replay_reconstructs_rows_of_a_simulated_run():
    wl = Workload("w", [SimRequest(i, 5 + i, 6 + 3 * i) for i in range(4)], 100, 200)
    rec = Recorder(Static(SpecConfig(3, 2, 6)))
    acc = AcceptanceProfile([0.7], 0.3)
    run = simulate(wl, ToyCosts(), acc, rec, 4, np.random.default_rng(1))
    steps = replay_steps([(c, b, a) for _, c, b, _, _, a in rec.log], [5, 6, 7, 8], [6, 9, 12, 15])
    assert [s[0] for s in steps] == [b for _, b, _, _, _ in run.trace]
    assert steps[0][1] == 8  # after prefill the draft is a whole prompt behind (the window caps at 16)


def test_tlt_turns_speculation_off_above_its_threshold():
    tlt = TLT(threshold=16)
    assert tlt.choose(17) is None and tlt.choose(200) is None
    assert tlt.choose(16) is not None and tlt.choose(1) is not None


@pytest.mark.parametrize("method", ["epsilon", "ucb1"])
def test_tlt_bandit_converges_to_the_best_arm_per_bucket(method):
    arms = (SpecConfig(3, 1, 4), SpecConfig(4, 4, 8), SpecConfig(5, 4, 16))
    tlt = TLT(threshold=32, arms=arms, method=method, seed=1)
    rng = np.random.default_rng(0)
    best = {2: arms[2], 16: arms[0]}  # a different best arm in each bucket
    for _ in range(600):
        for running, good in best.items():
            c = tlt.choose(running)
            rate = (300.0 if c == good else 200.0) * rng.uniform(0.8, 1.2)  # tokens / s, noisy
            tlt.observe(c, running, emitted=running * 2, seconds=running * 2 / rate)
    for running, good in best.items():
        pulls, mean = tlt.pulls[tlt.bucket(running)], tlt.mean[tlt.bucket(running)]
        assert arms[max(range(len(arms)), key=mean.__getitem__)] == good  # the highest mean reward
        assert pulls[arms.index(good)] > 0.8 * sum(pulls)


def test_aware_gets_a_simulated_calibration_not_the_cost_function():
    costs = Roofline(H100, LLAMA3_8B)
    aware = sim_policies(costs, ())["aware"]
    assert isinstance(aware, Aware) and isinstance(aware.costs, CostModel)
    assert sorted(aware.costs.target_s) == sorted(SWEEP)
    for tokens in SWEEP:  # the sweep's shapes at its fixed context, as calibrate() times them
        B = min(tokens, 64)
        assert aware.costs.target_s[tokens] <= costs.target(B, max(tokens // B, 1), CONTEXT, B * CONTEXT) + 1e-12


def test_a_simulated_calibration_measures_what_a_row_costs_beyond_its_tokens():
    """A machine where every row costs 0.05 s beyond its tokens: the sweep's row probes recover it, and
    a tree of 16 tokens in one row is then priced as that machine runs it (not as 16 rows of one)."""

    class RowCosts(ToyCosts):
        def target(self, B, n, ctx_max, ctx_sum):
            return 1.0 + 0.1 * B * n + 0.05 * B

    curve = simulated_cost_model(RowCosts())
    assert curve.target_row_s == pytest.approx(0.05)
    assert curve.target(16, rows=1) == pytest.approx(RowCosts().target(1, 16, 0, 0))
    assert curve.target(64, rows=4) == pytest.approx(RowCosts().target(4, 16, 0, 0))


def test_a_simulated_calibration_measures_what_context_costs():
    """A machine where a row pays 2e-5 s per cached token and a new token 3e-6 s per cached token: the
    context probes recover both rates, and a step over 3000-token contexts is priced as it runs."""

    class ContextCosts(ToyCosts):
        def target(self, B, n, ctx_max, ctx_sum):
            return 1.0 + 0.1 * B * n + 2e-5 * ctx_sum + 3e-6 * B * n * ctx_max

        def draft(self, B, n, ctx_max, ctx_sum):
            return 0.01 * B * n + 1e-6 * ctx_sum

    costs = ContextCosts()
    curve = simulated_cost_model(costs)
    assert curve.context_s["target_row"] == pytest.approx(2e-5)
    assert curve.context_s["target_token"] == pytest.approx(3e-6)
    assert curve.context_s["draft_row"] == pytest.approx(1e-6)
    assert curve.context_s["draft_token"] == pytest.approx(0.0, abs=1e-12)
    for B in (1, 16, 64):  # at the sweep's shape (B rows of one token), any context
        assert curve.at_context("target", B, B, 3000) == pytest.approx(costs.target(B, 1, 3000, B * 3000))
        assert curve.at_context("draft", B, B, 3000) == pytest.approx(costs.draft(B, 1, 3000, B * 3000))
    assert curve.at_context("target", 16, 16, None) == curve.target(16)  # context unknown: the sweep's
    assert curve.at_context("target", 16, 16, 0) >= curve.target(1)  # never below the cheapest forward
    assert CostModel.from_json(curve.to_json()).context_s == curve.context_s


def test_aware_told_the_context_is_near_the_best_static_tree_at_long_context():
    """On H100 / Llama-3-8B, 128 rows over 3000-token contexts: reading the caches is most of a step and
    costs a plain step and a tree step alike. Priced at the sweep's 128-token context and rescaled by a
    measured ratio, trees looked dearer than they ran and aware was 9% slower than the best static tree
    here (its choose() given no context, 2026-11-26); told the rows' context it must be within 5% of
    the best tree of GPU_STATICS, and faster than plain decoding."""
    from fastgrpo.bench.simulate import GPU_STATICS

    costs, acc = Roofline(H100, LLAMA3_8B), eagle_profile(1.2)
    running = 128
    wl = Workload("fixed", [SimRequest(i, 3000, 200) for i in range(running)], 200, 3300)
    policies = sim_policies(costs, GPU_STATICS)
    seconds = {}
    for name, policy in policies.items():
        if name in ("off", "aware") or name.startswith("static_"):
            rng = np.random.default_rng(0)
            seconds[name] = [simulate(wl, costs, acc, policy, running, rng) for _ in range(2)][-1].seconds
    best = min(s for name, s in seconds.items() if name.startswith("static_"))
    assert seconds["aware"] <= 1.05 * best, seconds
    assert seconds["aware"] < 0.9 * seconds["off"], seconds


def test_aware_recovers_from_a_wrong_calibration_through_what_it_observes():
    """Calibrated as if every verify forward cost 8x what it does, aware at first declines to
    speculate; its probes of speculation correct the model from the simulated step times."""
    costs = Roofline(H100, LLAMA3_8B)
    acc = eagle_profile(0.5)
    wl = Workload("fixed", [SimRequest(i, 128, 3000) for i in range(4)], 3000, 4000)
    wrong = lambda kind, tokens: 8.0 if kind == "target" and tokens > 4 else 1.0  # noqa: E731
    runs = {}
    for name, err in (("right", None), ("wrong", wrong)):
        aware = sim_policies(costs, (), calibration_error=err)["aware"]
        assert aware._decide(4) is None if name == "wrong" else aware._decide(4) is not None
        rng = np.random.default_rng(0)
        runs[name] = [simulate(wl, costs, acc, aware, 4, rng) for _ in range(2)]
    off = simulate(wl, costs, acc, Off(), 4, np.random.default_rng(0)).seconds
    assert runs["wrong"][-1].spec_steps > 0.9 * runs["wrong"][-1].decode_steps
    assert runs["wrong"][-1].seconds < 0.7 * off
    # one correction factor per kind and bucket cannot undo an error in the curve's shape (the draft's
    # share is misjudged, so the tree chosen differs): close to the well-calibrated run, not equal
    assert runs["wrong"][-1].seconds == pytest.approx(runs["right"][-1].seconds, rel=0.15)


def test_acceptance_draws_follow_the_profile_and_measured_histograms():
    """The profile's survival written out from its formula (depth 4, top-2, 8 verified: the fill w is
    7 / 4 = 1.75 candidates a level, each depth j covered with 1 - (1 - alpha_j) w^-beta), and its draws
    accepting >= d tokens as often as that survival says; the EAGLE-3 chain's alpha the root of
    1 + a + ... + a^7 = 3.34 found by numpy, not by the profile's own bisection."""
    p = AcceptanceProfile([0.8, 0.6], 0.5)
    c = SpecConfig(4, 2, 8)
    cover = [1 - 0.2 * 1.75**-0.5] + [1 - 0.4 * 1.75**-0.5] * 3  # alpha 0.8 at depth 1, then 0.6 repeated
    survival = np.cumprod(cover)
    assert p.survival(c) == pytest.approx(survival.tolist(), abs=1e-12)
    assert p.mean(c) == pytest.approx(1 + survival.sum(), abs=1e-12)
    draws = p.draw(c, 200_000, np.random.default_rng(0))
    for d in range(1, 5):  # 200k draws: a standard error of 0.0011 at most
        assert (draws >= d).mean() == pytest.approx(survival[d - 1], abs=0.005), d
    assert draws.max() == 4
    assert p.mean(SpecConfig(4, 4, 16)) > p.mean(SpecConfig(4, 1, 5)) > p.mean(SpecConfig(2, 1, 3))
    measured = {SpecConfig(2, 2, 4): [2] * 300, SpecConfig(3, 4, 8): [0, 1] * 150}
    fitted = fit_acceptance(measured, "test")
    assert (fitted.draw(SpecConfig(2, 2, 4), 50, np.random.default_rng(0)) == 2).all()
    chain = eagle_profile(0.5)
    roots = np.roots([1, 1, 1, 1, 1, 1, 1, 1 - 3.34])  # a^7 + ... + a + 1 - 3.34 = 0
    (a,) = [r.real for r in roots if abs(r.imag) < 1e-12 and 0 < r.real < 1]
    assert chain.alpha == [pytest.approx(a, abs=1e-9)]
    assert chain.mean(SpecConfig(7, 1, 8)) == pytest.approx((1 - a**8) / (1 - a), abs=1e-9)  # a chain: w = 1


def test_roofline_is_memory_bound_at_small_batch_and_compute_bound_at_large():
    costs = Roofline(H100, LLAMA3_8B)
    one = costs.target(1, 1, 1000, 1000)
    assert costs.target(1, 16, 1000, 1000) < 1.1 * one  # verifying 16 tokens costs about one at batch 1
    assert costs.target(256, 16, 1000, 256 * 1000) > 10 * one
    tp8 = Roofline(H100, type(LLAMA3_8B)(**{**LLAMA3_8B.__dict__, "tp": 8}))
    assert tp8.target(1, 1, 1000, 1000) < one  # weights split 8 ways, plus the all-reduces


@pytest.mark.slow
def test_validation_runs_end_to_end_on_an_engine():
    """The cpu profile is measured on an engine and the simulator predicts every case (no accuracy
    claim for a random test-size model on a busy machine: the bench reports the errors)."""
    from fastgrpo.bench.simulate import STATIC_SWEEP, CpuProfiler, validate
    from fastgrpo.engines.embedded.calibrate import calibrate

    cfg = policy_config("test", VOCAB, 64, bos_id=1, eos_id=VOCAB + 1, pad_id=0)
    engine = EmbeddedEngine(cfg, 8, 64, eos_id=VOCAB + 1, pad_id=0)
    engine.update_weights(new_policy(cfg, seed=3).state_dict().items(), 0)
    draft = DraftHead(cfg)
    draft.reset_parameters(seed=5)
    engine.update_draft(draft.state_dict().items(), 0)
    curve = calibrate(engine.model, engine.draft, reps=1, rounds=1)
    pols = {"off": Off(), "static": Static(SpecConfig(4, 4, 12)), "aware": Aware(curve), "tlt": TLT(),
            "aware_per_sequence": AwarePerSequence(curve)}
    pols |= {f"static_{c.name}": Static(c) for c in STATIC_SWEEP} | {"fastgrpo": sim_policies(Roofline(H100, LLAMA3_8B), ())["fastgrpo"]}
    prompts = [[1, 2 + i % 5, 3, 4 + i % 3][: 2 + i % 3] for i in range(12)]
    profiler = CpuProfiler(engine, prompts, 1.0, 1.0, print, tokens=6)  # a calibration sweep per whole pass
    profiler.measure_pass()  # as `bench simulate` does, before the validation
    val = validate(engine, pols, profiler, prompts, 1.0, 1.0, (1, 4), 6, 2, 2, 10, 64, 1, print, replays=3)
    costs, info = val["_costs"]
    # the whole pass, then level passes amid each workload's runs: after its warm-up and as often as
    # at the default repetitions (16 of one sequence: every 6th; 4 of four: every 2nd; the GRPO
    # batch's 2: after each)
    windows = {"sweep_B1": [1, 2, 3], "sweep_B4": [4, 5, 6], "grpo": [7, 8, 9]}
    assert val["profile_passes"] == windows
    assert info["passes"] == list(range(10))
    # levels capped at the engine's 8 rows; the GRPO batch's passes up to its 4 rows
    assert info["runs_by_level"] == {1: 1 + 3 + 3, 2: 1 + 3, 4: 1 + 3 + 3, 8: 1}
    assert len(info["sweep_rounds_target_1_s"]) == 1  # level passes measure no sweep
    assert sorted(costs.off_extra) == sorted(costs.plain_extra) == sorted(costs.spec_extra) == [1, 2, 4, 8]
    assert len(costs.prefill_table) == 4  # 1, 2, 4 and 8 unique prompts (16 and more capped to 8)
    # the shapes the policies ran beyond the profile's five, profiled from the next pass on
    profiled = {name for shapes in info["shapes_profiled"].values() for name in shapes}
    assert "d5k8n160" in profiled  # fastgrpo's tree at one running sequence
    assert {c.name for c in costs.spec_measured} >= profiled
    assert set(val["cpu_predicted_s"]) == set(val["cpu_measured_s"]) == set(val["error"]) == set(val["breakdown"])
    # each workload priced by the passes amid its runs: a plain step's extra at its level is the
    # median of those passes' own; a level they did not measure, from every pass that did
    profiler.fixed_curve = curve
    single = {p: profiler.costs({p})[0].off_extra for p in range(10)}
    assert len({round(single[p][1], 9) for p in windows["sweep_B1"]}) > 1  # three passes, three timings
    for w, B in (("sweep_B1", 1), ("sweep_B4", 4)):
        extra = profiler.costs(set(windows[w]))[0].off_extra
        assert extra[B] == pytest.approx(statistics.median(single[p][B] for p in windows[w]))
        assert extra[8] == profiler.costs()[0].off_extra[8]
    everywhere = profiler.costs()[0].off_extra  # the whole pass, its level's passes and the GRPO batch's
    for B, w in ((1, "sweep_B1"), (4, "sweep_B4")):
        assert everywhere[B] == pytest.approx(statistics.median(single[p][B] for p in [0, *windows[w], *windows["grpo"]]))
    # every case simulated as often as the engine ran it, in each of the three replays
    assert val["runs"]["sweep_B1_tlt"] == {"engine": 16, "simulated": 48}
    assert val["runs"]["grpo_aware"] == {"engine": 2, "simulated": 6}
    assert all(np.isfinite(e) and e > -1 for e in val["error"].values())
    assert all(b["priced_s"] > 0 and b["steps_s"] < b["measured_s"] for b in val["breakdown"].values())


def test_an_engine_run_is_priced_step_by_step_at_the_shapes_it_ran():
    """Two rows of lengths 3 and 2 under `off`: a step at 2 running, then one at 1, priced by hand."""
    curve = CostModel(dict.fromkeys(SWEEP, 1e-3), dict.fromkeys(SWEEP, 1e-4))
    costs = CpuCosts(curve, off_extra={1: 5e-4, 2: 7e-4}, prefill_table={10: 2e-3, 20: 4e-3}, copy_s=1e-3,
                     other_fit=(1e-4, 2e-4, 1e-5))
    # the first token comes from the prefill; rows retire after 2 and 1 decode steps
    log = [(None, None, 2, 2, 0.004, None), (None, None, 1, 1, 0.003, None)]
    run = {"seconds": 0.02, "prefill_s": 0.005, "lengths": [3, 2]}
    priced = price_engine_run(costs, run, log, [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]] * 2, False)
    steps = (1e-3 + 7e-4) + (1e-3 + 5e-4)
    prefill = 3e-3 + 1e-3  # 15 prompt tokens: halfway on the table; one copy
    around = 1e-4 + 2 * 2e-4 + 1e-5 * (2 + 1)
    assert priced["priced_s"] == pytest.approx(steps + prefill + around)
    assert priced["steps_error"] == pytest.approx(steps / 0.007 - 1)
    assert priced["around_s"] == pytest.approx(0.02 - 0.005 - 0.007)
    assert costs.prefill(3, 20, 3) == pytest.approx(4e-3 + 2e-4 * 40)  # past the table at its last slope
    # below the table's first point as the sweep's forward of one row scales
    sloped = CpuCosts(CostModel({t: 1e-3 + 1e-4 * t for t in SWEEP}, dict.fromkeys(SWEEP, 1e-4)),
                      prefill_table={10: 2e-3, 20: 4e-3})
    assert sloped.prefill(1, 5, 1) == pytest.approx(2e-3 * (1e-3 + 5e-4) / (1e-3 + 1e-3))


def test_a_step_cheaper_than_the_sweeps_forwards_is_priced_so_down_to_half_of_them():
    """A measured extra below zero (the engine's step cheaper than the sweep's forwards at its shape)
    lowers the price; the floor, half the forwards, only guards a far extrapolation."""
    curve = CostModel(dict.fromkeys(SWEEP, 1e-2), dict.fromkeys(SWEEP, 1e-3))
    costs = CpuCosts(curve, off_extra={1: -2e-3, 64: -2e-2}, spec_extra={1: -3e-3})
    assert costs.decode_step(1, CONTEXT, 0) == pytest.approx(8e-3)
    assert costs.decode_step(64, CONTEXT, 0) == pytest.approx(5e-3)  # -20 ms on a 10 ms forward: half of it
    # a tree of depth 2: the draft's catch-up and one more draft forward, then the verify
    assert costs.spec_step(SpecConfig(2, 1, 3), 1, 1, CONTEXT, 0) == pytest.approx(1e-3 + 1e-3 + 1e-2 - 3e-3)


def test_a_speculative_step_is_never_priced_below_a_plain_step_of_its_rows():
    """A fit whose intercept reads -8 ms at one row would price a chain of one (draft 1 ms, verify 10 ms) at 3 ms,
    and half of its forwards at 5.5 ms; a plain step there costs 10 - 2 = 8 ms, and the chain no less."""
    curve = CostModel(dict.fromkeys(SWEEP, 1e-2), dict.fromkeys(SWEEP, 1e-3))
    costs = CpuCosts(curve, off_extra={1: -2e-3}, plain_extra={1: -2e-3}, spec_extra={1: -8e-3})
    assert costs.spec_step(SpecConfig(1, 1, 2), 1, 1, CONTEXT, 0) == pytest.approx(8e-3)
    assert CpuCosts(curve, off_extra={1: -2e-3}, spec_extra={1: -1e-3}).spec_step(
        SpecConfig(1, 1, 2), 1, 1, CONTEXT, 0) == pytest.approx(1e-3 + 1e-2 - 1e-3)  # above it: the fit's


def test_the_profile_measures_both_corners_of_awares_grid():
    """The speculative steps' fit is read only between the shapes it measured: the shallowest and the deepest
    shape `aware` may choose are among them."""
    depths = [c.depth for c in candidate_configs()]
    profiled = [c.depth for c in PROFILE_CONFIGS if isinstance(c, SpecConfig)]
    assert min(profiled) == min(depths) == 1 and max(profiled) == max(depths)


def test_aware_at_128_fixed_rows_takes_the_tree_that_pays_despite_the_drafts_catch_up():
    """H100 / Llama-3-8B, 128 rows kept running for 512 tokens (`bench simulate`'s fixed-concurrency case): a
    tree beats plain decoding by over 10%, and aware reaches 0.97x the best of three static trees. A probe's
    first speculative step catches the draft up on a window of states a row; priced as its tree's, it kept
    aware plain (0.84x)."""
    costs, statics = Roofline(H100, LLAMA3_8B), (SpecConfig(2, 1, 3), SpecConfig(2, 2, 4), SpecConfig(3, 4, 8))
    wl = Workload("fixed 128", [SimRequest(i, 256, 512) for i in range(128)], 512, 256 + 513)
    res = run_policies(wl, costs, eagle_profile(1.3), statics, 128, 1, 0,
                       modes=["off", "aware", *(f"static_{c.name}" for c in statics)])
    best = min(res[f"static_{c.name}"]["seconds"] for c in statics)
    assert best < res["off"]["seconds"] / 1.1 and res["aware"]["seconds"] <= best / 0.97


def test_a_profiled_shape_is_priced_as_measured_and_others_by_the_fit():
    """The fit prices every shape; one measured at 1 and 4 rows adds its own residual there, half of
    each halfway between (by rows), the nearest level's beyond them, and nothing to another shape."""
    curve = CostModel(dict.fromkeys(SWEEP, 1e-3), dict.fromkeys(SWEEP, 1e-4))
    measured, other = SpecConfig(6, 8, 48), SpecConfig(3, 1, 4)
    fit = CpuCosts(curve, spec_extra={1: 1e-3, 4: 2e-3}, spec_slopes=(0.0, 1e-4, 0.0))
    costs = CpuCosts(curve, spec_extra={1: 1e-3, 4: 2e-3}, spec_slopes=(0.0, 1e-4, 0.0),
                     spec_measured={measured: {1: 4e-3, 4: -1e-3}})
    for B, added in ((1, 4e-3), (4, -1e-3), (2, 4e-3 - 5e-3 / 3), (8, -1e-3)):
        assert costs.spec_step(measured, B, 1, 100, 0) == pytest.approx(fit.spec_step(measured, B, 1, 100, 0) + added)
    assert costs.spec_step(other, 2, 1, 100, 0) == fit.spec_step(other, 2, 1, 100, 0)


def test_simulated_draft_confidence_is_calibrated_informative_and_decides_what_is_accepted():
    """Over many rows the draft's estimated reach of each level is the profile's survival (calibrated);
    rows that will accept more are rated higher (informative, by rho); verifying every node accepts
    the whole-tree length, verifying only the first level caps it at one."""
    profile, c = AcceptanceProfile([0.8, 0.6], 0.5), SpecConfig(3, 2, 7)
    conf, rng = DraftConfidence(rho=0.5), np.random.default_rng(0)
    scores, depth, L, w = conf.tree(profile, c, 20_000, rng)
    assert w == 2 and scores.shape == depth.shape == (20_000, 6)
    reach = np.exp(scores).reshape(20_000, 3, 2).sum(-1)  # each level's estimated reach, per row
    assert reach.mean(0) == pytest.approx(profile.survival(c), abs=0.01)
    assert reach[L == 3, 2].mean() > reach[L == 0, 2].mean() + 0.4
    assert (conf.accepted(np.ones((20_000, 6), dtype=bool), L, w, rng) == L).all()
    first = np.zeros((20_000, 6), dtype=bool)
    first[:, :2] = True
    assert (conf.accepted(first, L, w, rng) == np.minimum(L, 1)).all()


class VerifiedCosts(ToyCosts):
    """ToyCosts whose speculative step charges the tokens verified, recording them."""

    def __init__(self):
        self.verified = []

    def spec_step(self, c, B, width, ctx_max, ctx_sum, verified=None):
        n = verified or c.num_verify
        self.verified.append((c, n))
        return 2.0 + 0.1 * B * n


@pytest.mark.parametrize("static", [False, True])
def test_a_per_sequence_budget_is_charged_for_the_share_of_the_tree_it_verifies(static):
    """The draft confidences hold fewer nodes a row than the tree has (d4k4n12: 4 levels of 2, for 11 nodes):
    each step is charged the root plus the verified share of the tree's N - 1 nodes, the whole tree N."""
    costs = VerifiedCosts()
    policy = AwarePerSequence(simulated_cost_model(costs), margin=0.0)  # cuts on any predicted gain
    shares = []
    select = policy.select

    def recorded(scores, depth, config, running, **widths):
        nodes = select(scores, depth, config, running, **widths)
        shares.append(float(nodes.float().mean()))
        if static:  # one width for every row
            assert len(set(nodes.sum(1).tolist())) == 1
        return nodes

    policy.select = recorded
    wl = Workload("w", [SimRequest(i, 8, 40) for i in range(6)], 100, 200)
    run = simulate(wl, costs, AcceptanceProfile([0.7], 0.3), policy, 6, np.random.default_rng(0), static_widths=static)
    assert run.spec_steps == len(costs.verified) == len(shares) > 0
    assert all(n == pytest.approx(1 + (c.num_verify - 1) * share) for (c, n), share in zip(costs.verified, shares))
    if static:  # one width for every row: here the whole tree, charged N
        assert any(share == 1 and n == c.num_verify for (c, n), share in zip(costs.verified, shares))
    else:
        assert policy.verified_nodes < policy.offered_nodes  # some rows' trees were cut


def test_acceptance_is_measured_on_whole_trees_only():
    """A per-sequence budget's steps log the whole shape but verify part of it: pooled, they would
    teach the simulator that the shape accepts less than it does."""
    costs, profile = VerifiedCosts(), AcceptanceProfile([0.7], 0.3)
    wl = Workload("w", [SimRequest(i, 8, 40) for i in range(6)], 100, 200)
    whole = Recorder(Static(SpecConfig(4, 4, 12)))
    cut = Recorder(AwarePerSequence(simulated_cost_model(costs), margin=0.0))
    for rec in (whole, cut):
        rec.tag = ("w", 6, 1)
        simulate(wl, costs, profile, rec, 6, np.random.default_rng(0))
    assert cut.policy.verified_nodes < cut.policy.offered_nodes  # it cut trees, and logged them
    assert any(acc for _, config, *_, acc in cut.log if config is not None)
    pooled = whole_tree_acceptance([whole, cut], ["w"])
    assert pooled == {"w": {SpecConfig(4, 4, 12): [a for *_, acc in whole.log for a in acc]}}


def test_per_sequence_budget_is_not_slower_than_aware_on_a_simulated_gpu():
    """On H100 / Llama-3-8B at 16 and 64 running sequences (where verifying starts to cost), cutting
    unlikely nodes must not make the rollout slower than aware's uniform tree: neither in a ragged verify
    nor at the widths a static engine verifies (one for every row). Mean of three seeds; within 2%: the
    draws alone move `aware` against itself by up to 2% a seed (an `aware` whose budget keeps every node,
    tools/per_sequence_sim.py's)."""
    costs, acc = Roofline(H100, LLAMA3_8B), eagle_profile(0.5)
    for B in (16, 64):
        wl = Workload("fixed", [SimRequest(i, 256, 600) for i in range(B)], 600, 1000)
        seconds = {}
        for name, static in (("aware", False), ("aware_per_sequence", False), ("aware_per_sequence", True)):
            runs = []
            for seed in range(3):
                policy, rng = sim_policies(costs, ())[name], np.random.default_rng(seed)
                runs.append([simulate(wl, costs, acc, policy, B, rng, static_widths=static) for _ in range(2)][-1])
            seconds[name, static] = statistics.mean(r.seconds for r in runs)
        assert seconds["aware_per_sequence", False] <= 1.02 * seconds["aware", False], (B, seconds)
        assert seconds["aware_per_sequence", True] <= 1.02 * seconds["aware", False], (B, seconds)


def test_the_per_sequence_tool_runs_its_four_policies_on_every_seed():
    from tools.per_sequence_sim import main

    out = main(["--seeds", "2"])
    assert len(out["seconds"]) == 4 and all(len(s) == 2 and min(s) > 0 for s in out["seconds"].values())
    # a budget that keeps every node verifies aware's trees, priced as aware's: its time is aware's but for the
    # draws (0.4% here; 2.6% less when the simulator priced the draft confidences' 8 nodes a row for d4k4n12's 11)
    kept, aware = (sum(out["seconds"][k]) for k in ("aware, every node kept", "aware"))
    assert abs(kept / aware - 1) < 0.015


def test_the_standard_error_of_a_median_shrinks_with_runs_and_vanishes_without_spread():
    from fastgrpo.bench.simulate import median_se

    rng = np.random.default_rng(0)
    few, many = np.linspace(0.8, 1.2, 4), np.linspace(0.8, 1.2, 64)  # runs spread +-20%
    assert median_se([2.0] * 5, rng) == 0.0
    assert 0.05 < median_se(few, rng) < 0.15
    assert median_se(many, rng) < median_se(few, rng) / 2  # 16x the runs: about a quarter


def test_a_moe_is_simulated_with_aware_priced_expert_blind_beside_aware():
    """On Qwen3-30B-A3B the simulator runs `aware_expert_blind` (calibrated on the model priced as a dense
    model of its active size) against the same true costs; a dense model has no such policy. At 16 and
    128 rows blind pricing picks trees whose verify reads far more experts than it assumed, so it is
    slower than aware priced for experts; its step fit learns most of the experts' cost from the measured
    steps (the second run's aware / blind: 0.97 at 16 rows, 0.94 at 128). Aware is never much slower than
    plain decoding."""
    from pathlib import Path

    from fastgrpo.speculation.roofline import load_model_shape

    assert "aware_expert_blind" not in sim_policies(Roofline(H100, LLAMA3_8B), ())
    moe = load_model_shape(Path(__file__).resolve().parents[1] / "configs" / "models" / "qwen3-30b-a3b.json")
    costs, acc = Roofline(H100, moe), eagle_profile(0.9)
    blind = sim_policies(costs, ())["aware_expert_blind"]
    assert isinstance(blind, Aware)
    assert blind.costs.target_s == simulated_cost_model(Roofline(H100, moe.blind())).target_s
    for B in (1, 16, 128):
        wl = Workload("fixed", [SimRequest(i, 256, 400) for i in range(B)], 400, 700)
        seconds = {}
        for name in ("off", "aware", "aware_expert_blind"):
            policy, rng = sim_policies(costs, ())[name], np.random.default_rng(0)
            seconds[name] = [simulate(wl, costs, acc, policy, B, rng) for _ in range(2)][-1].seconds
        assert seconds["aware"] <= 1.02 * seconds["off"], (B, seconds)
        if B > 1:
            assert seconds["aware"] < 0.99 * seconds["aware_expert_blind"], (B, seconds)


def test_bench_simulate_model_flag_builds_the_config_alone_and_writes_beside_the_full_run(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from fastgrpo.bench.simulate import command
    from fastgrpo.cli import build_parser

    parse = build_parser().parse_known_args
    assert parse(["bench", "simulate"])[0].needs == "draft"
    args = parse(["bench", "simulate", "--model", "configs/models/qwen3-30b-a3b.json", "--tensor", "2"])[0]
    assert (args.needs, args.model, args.tensor, args.hardware) == ("config", "configs/models/qwen3-30b-a3b.json", 2,
                                                                    "h100")
    assert parse(["bench", "simulate", "--model", "m.json", "--tp", "2"])[0].tensor == 2  # the older name, the same
    seen = {}
    monkeypatch.setattr("fastgrpo.bench.simulate.shape.bench_simulate_model",
                        lambda cfg, model, hw, tensor, quick, output, extra: seen.update(output=output, tensor=tensor))
    from pathlib import Path

    args.output, args.extra = Path("bench/simulate.json"), []  # `fastgrpo bench`'s default
    command.from_cli(args, SimpleNamespace(seed=0))
    assert seen == {"output": Path("bench/simulate-qwen3-30b-a3b.json"), "tensor": 2}
    args.repetitions = 3
    with pytest.raises(ValueError, match="--repetitions"):
        command.from_cli(args, SimpleNamespace(seed=0))


def test_the_model_table_lists_every_policy_against_aware():
    from fastgrpo.bench.simulate.shape import markdown

    result = {"meta": {"date": "2026-11-28", "case": "H100 SXM / m", "tp": 2, "workload": "long-tail",
                       "longtail": {"prompts": 64, "group": 8}, "max_running": 128, "repetitions": 3},
              "seconds": {"off": 300.0, "fastgrpo": 240.0, "tlt": 250.0, "static_d5k8n24": 100.0,
                          "static_d3k4n8": 120.0, "aware": 80.0, "aware_expert_blind": 120.0},
              "best_static": "d5k8n24", "spec_fraction": {m: 0.5 for m in ("off", "fastgrpo", "tlt", "static_d5k8n24",
                                                                           "aware", "aware_expert_blind")},
              "choices": {}, "step_prices": []}
    table = markdown(result, "fastgrpo bench simulate --model m.json --output x.json")
    assert "| `off` | 300.0 | 3.75x |" in table
    assert "| best static tree (d5k8n24) | 100.0 | 1.25x |" in table and "d3k4n8" not in table
    assert "expert-blind" in table and "| `aware` | 80.0 |  |" in table


def test_the_fixed_concurrency_tool_prices_every_gpu_and_model_at_each_level():
    from tools.fixed_concurrency_sim import main

    rows = main(["--levels", "1,128", "--tokens", "128"])
    assert len(rows) == 8 and all(r["aware_s"] <= r["off_s"] / 0.98 for r in rows)  # never slower than plain
    assert [r["seeds"] for r in rows] == [16, 3] * 4  # one sequence's draws need many runs to resolve 3%
    assert all(r["aware_over_best_static"] + 2 * r["aware_over_best_static_se"] >= 0.97 for r in rows)
