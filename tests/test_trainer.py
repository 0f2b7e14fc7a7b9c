"""The torch policy trainer: a GRPO update moves the policy the right way, a NaN update is skipped."""

import torch

from fastgrpo.backends.torch_trainer import TorchPolicyTrainer
from fastgrpo.config import GRPOConfig, OptimConfig
from fastgrpo.grpo.batch import build_batch
from fastgrpo.models.policy import new_policy, policy_config


def make(seed=0, **grpo):
    policy = new_policy(policy_config("test", 50, 64, 1, 2, 0), seed=seed)
    trainer = TorchPolicyTrainer(policy, GRPOConfig(**grpo), OptimConfig(lr=1e-2), temperature=1.0)
    return policy, trainer


def batch_for(trainer, advantages):
    prompts = [[1, 5, 6], [1, 5, 6]]
    responses = [[7, 8, 9], [10, 11]]
    b = build_batch(prompts, responses, [[0.0] * 3, [0.0] * 2], torch.tensor(advantages), pad_id=0)
    b.engine_logprobs = trainer.logprobs(b) * b.response_mask  # sampled by an engine with the same weights
    return b


def test_update_raises_logprob_of_positive_advantage():
    _, trainer = make(epochs=2, minibatches=2)
    batch = batch_for(trainer, [1.0, -1.0])
    before = trainer.logprobs(batch)
    metrics = trainer.train_step(batch)
    after = trainer.logprobs(batch)
    m = batch.response_mask
    assert metrics["updates"] == 4 and metrics["skipped_updates"] == 0
    assert (after[0][m[0]].sum() > before[0][m[0]].sum()).item()
    assert (after[1][m[1]].sum() < before[1][m[1]].sum()).item()
    assert metrics["grad_norm"] > 0 and 0 <= metrics["clip_fraction"] <= 1


def test_nan_loss_skips_update_and_keeps_weights():
    policy, trainer = make()
    batch = batch_for(trainer, [float("nan"), 1.0])
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    metrics = trainer.train_step(batch)
    assert metrics["skipped_updates"] == 1 and metrics["updates"] == 0
    for k, v in policy.state_dict().items():
        assert torch.equal(v, before[k]), k
    # and the optimiser was not poisoned: a clean batch still trains
    metrics = trainer.train_step(batch_for(trainer, [1.0, -1.0]))
    assert metrics["updates"] == 1


def test_save_load_roundtrip(tmp_path):
    policy, trainer = make(seed=1)
    trainer.train_step(batch_for(trainer, [1.0, -1.0]))
    trainer.save(tmp_path)
    policy2, trainer2 = make(seed=2)
    trainer2.load(tmp_path)
    for (k, v), (_, w) in zip(policy.state_dict().items(), policy2.state_dict().items()):
        assert torch.equal(v, w), k
    b = batch_for(trainer, [1.0, -1.0])
    m1, m2 = trainer.train_step(b), trainer2.train_step(b)
    assert m1["loss"] == m2["loss"]
    for (k, v), (_, w) in zip(policy.state_dict().items(), policy2.state_dict().items()):
        assert torch.equal(v, w), k  # optimiser state restored too
