"""The demonstration task of `make train`: a slipping teacher's SFT corpus, and a clear
error when the policy has not been built."""

from __future__ import annotations

from fastgrpo.cli import main
from fastgrpo.config import load_config
from fastgrpo.tasks.arithmetic import arithmetic_splits, slip
from fastgrpo.tasks.rewards import score
from fastgrpo.tasks.source import load_task


def test_slipping_teacher_drops_the_box_at_its_rate_and_nothing_else():
    exact, test, validation = arithmetic_splits(4000, 200, 0, validation_size=100, max_steps=6)
    slipped, test2, validation2 = arithmetic_splits(4000, 200, 0, validation_size=100, max_steps=6, slip_rate=0.4)
    assert [p.prompt for p in slipped] == [p.prompt for p in exact]  # the same problems
    assert [p.answer for p in slipped] == [p.answer for p in exact]
    assert test2 == test and validation2 == validation  # held-out sets untouched (exact solutions)
    unboxed = [(a, b) for a, b in zip(exact, slipped) if a.solution != b.solution]
    assert abs(len(unboxed) / len(exact) - 0.4) < 0.03
    for a, b in unboxed:
        # the same lines of arithmetic, the right value, only the box missing: reward 0
        assert a.solution.splitlines()[:-1] == b.solution.splitlines()[:-1]
        assert b.solution.splitlines()[-1] == f"The answer is {a.answer}."
        assert score(a.solution, a.answer) == 1.0 and score(b.solution, b.answer) == 0.0
    assert all(score(p.solution, p.answer) == 1.0 for p in test)
    held_out = {p.prompt for p in test + validation}
    assert not any(p.prompt in held_out for p in slipped)  # no training prompt is a held-out one
    assert slip(exact, 0.0, 0) is exact


def test_default_config_is_the_demonstration_and_the_plain_task_is_kept():
    demo = load_config("configs/tiny_cpu.yaml", [])
    plain = load_config("configs/tiny_cpu_plain.yaml", [])
    assert demo.task.slip_rate > 0 and plain.task.slip_rate == 0
    assert demo.model.path != plain.model.path  # two tasks, two policies
    assert demo.task.max_steps <= demo.sft.max_problem_steps  # SFT sees every held-out length
    train, _ = load_task(demo.task)
    assert 0.3 < sum("boxed" not in p.solution for p in train) / len(train) < 0.5


def test_train_without_a_policy_says_how_to_build_one(tmp_path, capsys):
    status = main(["train", "--config", "configs/tiny_cpu.yaml", f"model.path={tmp_path / 'missing'}",
                   f"run_dir={tmp_path / 'run'}", "tracking.enabled=false"])
    err = capsys.readouterr().err
    assert status == 1
    assert "no policy at model.path=" in err and "fastgrpo sft" in err and "make policy" in err
    assert "Traceback" not in err
