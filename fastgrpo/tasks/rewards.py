"""The task's reward (`task.reward`, `Reward`): the built-in verifier, math-verify on the model's boxed
final answer with partial credit for the worked solution's steps (a denser training signal than the
answer alone), or the user's own `module:function`, called with a timeout and checked."""

from __future__ import annotations

import importlib
import logging
import math
import numbers
import re
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

from math_verify import parse, verify
from math_verify.errors import TimeoutException

from fastgrpo.config import BUILTIN_REWARDS, ConfigError, TaskConfig
from fastgrpo.tasks.problems import Problem

log = logging.getLogger(__name__)
_BOXED = re.compile(r"\\boxed\{")


def extract_answer(text: str) -> str | None:
    """The content of the last \\boxed{...}, braces balanced; None if there is none."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i]
    return None


def score(completion: str, answer: str, timeout_seconds: float = 2.0) -> float:
    """1.0 if the boxed answer equals the gold answer (math-verify equivalence), else 0.0 (no boxed
    answer, or a different one). A verifier that fails (math-verify raising or timing out, a gold
    answer it cannot read) is a `VerifierError`, not a 0: the loop counts them per step (`reward_errors`)
    and stops when every answer's raised, instead of training on rewards that say nothing."""
    boxed = extract_answer(completion)
    if boxed is None or not boxed.strip():
        return 0.0
    # math-verify's timeouts use SIGALRM, which only works in the main thread
    timeout = max(1, math.ceil(timeout_seconds)) if threading.current_thread() is threading.main_thread() else None
    try:
        # a bare gold answer is read as the boxed answer it is: math-verify's default extraction reads
        # LaTeX only inside delimiters, so a bare `\sqrt{2}` or `x^2+1` would parse to nothing
        delimited = "\\boxed" in answer or "$" in answer
        gold = parse(answer if delimited else "\\boxed{" + answer + "}", parsing_timeout=timeout, raise_on_error=True)
        if not gold:
            raise ValueError(f"the gold answer {answer!r} does not parse")
        pred = parse("\\boxed{" + boxed + "}", parsing_timeout=timeout, raise_on_error=True)
        return 1.0 if pred and verify(gold, pred, timeout_seconds=timeout, raise_on_error=True) else 0.0
    except (Exception, TimeoutException) as e:  # math-verify's timeout is a BaseException
        raise VerifierError(f"reward math (math-verify) raised {type(e).__name__}: {e}") from e


def _lines(text: str) -> list[str]:
    return [" ".join(line.split()) for line in text.strip().splitlines()]


def step_credit(completion: str, solution: str) -> float:
    """The share of the worked solution's steps (its lines before the final answer's) that the
    completion reproduces, in order, before its first difference. Each step of a chain is checkable,
    so a wrong answer still says how far the reasoning got right."""
    steps = _lines(solution)[:-1]
    if not steps:
        return 0.0
    done = 0
    for want, got in zip(steps, _lines(completion)):
        if want != got:
            break
        done += 1
    return done / len(steps)


# -- the task's reward (task.reward): a built-in, or the user's own `module:function` ----------------


class RewardError(ValueError):
    """A reward function that raised, hung past `task.reward_timeout_s` or returned a non-number; the
    message names the function."""


class VerifierError(RewardError):
    """The built-in math reward's verifier failed on an answer (not: the answer is wrong). The loop scores
    that answer 0, counts it in the step's `reward_errors`, and stops the run when every answer's raised."""


@dataclass
class Scored:
    """A batch of answers' rewards, and the verifier errors among them (scored 0)."""

    rewards: list[float]
    errors: int = 0
    first_error: str = ""  # the first error's message, "" when none


def score_answers(reward: Reward, texts: list[str], problems: list[Problem], training: bool = True) -> Scored:
    """Every answer's reward (`Reward.for_training`, or `for_eval`): a `VerifierError` scores 0 and is
    counted; any other error (a `module:function` reward that raises, hangs or returns a non-number) ends
    the run at once, naming the function."""
    rewards, errors, first = [], 0, ""
    for text, problem in zip(texts, problems, strict=True):
        try:
            rewards.append(reward.for_training(text, problem) if training else reward.for_eval(text, problem))
        except VerifierError as e:
            rewards.append(0.0)
            errors += 1
            first = first or str(e)
    return Scored(rewards, errors, first)


def check_not_all_failed(reward: Reward, answers: int, errors: int, first_error: str, where: str) -> None:
    """A RewardError naming the reward when every one of `answers` raised (`where`: which answers): such
    a step has no reward at all, and training on its zeros would silently train nothing."""
    if answers and errors == answers:
        raise RewardError(f"the reward {reward.name} (task.reward) raised on every one of {where}'s {answers} "
                          f"answers; the first: {first_error}")


