"""The verifier: math-verify on the model's boxed final answer, and partial credit for the worked
solution's steps (a denser training signal than the answer alone)."""

from __future__ import annotations

import logging
import math
import re
import threading

from math_verify import parse, verify

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
    """1.0 if the boxed answer equals the gold answer (math-verify equivalence), else 0.0; never raises."""
    try:
        boxed = extract_answer(completion)
        if boxed is None or not boxed.strip():
            return 0.0
        # math-verify's timeouts use SIGALRM, which only works in the main thread
        timeout = max(1, math.ceil(timeout_seconds)) if threading.current_thread() is threading.main_thread() else None
        gold = parse(answer, parsing_timeout=timeout)
        pred = parse("\\boxed{" + boxed + "}", parsing_timeout=timeout)
        return 1.0 if pred and verify(gold, pred, timeout_seconds=timeout) else 0.0
    except Exception as e:  # a verifier failure must never end a training step
        log.debug("score failed on %r: %s", completion[:80], e)
        return 0.0


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
