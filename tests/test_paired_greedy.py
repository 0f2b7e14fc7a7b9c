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
    standard error, all computed here from each answer's recorded score, paired by problem. (The test
    policy answers few problems right, so the score here is a stand-in that depends on the answer's
    text: the pairing, not the arithmetic, is under test.)"""
    import fastgrpo.tasks.rewards as rewards
    from fastgrpo.models.policy import load_policy, new_policy
    from fastgrpo.models.tokenizer import load_tokenizer

    scored = []  # (gold answer, score) of every answer, in the order the tool scores them

    def stand_in(text, answer, timeout_s):
        scored.append((answer, float(len(text) % 2 == 0)))
        return scored[-1][1]

    monkeypatch.setattr(rewards, "score", stand_in)
    untrained = tmp_path / "untrained"
    new_policy(load_policy(tiny_policy).config, seed=1).save_pretrained(untrained)
    load_tokenizer(tiny_policy).save_pretrained(untrained)
    overrides = tiny_overrides(tmp_path, tiny_policy, **{"task.eval_size": 16})
    result = _tool().paired(None, [str(tiny_policy), str(untrained)], overrides)
    same, other = result["policies"]
    n, start = result["problems"], result["start"]
    assert n == 16 and len(scored) == 3 * n  # the start, then each policy, one greedy answer a problem
    blocks = [scored[i * n: (i + 1) * n] for i in range(3)]
    assert [a for a, _ in blocks[0]] == [a for a, _ in blocks[1]] == [a for a, _ in blocks[2]]  # the same problems
    first, again, later = ([v for _, v in b] for b in blocks)
    assert again == first  # the start scored twice: greedy, so the same answers
    d = [b - a for a, b in zip(first, later)]  # per problem: +1 gained, -1 lost
    assert start == pytest.approx(sum(first) / n)
    assert same["change"] == 0 and same["gained"] == same["lost"] == 0 and same["end"] == start
    assert (other["gained"], other["lost"]) == (d.count(1.0), d.count(-1.0))
    assert other["gained"] + other["lost"] > 0  # the untrained policy answers otherwise
    assert other["end"] == pytest.approx(sum(later) / n)
    mean = sum(d) / n
    assert other["change"] == pytest.approx(mean)
    assert other["change_se"] == pytest.approx((sum((x - mean) ** 2 for x in d) / (n - 1) / n) ** 0.5)
