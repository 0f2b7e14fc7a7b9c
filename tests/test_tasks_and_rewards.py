"""The reasoning task, the dataset loader and the verifier."""

import json
import re
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fastgrpo.tasks.arithmetic import arithmetic_splits, generate_problems
from fastgrpo.tasks.datasets import DatasetError, load_problems
from fastgrpo.tasks.rewards import extract_answer, score, step_credit


def test_solutions_are_correct_and_values_bounded():
    for p in generate_problems(500, seed=1, max_value=50):
        tokens = p.prompt.removeprefix("Compute left to right: ").split()
        value = int(tokens[0])
        lines = p.solution.splitlines()
        assert len(lines) == (len(tokens) - 1) // 2 + 1
        for (op, operand), line in zip(zip(tokens[1::2], tokens[2::2]), lines):
            new = {"+": value + int(operand), "-": value - int(operand), "*": value * int(operand)}[op]
            assert line == f"{value} {op} {operand} = {new}"
            assert 0 <= new <= 50
            value = new
        assert lines[-1] == f"The answer is \\boxed{{{value}}}." and p.answer == str(value)


def test_long_tail_of_steps_and_determinism():
    steps = Counter(p.solution.count("\n") for p in generate_problems(5000, seed=0))
    assert sum(v for k, v in steps.items() if k <= 4) > 0.6 * 5000
    assert sum(v for k, v in steps.items() if k >= 15) >= 20
    assert generate_problems(20, seed=3) == generate_problems(20, seed=3)
    assert generate_problems(20, seed=3) != generate_problems(20, seed=4)
    train, evals, validation = arithmetic_splits(2000, 200, seed=0, validation_size=100)
    assert len(train) == 2000 and len(evals) == 200 and len(validation) == 100
    assert not {p.prompt for p in train} & {p.prompt for p in evals + validation}
    assert {p.prompt for p in validation} != {p.prompt for p in evals}
    with pytest.raises(ValueError, match="tail"):
        generate_problems(3, seed=0, tail=0.0)


@pytest.mark.parametrize("completion, expected", [
    ("7 + 5 = 12\nThe answer is \\boxed{12}.", 1.0),
    ("\\boxed{12.0}", 1.0),
    ("The answer is \\boxed{13}.", 0.0),
    ("The answer is 12.", 0.0),  # not boxed: the format is part of the task
    ("\\boxed{", 0.0),
    ("", 0.0),
    ("\\boxed{}", 0.0),
    ("\\boxed{\\frac{1}{0}}", 0.0),
    ("}{" * 5000 + "\\boxed{" * 300, 0.0),
    ("\\boxed{11} wait, \\boxed{12}", 1.0),  # the last boxed answer counts
])
def test_score(completion, expected):
    assert score(completion, "12") == expected


@pytest.mark.parametrize("gold, right, wrong", [
    ("\\sqrt{2}", "\\sqrt{2}", "\\sqrt{3}"),  # a MATH answer as the dataset loader reduces it: bare LaTeX
    ("x^2+1", "1+x^2", "x^2-1"),
    ("\\frac{1}{2}", "0.5", "\\frac{1}{3}"),
    ("\\pi", "\\pi", "3"),
    ("1,000", "1000", "100"),
    ("$\\frac12$", "\\frac{1}{2}", "2"),  # delimited gold answers are read as they are
    ("\\boxed{7}", "7", "8"),
])
def test_score_reads_a_bare_latex_gold_answer(gold, right, wrong):
    assert score(f"so \\boxed{{{right}}}", gold) == 1.0
    assert score(f"so \\boxed{{{wrong}}}", gold) == 0.0


def test_step_credit_counts_the_steps_right_before_the_first_mistake():
    solution = "3 + 4 = 7\n7 * 2 = 14\n14 - 5 = 9\n9 + 1 = 10\nThe answer is \\boxed{10}."
    assert step_credit(solution, solution) == 1.0
    assert step_credit("3 + 4 = 7\n7 * 2 = 14\n14 - 5 = 8\n8 + 1 = 9\nThe answer is \\boxed{9}.", solution) == 0.5
    assert step_credit("3 + 4 = 7\n7 * 2 = 15\n14 - 5 = 9\n9 + 1 = 10", solution) == 0.25  # later steps do not count
    assert step_credit(" 3  +  4 = 7 \n\n", solution) == 0.25  # spacing is not a mistake, an empty line is
    assert step_credit("The answer is \\boxed{10}.", solution) == 0.0
    assert step_credit("anything", "The answer is \\boxed{10}.") == 0.0  # no steps to credit


def test_extract_answer_nested_braces():
    assert extract_answer("x \\boxed{\\frac{1}{2}} y") == "\\frac{1}{2}"
    assert extract_answer("no answer") is None
    assert extract_answer("\\boxed{1} \\boxed{2") == "1"  # an unclosed last box falls back to the previous


def test_jsonl_loader_counts_malformed_rows(tmp_path, caplog):
    f = tmp_path / "d.jsonl"
    rows = [json.dumps({"prompt": "2+2?", "answer": "#### 4"}), json.dumps({"prompt": "3*3?", "answer": 9}),
            "{not json", json.dumps({"prompt": "", "answer": "1"}), json.dumps({"answer": "1"}),
            json.dumps([1, 2]), "", json.dumps({"prompt": "x", "answer": None, "extra": 1})]
    f.write_text("\n".join(rows))
    with caplog.at_level("WARNING"):
        problems, report = load_problems(f)
    assert [(p.prompt, p.answer) for p in problems] == [("2+2?", "4"), ("3*3?", "9")]
    assert (report.rows, report.used, report.malformed) == (7, 2, 5)
    assert "skipped 5 malformed" in caplog.text


def test_parquet_loader(tmp_path):
    f = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["a?", "b?"], "answer": ["1", "Natalia sold 48 #### 72"]}), f)
    problems, report = load_problems(f)
    assert [p.answer for p in problems] == ["1", "72"] and report.malformed == 0


def test_loader_errors(tmp_path):
    with pytest.raises(DatasetError, match=re.escape(str(tmp_path / "missing.jsonl"))):
        load_problems(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"q": 1}\n{"prompt": 3, "answer": 1}\n')
    with pytest.raises(DatasetError, match="no usable rows"):
        load_problems(bad)
    other = tmp_path / "d.csv"
    other.write_text("prompt,answer\n")
    with pytest.raises(DatasetError, match=re.escape(".jsonl, .json, .parquet, .arrow")):
        load_problems(other)
