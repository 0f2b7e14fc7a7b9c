"""The task's reward (`task.reward`): the built-in math reward as before, and the user's own
`module:function` in `fastgrpo train` and `fastgrpo eval`; a reward that cannot be imported, raises,
returns a non-number or hangs past `task.reward_timeout_s` is a clear error naming the function."""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid

import pytest

from fastgrpo.cli import main
from fastgrpo.config import ConfigError, TaskConfig, load_config
from fastgrpo.tasks.problems import Problem
from fastgrpo.tasks.rewards import RewardError, load_reward, math_reward
from tests.conftest import tiny_overrides
from tests.test_train import history

REWARDS = '''
import math
import time

from fastgrpo.tasks.rewards import score

CALLS = []


def quarter(text, problem):
    CALLS.append((text, problem))
    return 0.25


def boxed_or_not(text, problem):
    return 1 if "\\\\boxed{" in text else 0


def via_math_verify(text, problem):  # math-verify's own signal timeouts, inside ours
    return score(text, problem.answer, timeout_seconds=5)


def boom(text, problem):
    return 1 / 0


def word(text, problem):
    return "1.0"


def nan(text, problem):
    return math.nan


def hang(text, problem):
    time.sleep(60)
    return 1.0


def swallow(text, problem):  # a reward that catches every Exception still stops at the timeout
    while True:
        try:
            time.sleep(60)
        except Exception:
            pass


NOT_A_FUNCTION = 3
'''


def _config(tmp_path) -> str:
    """A config file of its own: the repository's default is the demonstration task's (with a draft)."""
    config = tmp_path / "config.yaml"
    config.write_text("seed: 0\n")
    return str(config)


@pytest.fixture
def module(tmp_path, monkeypatch) -> str:
    """A reward module written into tmp_path and put on sys.path, under a name of its own."""
    name = f"user_rewards_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _reward(spec: str, timeout_s: float = 2.0):
    return load_reward(TaskConfig(reward=spec, reward_timeout_s=timeout_s))


PROBLEM = Problem("Compute left to right: 3 + 4", "7", "3 + 4 = 7\nThe answer is \\boxed{7}.")


def test_the_built_in_math_reward_is_the_boxed_answer_with_step_credit_in_training():
    reward = load_reward(TaskConfig(step_credit=0.5))
    assert reward == math_reward(2.0, 0.5) and reward.name == "math"
    assert reward.for_training("3 + 4 = 7\nThe answer is \\boxed{7}.", PROBLEM) == 1.0
    assert reward.for_training("3 + 4 = 7\nThe answer is \\boxed{8}.", PROBLEM) == 0.5  # one step of one right
    assert reward.for_eval("3 + 4 = 7\nThe answer is \\boxed{8}.", PROBLEM) == 0.0  # eval: the answer alone
    assert reward.for_training("no answer", PROBLEM) == 0.0


def test_a_module_function_reward_is_called_with_the_text_and_the_problem(module):
    import importlib

    reward = _reward(f"{module}:quarter")
    assert reward.for_training("some text", PROBLEM) == reward.for_eval("x", PROBLEM) == 0.25
    assert importlib.import_module(module).CALLS == [("some text", PROBLEM), ("x", PROBLEM)]
    assert _reward(f"{module}:boxed_or_not").for_training("\\boxed{1}", PROBLEM) == 1.0  # an int is a number
    before = signal.getsignal(signal.SIGALRM)
    assert _reward(f"{module}:via_math_verify", timeout_s=1.0).for_eval("\\boxed{7}", PROBLEM) == 1.0
    assert signal.getsignal(signal.SIGALRM) == before  # left as it was


@pytest.mark.parametrize("spec, message", [
    ("bogus", "task.reward must be a built-in reward (math) or module:function, got 'bogus'"),
    ("a.b:c:d", "task.reward must be"),
])
def test_a_malformed_reward_is_a_config_error_naming_the_key(spec, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, [f"task.reward={spec}"])
    with pytest.raises(ConfigError, match="task.step_credit applies to task.reward=math only"):
        load_config(None, ["task.reward=m:f", "task.step_credit=0.5"])


def test_a_reward_that_cannot_be_imported_names_the_function(module):
    with pytest.raises(ConfigError, match=r"task.reward=no_such_module_xyz:f: cannot import module "
                                          r"'no_such_module_xyz' \(ModuleNotFoundError"):
        _reward("no_such_module_xyz:f")
    with pytest.raises(ConfigError, match=rf"task.reward={module}:missing: module '{module}' .* has no function "
                                          r"'missing'"):
        _reward(f"{module}:missing")
    with pytest.raises(ConfigError, match=r"has no function 'NOT_A_FUNCTION' \(it is a int\)"):
        _reward(f"{module}:NOT_A_FUNCTION")


