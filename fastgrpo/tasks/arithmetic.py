"""Seeded multi-step arithmetic with worked solutions and a long tail of step counts."""

from __future__ import annotations

import random

from fastgrpo.tasks.problems import Problem


def _problem(rng: random.Random, steps: int, max_value: int, max_operand: int) -> Problem:
    value = rng.randint(1, max_value)
    terms, lines = [str(value)], []
    for _ in range(steps):
        ops = [op for op, ok in (("+", value < max_value), ("-", value >= 1), ("*", 1 <= value <= max_value // 2)) if ok]
        op = rng.choice(ops)
        if op == "+":
            operand = rng.randint(1, min(max_operand, max_value - value))
            new = value + operand
        elif op == "-":
            operand = rng.randint(1, min(max_operand, value))
            new = value - operand
        else:
            operand = rng.randint(2, min(max_operand, max_value // value))
            new = value * operand
        lines.append(f"{value} {op} {operand} = {new}")
        terms.append(f"{op} {operand}")
        value = new
    solution = "\n".join(lines) + f"\nThe answer is \\boxed{{{value}}}."
    return Problem("Compute left to right: " + " ".join(terms), str(value), solution)


def _steps(rng: random.Random, min_steps: int, max_steps: int, tail: float) -> int:
    ks = list(range(min_steps, max_steps + 1))
    return rng.choices(ks, weights=[tail ** (k - 1) for k in ks])[0]


def generate_problems(n: int, seed: int, *, min_steps: int = 1, max_steps: int = 24, tail: float = 0.75,
                      max_value: int = 20, max_operand: int = 9) -> list[Problem]:
    """Values stay in 0..max_value; operands are 1..max_operand (2..max_operand for *)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not 1 <= min_steps <= max_steps:
        raise ValueError(f"min_steps must be in 1..max_steps, got {min_steps}")
    if not 0 < tail <= 1:
        raise ValueError(f"tail must be in (0, 1], got {tail}")
    if max_value < 2 or max_operand < 2:
        raise ValueError(f"max_value and max_operand must be >= 2, got {max_value}, {max_operand}")
    rng = random.Random(seed)
    return [_problem(rng, _steps(rng, min_steps, max_steps, tail), max_value, max_operand) for _ in range(n)]


UNBOXED = "\nThe answer is {}."  # the slipping teacher's final line: right value, no \\boxed{}, reward 0


def slip(problems: list[Problem], rate: float, seed: int) -> list[Problem]:
    """A teacher that slips: each worked solution, with probability `rate` (drawn independently of the
    problem), states its final answer outside \\boxed{}. The lines of arithmetic stay right, so a policy
    trained on these solutions learns the arithmetic and, at T = 1, leaves the box out about `rate` of
    the time, whatever the problem: a mistake shared by every problem, which the verifiable reward
    (the boxed answer only) can teach it to drop. The prompts and answers are unchanged."""
    if not 0 <= rate < 1:
        raise ValueError(f"rate must be in [0, 1), got {rate}")
    if rate == 0:
        return problems
    rng = random.Random(seed * 7_919 + 104_729)  # its own stream: the problems are those of rate 0
    out = []
    for p in problems:
        if p.solution is not None and rng.random() < rate:
            body = p.solution.rsplit("\n", 1)[0] if "\n" in p.solution else ""
            p = Problem(p.prompt, p.answer, body + UNBOXED.format(p.answer))
        out.append(p)
    return out


def arithmetic_splits(train_size: int, eval_size: int, seed: int, validation_size: int = 0, slip_rate: float = 0.0,
                      **kwargs) -> tuple[list[Problem], list[Problem], list[Problem]]:
    """(train, test, validation): no prompt of the two held-out sets is a training prompt. `slip_rate`:
    the share of the training set's worked solutions (the SFT corpus) written by a slipping teacher
    (`slip`); the held-out sets' solutions are the exact ones (they are never trained on)."""
    evals = generate_problems(eval_size, seed * 2 + 1, **kwargs)
    validation = generate_problems(validation_size, seed * 2 + 1 + 500_000_003, **kwargs)
    held_out = {p.prompt for p in evals + validation}
    train: list[Problem] = []
    rng_seed = seed * 2
    while len(train) < train_size:
        batch = generate_problems(train_size - len(train), rng_seed, **kwargs)
        train += [p for p in batch if p.prompt not in held_out]
        rng_seed += 1_000_003
    return slip(train, slip_rate, seed), evals, validation
