"""The GPU check's targets read from a run's results (fastgrpo/bench/gpu_check/targets.py), against
verdicts worked out by hand."""

import math

import pytest

from fastgrpo.bench.gpu_check import markdown
from fastgrpo.bench.gpu_check.targets import aware_verdict, ratio_se, targets


def ok(data: dict) -> dict:
    return {"status": "ok", "seconds": 1.0, "data": data}


def level(B: int, aware: float, aware_se: float, best: float, best_se: float, aa: float) -> dict:
    return {"concurrency": B, "aware_tok_s": aware, "aware_tok_s_se": aware_se, "static_tok_s": best,
            "static_tok_s_se": best_se, "best_fixed": "static", "aware_vs_best": aware / best, "aa_ratio": aa, "aware_runs": 3}


RESULT = {"stages": {
    "decode_bound": ok({"batches": {"1": {"step_ms": 3.0}, "16": {"step_ms": 3.5}}}),
    "step_bench": ok({"cells": [
        {"level": 1, "shape": "plain", "engine": "eager", "step_ms": {"median": 9.0}},
        {"level": 1, "shape": "plain", "engine": "static", "step_ms": {"median": 2.2}},
        {"level": 4, "shape": "plain", "engine": "static", "step_ms": {"median": 1.0}},  # (not batch 1)
        {"level": 1, "shape": "d4k4n12", "engine": "static", "step_ms": {"median": 1.5}}]}),  # (not plain)
    "decode_8b": ok({"full_shape": True, "batches": {"1": {"step_vs_bound": 1.7}},
                     "fused": {"batches": {"1": {"step_vs_bound": 1.4}}}}),
    "simulator_fit": ok({"error_after": {"max_abs_error": 0.25}, "error_held_out": {"max_abs_error": 0.3}}),
    "rollout": ok({"sweep": [level(4, 95, 2, 100, 2, 1.01), level(16, 90, 0.5, 100, 0.5, 1.005),
                             level(64, 99, 1, 100, 1, 0.99)],
                   "levels_skipped_for_time": [256],
                   "grpo_batch": {"best_fixed": "static", "all_s": {"aware": 4.0, "static": 4.1, "off": 9.0},
                                  "se_s": {"aware": 0.1, "static": 0.1}, "aware_vs_best": 4.1 / 4.0,
                                  "aware_vs_off": 9.0 / 4.0, "aa_ratio": 1.02, "runs": {"aware": 5}}})}}


def test_the_standard_error_of_a_ratio_adds_the_sides_relative_errors_in_quadrature():
    # 95 / 100, 2% each side: 0.95 x sqrt(0.02^2 + (2/95)^2)... by hand: 2/95 = 0.021053, 2/100 = 0.02
    assert ratio_se(0.95, 95, 2, 100, 2) == pytest.approx(0.95 * math.sqrt(0.021053**2 + 0.02**2), rel=1e-4)
    assert ratio_se(1.2, 6, None, 5, 0.0) == 0.0  # no repetitions' spread on either side


def test_aware_below_its_line_by_less_than_the_runs_noise_is_within_noise_not_failed():
    assert aware_verdict(0.97, 0.0, 1.0) == "met"
    assert aware_verdict(0.95, 0.011, 1.0) == "within noise"  # 0.95 + 2 x 0.011 = 0.972
    assert aware_verdict(0.95, 0.009, 1.0) == "not met"  # 0.95 + 0.018 = 0.968
    assert aware_verdict(0.95, 0.0, 1.03) == "within noise"  # the A/A pair read 3% apart
    assert aware_verdict(0.95, 0.0, 0.985) == "not met"  # 0.95 + 0.015 = 0.965


def test_every_target_is_read_from_its_stage_with_its_verdict():
    got = {t.target: (t.measured, t.verdict) for t in targets(RESULT)}
    # the 8B shape: the fused step's 1.4x is the better of the two, within 1.5x
    assert got["the Llama-3.1-8B shape's decode step at batch 1 <= 1.5x its bandwidth bound"] == ("1.40x (fused)", "met")
    # the plain step at batch 1: step_bench's static 2.2 ms beats decode_bound's 3.0 (the tree and 4 rows aside)
    assert got["the check's policy's plain step at 1 running <= 2.5 ms"] == ("2.200 ms (step_bench static)", "met")
    line = "aware >= 0.97x the best fixed choice at {} running"
    # 4 running: 0.95, se 0.95 x sqrt((2/95)^2 + (2/100)^2) = 0.0276, 0.95 + 0.055 >= 0.97
    assert got[line.format(4)] == ("0.950x static (se 0.028, A/A 1.010; 3 repetitions)", "within noise")
    # 16 running: 0.90, se 0.90 x sqrt((0.5/90)^2 + (0.5/100)^2) = 0.0067; noise 0.013 (> |1 - 1.005|)
    assert got[line.format(16)] == ("0.900x static (se 0.007, A/A 1.005; 3 repetitions)", "not met")
    assert got[line.format(64)][1] == "met" and got[line.format(256)] == ("skipped for time", "not measured")
    # 4.1 / 4.0 = 1.025; se 1.025 x sqrt((0.1/4)^2 + (0.1/4.1)^2) = 0.0358
    assert got["aware >= 0.97x the best fixed choice on the GRPO batch"] == (
        "1.025x static (se 0.036, A/A 1.020; 5 repetitions)", "met")
    assert got["aware >= 2x plain decoding on the GRPO batch"] == ("2.25x", "met")
    assert got["the fitted simulator within 20% of the measured steps"] == (
        "largest abs error 25.0% (30.0% each level held out)", "not met")


def test_a_run_that_finished_no_stage_lists_every_target_unmeasured_in_its_report():
    failed = {"status": "failed", "seconds": 0.5, "error": "RuntimeError: no device"}
    result = {"meta": {"size": "test", "device": "cpu", "dtype": "float32", "command": "x", "date": "d"},
              "stages": {name: dict(failed) for name in ("decode_bound", "decode_8b", "rollout", "simulator_fit")}}
    assert {t.verdict for t in targets(result)} == {"not measured"}
    text = markdown(result)
    assert "| target | measured | verdict |" in text and "| no rollout stage | not measured |" in text
    # a scaled-down 8B structure (the test size) is no reading of the target
    small = {"stages": {"decode_8b": ok({"full_shape": False, "batches": {"1": {"step_vs_bound": 1.2}}})}}
    assert targets(small)[0].verdict == "not measured" and "scaled-down" in targets(small)[0].measured
