"""The GPU check's statistics, step cells, simulator fit and records (fastgrpo/bench/gpu_check), against
values worked out by hand: no device, no run of the check (tests/test_gpu_check.py runs it)."""

import json

import pytest

from fastgrpo.bench.gpu_check import STEP_SHAPES, dumps, grpo_summary, level_row, policy_state, spread, step_cells


def _runs(tok_s: list[float], accept: float = 1.0) -> list[dict]:
    return [{"tok_s": t, "seconds": 100 / t, "tokens": 100, "accept_len": accept, "spec_fraction": 0.5} for t in tok_s]


def test_spread_is_the_median_and_the_standard_error_of_the_mean():
    # 100, 110, 90: mean 100, deviations 0, 10, -10, sample variance 200 / 2 = 100, s = 10, s / sqrt(3)
    assert spread([100.0, 110.0, 90.0]) == pytest.approx({"n": 3, "median": 100.0, "mean": 100.0, "se": 5.773502692})
    # 1, 2, 3, 10: median 2.5, mean 4, squared deviations 9 + 4 + 1 + 36 = 50, variance 50 / 3, se sqrt(50 / 3 / 4)
    assert spread([1.0, 2.0, 3.0, 10.0]) == pytest.approx({"n": 4, "median": 2.5, "mean": 4.0, "se": 2.041241452})
    assert spread([7.0]) == {"n": 1, "median": 7.0, "mean": 7.0, "se": 0.0}
    assert spread([])["n"] == 0


def test_a_sweep_level_reports_the_aa_ratio_and_aware_against_the_best_fixed_choice():
    runs = {"off": _runs([100, 104, 96]), "static": _runs([200, 180, 220], 3.0), "static_aa": _runs([210, 230, 190], 3.0),
            "fastgrpo": _runs([150, 150, 150]), "tlt": _runs([205, 195, 200]), "aware": _runs([190, 200, 210], 2.5)}
    row = level_row(16, runs)
    assert row["static_tok_s"] == 200 and row["static_aa_tok_s"] == 210
    assert row["aa_ratio"] == pytest.approx(210 / 200)  # the noise floor: 5% between identical policies
    assert row["static_tok_s_se"] == pytest.approx(20 / 3**0.5)  # s = 20 (deviations 0, -20, 20)
    assert row["off_tok_s_se"] == pytest.approx(4 / 3**0.5) and row["fastgrpo_tok_s_se"] == 0
    # best fixed: tlt's 200 ties static's 200; the first of FIXED_MODES' order wins a tie (static)
    assert row["best_fixed"] == "static" and row["best_fixed_tok_s"] == 200
    assert row["aware_vs_best"] == pytest.approx(1.0) and row["aware_vs_off"] == pytest.approx(2.0)
    assert row["best"] == "static_aa" and row["best_vs_off"] == pytest.approx(2.1)
    assert row["aware_accept_len"] == 2.5 and row["static_runs"] == 3
    assert row["aware_ahead_s"] == row["aware_wait_s"] == row["aware_policy_s"] == 0.0  # an engine reporting none


def test_the_grpo_batch_reports_seconds_the_aa_ratio_and_aware_against_the_best_fixed_choice():
    def secs(values):
        return [{"seconds": v, "tokens": 500, "accept_len": 2.0} for v in values]

    runs = {"off": secs([10, 12, 11]), "static": secs([5, 6, 4]), "static_aa": secs([5.5, 4.5, 5.0]),
            "fastgrpo": secs([7, 7, 7]), "tlt": secs([6, 6, 6]), "aware": secs([4, 4.2, 4.4]),
            "static_2_2_4": secs([4.8, 4.8, 4.8]), "off_unshared_prefill": secs([13, 13, 13])}
    runs["aware"] = [dict(r, ahead_s=a, wait_s=w, decode_steps=n, static_steps=k, pad_row_share=pr, pad_kv_share=pk,
                          policy_s=p)
                     for r, a, w, n, k, pr, pk, p in zip(runs["aware"], [0.02, 0.01, 0.03], [0.5, 0.7, 0.6], [100, 80, 90],
                                                         [90, 80, 45], [0.1, 0.3, 0.2], [0.4, 0.2, 0.3], [0.2, 0.21, 0.11])]
    g = grpo_summary(runs, ("off", "static", "fastgrpo", "tlt", "static_2_2_4"))
    assert g["aware_ahead_s"] == 0.02 and g["aware_wait_s"] == 0.6  # medians of its calls
    # its own host time: median 0.2 s; shares 0.2 / 4 = 0.05, 0.21 / 4.2 = 0.05, 0.11 / 4.4 = 0.025: median 0.05
    assert g["aware_policy_s"] == 0.2 and g["aware_policy_share"] == pytest.approx(0.05)
    # static steps 90 of 100, 80 of 80, 45 of 90: median 0.9; the shares' medians 0.2 and 0.3
    assert g["padding"]["aware"] == pytest.approx({"static_share": 0.9, "pad_row_share": 0.2, "pad_kv_share": 0.3})
    assert g["padding"]["off"] == {"static_share": 0.0, "pad_row_share": 0.0, "pad_kv_share": 0.0}  # none reported
    assert g["all_s"]["static"] == 5 and g["all_s"]["static_aa"] == 5.0 and g["aa_ratio"] == pytest.approx(1.0)
    assert g["best_fixed"] == "static_2_2_4" and g["best_fixed_s"] == 4.8 and g["static_best"] == "static_2_2_4"
    assert g["aware_vs_best"] == pytest.approx(4.8 / 4.2) and g["aware_vs_off"] == pytest.approx(11 / 4.2)
    assert g["se_s"]["off"] == pytest.approx(1 / 3**0.5) and g["se_s"]["tlt"] == 0  # s = 1 (deviations -1, 1, 0)
    assert g["aware_s"] == 4.2 and g["off_unshared_prefill_s"] == 13