@pytest.mark.parametrize("fn, message", [
    ("boom", "raised ZeroDivisionError: division by zero"),
    ("word", r"returned '1.0' \(str\), not a finite number"),
    ("nan", r"returned nan \(float\), not a finite number"),
    ("hang", r"ran past task.reward_timeout_s=0.3 s"),
    ("swallow", r"ran past task.reward_timeout_s=0.3 s"),
])
def test_a_bad_reward_is_an_error_naming_the_function(module, fn, message):
    reward = _reward(f"{module}:{fn}", timeout_s=0.3)
    before = signal.getsignal(signal.SIGALRM)
    t0 = time.perf_counter()
    with pytest.raises(RewardError, match=f"reward function {module}:{fn} {message}"):
        reward.for_training("text", PROBLEM)
    assert time.perf_counter() - t0 < 5  # the timeout held
    assert signal.getsignal(signal.SIGALRM) == before
    # off the main thread (no signals there) the same errors
    errors = []
    worker = threading.Thread(target=lambda: errors.append(pytest.raises(RewardError, reward.for_eval, "text", PROBLEM)))
    worker.start()
    worker.join(10)
    assert errors and f"reward function {module}:{fn}" in str(errors[0].value)


def test_fastgrpo_train_and_eval_use_a_module_function_reward(tmp_path, tiny_policy, module, capsys):
    """Rollout's rewards and the evals are the function's: it gives 0.25 to every answer."""
    import importlib

    calls = importlib.import_module(module).CALLS
    args = tiny_overrides(tmp_path, tiny_policy, **{"task.reward": f"{module}:quarter", "grpo.steps": 1,
                                                    "eval.at_start": "false"})
    assert main(["train", "--config", _config(tmp_path), *args]) == 0
    assert history(tmp_path / "run", "reward_mean") == {1: 0.25}
    assert history(tmp_path / "run", "accuracy") == {1: 0.0}
    assert history(tmp_path / "run", "eval/mean_accuracy") == {1: 0.25}
    assert history(tmp_path / "run", "eval/pass_at_2") == {1: 0.25}
    # one step of 4 prompts x 4 samples, then the final eval: 8 problems greedy once and sampled twice
    assert len(calls) == 4 * 4 + 8 * 3 and all(isinstance(p, Problem) for _, p in calls)
    capsys.readouterr()

    assert main(["eval", "--config", _config(tmp_path), f"model.path={tiny_policy}", "model.size=test",
                 "model.max_context=160", "task.eval_size=4", "task.max_steps=6", "eval.samples=2",
                 "rollout.max_new_tokens=48", f"task.reward={module}:quarter"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["problems"] == 4 and out["mean_accuracy"] == out["pass1_greedy"] == out["pass_at_2"] == 0.25


def test_fastgrpo_train_and_eval_stop_on_a_bad_reward_naming_it(tmp_path, tiny_policy, module, capsys):
    args = ["--config", _config(tmp_path), *tiny_overrides(tmp_path, tiny_policy, **{"grpo.steps": 1,
                                                                                    "eval.at_start": "false"})]
    # not importable: before any work
    assert main(["train", *args, "task.reward=no_such_module_xyz:score"]) == 2
    assert "config error: task.reward=no_such_module_xyz:score: cannot import module" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    # raises in rollout
    assert main(["train", *args, f"task.reward={module}:boom"]) == 1
    assert f"error: reward function {module}:boom raised ZeroDivisionError" in capsys.readouterr().err
    # a string, in eval
    evals = ["--config", _config(tmp_path), f"model.path={tiny_policy}", "model.size=test", "model.max_context=160", "task.eval_size=2",
             "task.max_steps=6", "eval.samples=1", "rollout.max_new_tokens=16"]
    assert main(["eval", *evals, f"task.reward={module}:word"]) == 1
    assert f"error: reward function {module}:word returned '1.0' (str), not a finite number" in capsys.readouterr().err
    # hangs, in eval
    t0 = time.perf_counter()
    assert main(["eval", *evals, f"task.reward={module}:hang", "task.reward_timeout_s=0.5"]) == 1
    assert f"error: reward function {module}:hang ran past task.reward_timeout_s=0.5 s" in capsys.readouterr().err
    assert time.perf_counter() - t0 < 30
