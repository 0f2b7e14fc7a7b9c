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


def test_paired_change_counts_what_each_problem_gained_and_lost(tmp_path, tiny_policy):
    """The start against itself changes nothing; against an untrained policy of the same shape (which
    answers nothing right) it loses exactly the problems the start got right."""
    from fastgrpo.models.policy import load_policy, new_policy
    from fastgrpo.models.tokenizer import load_tokenizer

    untrained = tmp_path / "untrained"
    new_policy(load_policy(tiny_policy).config, seed=1).save_pretrained(untrained)
    load_tokenizer(tiny_policy).save_pretrained(untrained)
    overrides = tiny_overrides(tmp_path, tiny_policy, **{"task.eval_size": 16})
    result = _tool().paired(None, [str(tiny_policy), str(untrained)], overrides)
    same, other = result["policies"]
    n, start = result["problems"], result["start"]
    assert n == 16 and start > 0  # the trained test policy gets some right
    assert same["change"] == 0 and same["gained"] == same["lost"] == 0 and same["end"] == start
    assert other["end"] == 0 and other["gained"] == 0 and other["lost"] == round(start * n)
    assert other["change"] == pytest.approx(-start) and other["change_se"] > 0
