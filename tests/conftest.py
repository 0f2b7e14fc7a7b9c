"""Shared fixtures: a test-size policy built once per session by the real SFT recipe."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from fastgrpo.config import Config, load_config

torch.set_num_threads(2)

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


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory) -> Path:
    from fastgrpo.sft import build_policy

    tmp = tmp_path_factory.mktemp("policy")
    cfg = tiny_config(tmp)
    build_policy(cfg)
    return Path(cfg.model.path)


@pytest.fixture(scope="session")
def tiny_draft(tiny_policy, tmp_path_factory) -> Path:
    """A draft warm-started by the real `draft-pretrain` code on the tiny policy."""
    from fastgrpo.draft_learning.pretrain import pretrain_draft

    out = tmp_path_factory.mktemp("draft")
    pretrain_draft(tiny_config(out, tiny_policy, **{"draft.path": out, "draft.pretrain_steps": 150,
                                                       "draft.lr": 3e-3}))
    return out


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
