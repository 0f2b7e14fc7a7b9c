"""The DeepSpeed trainer (ZeRO over gloo, DeepSpeed's CPU accelerator) against the torch trainer, and
under torchrun as the loop runs it."""

from __future__ import annotations

import pytest
import torch

from fastgrpo.config import load_config
from fastgrpo.distributed import run_world
from tests.conftest import tiny_overrides

pytest.importorskip("deepspeed")


def a_batch(policy_dir, rows: int = 5):
    """Sequences of several lengths, scored by the policy itself (as an engine would have)."""
    from fastgrpo.backends.torch_trainer import token_logprobs
    from fastgrpo.grpo.batch import build_batch
    from fastgrpo.models.policy import load_policy
    from fastgrpo.types import SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = [[1] + torch.randint(5, 40, (3 + i,), generator=g).tolist() for i in range(rows)]
    responses = [torch.randint(5, 40, (4 + 2 * i,), generator=g).tolist() for i in range(rows)]
    batch = build_batch(prompts, responses, [[0.0] * len(r) for r in responses],
                        torch.linspace(-1, 1, rows), pad_id=0)
    with torch.no_grad():
        lp, _ = token_logprobs(load_policy(policy_dir), batch, SamplingParams())
    batch.engine_logprobs = lp * batch.response_mask
    return batch


def _one_step(rank, world, args, backend):
    from fastgrpo.backends import build_trainer

    torch.manual_seed(0)
    cfg = load_config(None, args + [f"trainer.backend={backend}"])
    trainer = build_trainer(cfg)
    metrics = trainer.train_step(a_batch(cfg.model.path))
    return metrics, {n: t.clone() for n, t in trainer.export_weights()}


def initial_weights(args):
    from fastgrpo.models.policy import load_policy

    return load_policy(load_config(None, args).model.path).state_dict()


@pytest.mark.parametrize("stage", [2, 3])
def test_a_zero_step_at_dp2_equals_the_torch_trainer(tmp_path, tiny_policy, stage):
    """Five rows over two ranks (shares of 2 and 3 rows, micro-batches of 2: one rank pads), two
    minibatches (two updates, the second off-policy), clipping on: the same loss, gradient norm and
    weights as one process's torch trainer on the whole batch."""
    args = tiny_overrides(tmp_path, tiny_policy, **{"grpo.micro_batch_size": 2, "grpo.minibatches": 2,
                                                     "optim.grad_clip": 0.5, "optim.lr": 1e-3,
                                                     "deepspeed.zero_stage": stage})
    reference, weights = _one_step(0, 1, args, "torch")
    results = run_world(_one_step, 2, tmp_path / "world", args, "deepspeed", timeout_s=240.0)
    assert reference["updates"] == 2.0 and reference["grad_norm"] > 0.5  # clipping did act
    for metrics, exported in results:
        for key in ("loss", "grad_norm", "clip_fraction", "entropy", "kl_engine_trainer", "updates", "lr"):
            assert metrics[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-9), key
        assert exported.keys() == weights.keys()
        for name, t in weights.items():  # per tensor: Adam's second step magnifies reduction-order rounding
            assert float((exported[name] - t).norm() / t.norm()) <= 1e-5, name  # in near-zero gradients
        moved = max(float((weights[n] - w).abs().max()) for n, w in initial_weights(args).items())
        assert moved > 1e-4
