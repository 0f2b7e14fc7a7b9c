"""tools/paired_greedy.py: the paired change in greedy pass@1 between a start and later policies."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.conftest import tiny_overrides

TOOL = Path(__file__).resolve().parents[1] / "tools" / "paired_greedy.py"


def _tool():
    spec = importlib.util.spec_from_file_location("paired_greedy", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_paired_change_counts_what_each_problem_gained_and_lost(tmp_path, tiny_policy, monkeypatch):
    """The start against itself changes nothing; against an untrained policy of the same shape the
    change is what the problems gained minus what they lost, over the problems, with its paired
    standard error. (The test policy answers few problems right, so the score here is a stand-in
    that depends on the answer's text: the pairing, not the arithmetic, is under test.)"""
    import fastgrpo.tasks.rewards as rewards
    from fastgrpo.models.policy import load_policy, new_policy
    from fastgrpo.models.tokenizer import load_tokenizer

    monkeypatch.setattr(rewards, "score", lambda text, answer, timeout_s: float(len(text) % 2 == 0))
    untrained = tmp_path / "untrained"
    new_policy(load_policy(tiny_policy).config, seed=1).save_pretrained(untrained)
    load_tokenizer(tiny_policy).save_pretrained(untrained)
    overrides = tiny_overrides(tmp_path, tiny_policy, **{"task.eval_size": 16})
    result = _tool().paired(None, [str(tiny_policy), str(untrained)], overrides)
    same, other = result["policies"]
    n, start = result["problems"], result["start"]
    assert n == 16
    assert same["change"] == 0 and same["gained"] == same["lost"] == 0 and same["end"] == start
    assert other["gained"] + other["lost"] > 0  # the untrained policy answers otherwise
    assert other["change"] == pytest.approx((other["gained"] - other["lost"]) / n)
    assert other["end"] == pytest.approx(start + other["change"]) and 0 <= other["end"] <= 1
    d = [1.0] * other["gained"] + [-1.0] * other["lost"] + [0.0] * (n - other["gained"] - other["lost"])
    mean = sum(d) / n
    assert other["change_se"] == pytest.approx((sum((x - mean) ** 2 for x in d) / (n - 1) / n) ** 0.5)
