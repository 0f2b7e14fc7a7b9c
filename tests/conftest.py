"""Shared fixtures: a test-size policy built once per session by the real SFT recipe.

`make test` runs in two pytest-xdist workers (a file's tests stay in one worker): each worker computes on
one thread, so the two keep two cores busy without oversubscribing them, and the session's policy and draft
are built once, by whichever worker asks first, for both."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from filelock import FileLock

from fastgrpo.config import Config, load_config

WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ... under xdist; None in one process
THREADS = 1 if WORKER else 2
torch.set_num_threads(THREADS)


@pytest.fixture(autouse=True)
def _tier_threads():
    """Every test runs, and the session's policy is built, at the tier's thread count: a run with `threads=1`
    sets the process's count, and a matmul's reduction order (so its last bits) can follow the count."""
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(THREADS)


# the sbatch tests start a Slurm cluster: `make test-slurm` runs them, after `make test`
collect_ignore = [] if os.environ.get("FASTGRPO_TEST_SLURM") == "1" else ["slurm"]


def tiny_config(tmp: Path, policy: Path | None = None, **sections) -> Config:
    """A run that takes seconds: test-size policy, short answers, small batches."""
    return load_config(None, tiny_overrides(tmp, policy, **sections))


def tiny_overrides(tmp: Path, policy: Path | None = None, **sections) -> list[str]:
    """tiny_config's key=value overrides, for tests that go through the `fastgrpo` command."""
    overrides = [
        f"run_dir={tmp / 'run'}",
        f"model.path={policy or tmp / 'policy'}",
        "model.size=test", "model.max_context=160",
        "task.train_size=400", "task.eval_size=8", "task.max_steps=6",
        "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=48", "rollout.max_batch=8",
        "grpo.steps=4", "grpo.micro_batch_size=8", "optim.lr=1e-3",
        "sft.examples=8000", "sft.batch_size=32", "sft.lr=3e-3", "sft.warmup_steps=5",
        "eval.samples=2", "checkpoint.every=2",
    ]
    return overrides + [f"{k}={v}" for k, v in sections.items()]


def built_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """`build(folder)` once per test session, shared by its xdist workers (the folder sits in their common
    temporary root, a lock around the build): a worker that comes second finds it done."""
    root = tmp_path_factory.getbasetemp()
    if WORKER is not None:
        root = root.parent  # the workers' own roots are beside one another in it
    folder = root / name
    with FileLock(f"{folder}.lock", timeout=1800):
        if not (folder / ".built").is_file():
            folder.mkdir(parents=True, exist_ok=True)
            build(folder)
            (folder / ".built").touch()
    return folder


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory) -> Path:
    from fastgrpo.sft import build_policy

    tmp = built_once(tmp_path_factory, "policy", lambda folder: build_policy(tiny_config(folder)))
    return Path(tiny_config(tmp).model.path)


@pytest.fixture(scope="session")
def tiny_draft(tiny_policy, tmp_path_factory) -> Path:
    """A draft warm-started by the real `draft-pretrain` code on the tiny policy."""
    from fastgrpo.draft_learning.pretrain import pretrain_draft

    return built_once(tmp_path_factory, "draft", lambda out: pretrain_draft(
        tiny_config(out, tiny_policy, **{"draft.path": out, "draft.pretrain_steps": 150, "draft.lr": 3e-3})))


def first_divergence_is_a_near_tie(model, prompt: list[int], a: list[int], b: list[int], sampling, seed: int,
                                   request: int, tol: float = 1e-4) -> bool:
    """Two token sequences sampled with the same counter-based noise for one request: True if they
    are equal, or if where they first differ the noise fell within `tol` of the CDF boundary between
    the two tokens (a float-rounding flip), by a full forward of `model` over the common prefix."""
    from fastgrpo.models.sampling import sampling_logprobs, sampling_uniforms

    t = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if t is None:
        return len(a) == len(b)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + a[:t]])).logits[0, -1]
    probs = sampling_logprobs(logits, sampling).double().exp()
    u = sampling_uniforms(seed, torch.tensor(request), torch.tensor(t)).item()
    lo, hi = sorted((a[t], b[t]))
    boundary = probs[: lo + 1].sum().item()  # the upper edge of the lower token's CDF interval...
    between = probs[lo + 1 : hi].sum().item()  # ...which meets the other's if nothing lies between
    return abs(u - boundary) < tol and between < tol


def assert_same_update(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], start: dict[str, torch.Tensor],
                       names: list[str] | None = None, min_moved: float = 0.0) -> None:
    """Two ways of taking the same optimiser steps (`want` from `start`) agree, per tensor, against how
    far the steps moved it. Adam divides each gradient by its own running scale, so reduction-order
    rounding in a near-zero gradient moves that coordinate by up to the learning rate (1.6e-5 of the
    weights' norm, and 1.4e-6 against an absolute 1e-6, on one machine, 2026-11-26), while a wrong
    update, a lost minibatch or a rank's rows missing moves it by the order of the update itself
    (4.4e-4 of it at most measured where all is right)."""
    for name in names or want:
        moved = float((want[name] - start[name]).norm())
        assert moved > min_moved, f"{name} did not move ({moved:.3g})"
        assert float((got[name] - want[name]).norm()) <= 3e-3 * moved, name