def test_a_step_cell_takes_the_full_steps_of_its_shape_after_the_warm_up():
    def call(running, config, emitted, ms):
        return {"trace": {"running": running, "config": config, "emitted": emitted, "ms": ms}, "captures": 1,
                "replays": 4}

    calls = [call([4] * 6 + [2], ["d2k2n4"] * 4 + ["off", "d2k2n4", "d2k2n4"], [8, 8, 12, 8, 4, 10, 6],
                  [90.0, 9.0, 2.0, 4.0, 1.0, 3.0, 3.0]),
             call([4] * 5, ["d2k2n4"] * 5, [8, 8, 8, 8, 8], [50.0, 5.0, 6.0, 6.0, 7.0]),
             call([4, 4], ["d2k2n4"] * 2, [8, 8], [60.0, 7.0])]  # over within its warm-up: no step kept
    cell = step_cells(4, "d2k2n4", "static", calls, warmup=2)
    # call 1 keeps steps 3, 4 and 6 (2, 4, 3 ms; 12 + 8 + 10 tokens over 3 x 4 rows): median 3 ms, 2.5 tokens a
    # row; the plain fallback (5) and the step at 2 rows (7, batch bucket 2, not 4) are left out. Call 2: steps
    # 3-5 (6, 6, 7 ms; 24 tokens over 12 rows): median 6 ms, 2 tokens a row
    assert cell["steps"] == 6 and cell["calls"] == 3 and cell["step_ms"]["n"] == 2
    assert cell["step_ms"]["median"] == pytest.approx(4.5)
    assert cell["step_ms"]["se"] == pytest.approx(1.5)  # two values 3 and 6: s = 2.12, / sqrt(2)
    assert cell["tokens_per_row_step"] == pytest.approx(2.25) and cell["captures"] == 3 and cell["replays"] == 12
    assert cell["tok_s"] == pytest.approx(4 * 2.25 / 4.5e-3)
    # at 256 rows, a step at 200 still fills the 256 bucket (the ladder's entry below is 192); one at 192 does not
    wide = step_cells(256, "plain", "eager", [call([256, 256, 256, 200, 192], ["off"] * 5, [256, 256, 256, 200, 192],
                                                    [9.0, 9.0, 1.0, 2.0, 3.0])], warmup=2)
    assert wide["steps"] == 2 and wide["step_ms"]["median"] == pytest.approx(1.5)


def test_the_step_shapes_are_the_grpo_batch_trees_and_aware_widest():
    from fastgrpo.bench.rollout import STATIC_SWEEP
    from fastgrpo.speculation.policy import candidate_configs

    assert [(c.depth, c.topk, c.num_verify) for c in STATIC_SWEEP] == list(STEP_SHAPES[:-1])
    widest = max(candidate_configs(), key=lambda c: (c.depth, c.topk, c.num_verify if c.num_verify <= 48 else 0))
    assert STEP_SHAPES[-1] == (widest.depth, widest.topk, 48)