class _Expired(BaseException):  # not an Exception: a reward's own `except Exception` cannot swallow it
    pass


@dataclass(frozen=True)
class Reward:
    """`task.reward` resolved: `for_training` scores a rollout's answer, `for_eval` an eval's. The
    built-in "math" is the boxed answer by math-verify (1 or 0), and in training a wrong answer gets
    `task.step_credit` x the share of the worked solution's steps it got right before its first
    mistake; a `module:function` is called as function(response text, problem) -> float, for both."""

    name: str  # "math", or "module:function"
    timeout_s: float
    step_credit: float = 0.0
    fn: Callable[[str, Problem], float] | None = None  # the user's function; None: the built-in

    def for_eval(self, text: str, problem: Problem) -> float:
        if self.fn is None:
            return score(text, problem.answer, self.timeout_s)
        return _checked(self.name, call_with_timeout(self.fn, (text, problem), self.timeout_s, self.name))

    def for_training(self, text: str, problem: Problem) -> float:
        r = self.for_eval(text, problem)
        if self.fn is None and r < 1.0 and self.step_credit > 0 and problem.solution:
            r = self.step_credit * step_credit(text, problem.solution)
        return r


def math_reward(timeout_s: float = 2.0, step_credit: float = 0.0) -> Reward:
    return Reward("math", timeout_s, step_credit)


def load_reward(task: TaskConfig) -> Reward:
    """The reward `task.reward` names; a `module:function` is imported here, before any work, and a
    module or function that is not there is a ConfigError naming task.reward."""
    if task.reward in BUILTIN_REWARDS:
        return math_reward(task.reward_timeout_s, task.step_credit)
    module_name, _, attr = task.reward.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or the module's own code failing on import
        raise ConfigError(f"task.reward={task.reward}: cannot import module {module_name!r} "
                          f"({type(e).__name__}: {e}); is its directory on PYTHONPATH?") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"task.reward={task.reward}: module {module_name!r} ({module.__file__}) has no function "
                          f"{attr!r}" + ("" if fn is None else f" (it is a {type(fn).__name__})"))
    return Reward(task.reward, task.reward_timeout_s, fn=fn)


def _checked(name: str, value: object) -> float:
    """A reward's value as a float: a finite real number (bool included), else a RewardError."""
    if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise RewardError(f"reward function {name} returned {value!r} ({type(value).__name__}), not a finite "
                          f"number")
    return float(value)


def call_with_timeout(fn: Callable, args: tuple, seconds: float, name: str):
    """fn(*args), or a RewardError naming `name` when it raises or runs past `seconds`.

    In the main thread the function runs there (so that it may use signal-based timeouts of its own,
    as math-verify's): a watchdog thread sends the main thread SIGALRM once the time is up, and again
    every 50 ms while the call goes on (a handler of the function's own, installed meanwhile, may take
    one); ours raises out of the call. Elsewhere the function runs in a daemon thread, abandoned if it
    does not return in time (the error ends the run)."""
    if threading.current_thread() is not threading.main_thread():
        return _call_in_thread(fn, args, seconds, name)
    running = [True]

    def expire(signum, frame):
        if running[0]:
            raise _Expired

    done = threading.Event()
    main = threading.main_thread().ident

    def watchdog():
        if done.wait(seconds):
            return
        while not done.is_set():
            signal.pthread_kill(main, signal.SIGALRM)
            done.wait(0.05)

    previous = signal.signal(signal.SIGALRM, expire)
    dog = threading.Thread(target=watchdog, name="reward-timeout", daemon=True)
    dog.start()
    try:
        return fn(*args)
    except _Expired:
        raise RewardError(f"reward function {name} ran past task.reward_timeout_s={seconds:g} s") from None
    except Exception as e:
        raise RewardError(f"reward function {name} raised {type(e).__name__}: {e}") from e
    finally:
        running[0] = False  # a SIGALRM still on its way finds a handler that does nothing
        done.set()
        dog.join()
        # None: a handler not installed from Python, which cannot be put back; the default then
        signal.signal(signal.SIGALRM, signal.SIG_DFL if previous is None else previous)


def _call_in_thread(fn: Callable, args: tuple, seconds: float, name: str):
    out: list = []

    def call():
        try:
            out.append((True, fn(*args)))
        except Exception as e:
            out.append((False, e))

    worker = threading.Thread(target=call, name=f"reward {name}", daemon=True)
    worker.start()
    worker.join(seconds)
    if not out:
        raise RewardError(f"reward function {name} ran past task.reward_timeout_s={seconds:g} s")
    ok, value = out[0]
    if not ok:
        raise RewardError(f"reward function {name} raised {type(value).__name__}: {value}") from value
    return value