def test_the_simulator_fit_recovers_the_constants_that_made_the_steps():
    """Steps priced by a roofline with known constants (efficiencies scaled alike, overheads unlike the
    defaults): the fit finds them (the target's and the step's overheads as their sum) and prices every step
    exactly, also with a level held out; before it, the default constants are off by what they differ."""
    import dataclasses

    from fastgrpo.bench.gpu_check.fit import StepPoint, fit_overheads, price
    from fastgrpo.speculation.roofline import H100, ModelShape
    from fastgrpo.speculation.spec import SpecConfig

    shape = ModelShape("policy", 24, 1024, 4096, 16, 8, 296)
    true = dataclasses.replace(H100, bw_eff=0.4, flops_eff=0.3, target_overhead_s=1.0e-3, step_overhead_s=0.5e-3,
                               spec_overhead_s=0.8e-3, draft_overhead_s=0.2e-3)
    points = []
    for B in (1, 4, 16, 64, 256):
        for c in (None, SpecConfig(2, 2, 4), SpecConfig(4, 4, 12), SpecConfig(6, 8, 48)):
            p = StepPoint(c, B, 16, 80.0, 1.0, B)
            points.append(dataclasses.replace(p, seconds=price(true, shape, p)))
    fit = fit_overheads(H100, shape, points)
    after = fit["after"]
    assert after["bw_eff"] == pytest.approx(0.4) and after["flops_eff"] == pytest.approx(0.3)
    assert after["target_overhead_s"] + after["step_overhead_s"] == pytest.approx(1.5e-3)
    assert after["spec_overhead_s"] == pytest.approx(0.8e-3) and after["draft_overhead_s"] == pytest.approx(0.2e-3)
    assert fit["error_after"]["max_abs_error"] < 1e-9 and fit["error_held_out"]["max_abs_error"] < 1e-9
    assert fit["before"] == {"bw_eff": 0.8, "flops_eff": 0.6, "target_overhead_s": 0.4e-3, "draft_overhead_s": 0.1e-3,
                             "step_overhead_s": 0.3e-3, "spec_overhead_s": 0.3e-3}
    # a plain step at batch 1: 2 bytes x (24 layers x (1024 x (1024 + 2 x 512) + 1024 x 1024 attention +
    # 3 x 1024 x 4096 MLP) + 296 x 1024 head parameters) + the KV of 80 tokens (24 layers x 2 x 8 heads x 64 x
    # 2 bytes each) over 80% of 3.35 TB/s, + 0.7 ms of overheads
    one = next(p for p in fit["points"] if p["level"] == 1 and p["shape"] == "plain")
    megabytes = (2 * (24 * (3_145_728 + 12_582_912) + 296 * 1024) + 80 * 24 * 2 * 8 * 64 * 2) / 1e6
    assert one["before_ms"] == pytest.approx(megabytes / (0.8 * 3350) + 0.7, rel=1e-6)
    assert one["measured_ms"] == pytest.approx(megabytes / (0.4 * 3350) + 1.5, rel=1e-6)


def test_a_policy_state_is_recorded_whatever_it_holds():
    from fastgrpo.speculation.spec import SpecConfig

    class Curve:
        def to_json(self):
            return {"target_s": {1: 0.5}}

    class Broken:
        def to_json(self):
            raise RuntimeError("no")

    class Acceptance:
        def __init__(self):
            self.counts = {SpecConfig(2, 2, 4): 3}

        def alpha(self, d):
            return 1 / d

    class Policy:
        name = "aware"

        def __init__(self):
            self.costs, self.broken, self.acceptance = Curve(), Broken(), Acceptance()
            self.correction = {("spec", 4): 1.5}
            self.candidates = [SpecConfig(4, 4, 12)]
            self.seen = {3, 1}
            self._private = object()

    state = policy_state(Policy())
    assert state["costs"] == {"target_s": {"1": 0.5}} and state["broken"].startswith("to_json failed: RuntimeError")
    assert state["correction"] == {"spec/4": 1.5} and state["candidates"] == ["d4k4n12"] and state["seen"] == [1, 3]
    assert state["acceptance"] == {"counts": {"d2k2n4": 3}} and "_private" not in state
    assert state["acceptance_alpha"] == pytest.approx([1 / d for d in range(1, 9)])
    assert json.loads(dumps(state)) == state


def test_results_are_written_with_lists_of_values_on_one_line():
    x = {"trace": {"ms": [1.5, 2.0], "config": ["off", "d4k4n12"]}, "rows": [{"a": 1}, {"b": [1, 2]}], "e": []}
    text = dumps(x)
    assert json.loads(text) == x and '"ms": [1.5, 2.0]' in text and '"b": [1, 2]' in text
