"""The Megatron trainer's routing replay and router losses on Qwen3-MoE (worlds, slow): replaying another
model's routing at TP2 x EP2 and PP2 x EP2, with and without activation recompute, steps as the torch
trainer under replay; padding is left out of megatron's load-balancing and z-losses at TP2 x PP2. The
tiny Qwen3-MoE, its batch and the trainer builder are tests/test_megatron_moe.py's."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from fastgrpo.local_world import run_world
from tests.conftest import assert_same_update
from tests.test_megatron_families import hf_scores, max_diff
from tests.test_megatron_moe import (GRPO_ONE, GRPO_TWO, OPTIM, SAMPLING, TOL, VOCAB, _trainer,  # noqa: F401 (policy:
                                     assert_same_metrics, grpo_batch, on_disk, policy)  # its fixture)

pytest.importorskip("megatron.core")


def replay_batch(policy_dir):
    """The test batch with another model's routing recorded (most picks differ from the policy's own)
    and, as the engine's log-probabilities, the torch trainer's under replay of that record."""
    from fastgrpo.config import GRPOConfig, OptimConfig, TrainerConfig
    from fastgrpo.models.policy import load_policy
    from fastgrpo.trainers.torch_trainer import TorchPolicyTrainer
    from fastgrpo.types import SamplingParams
    from tests.routing_records import with_foreign_routing

    batch = with_foreign_routing(grpo_batch(), policy_dir)
    trainer = TorchPolicyTrainer(load_policy(policy_dir), GRPOConfig(**GRPO_TWO), OptimConfig(**OPTIM),
                                 SamplingParams(**SAMPLING), trainer=TrainerConfig(routing_replay="rollout"))
    replayed = trainer.logprobs(batch)
    batch.engine_logprobs = replayed * batch.response_mask
    return batch, replayed, trainer


def _replayed_steps(rank, world, policy_dir, tp, pp, batch):
    """With routing replay, with and without activation recompute: the replayed scores, then one GRPO
    step's metrics and the weights after it."""
    out = {}
    for recompute in (False, True):
        trainer = _trainer(policy_dir, tp, pp, 2, GRPO_TWO, routing_replay=True, recompute=recompute)
        scores = trainer.logprobs(batch)
        out[recompute] = scores, trainer.train_step(batch), dict(trainer.export_weights())
    return out


@pytest.mark.slow  # two worlds of 4
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["TP2xEP2", "PP2xEP2"])
def test_routing_replay_at_tp_or_pp_with_ep2_steps_as_the_torch_trainer(tmp_path, policy, tp, pp):
    """Routing replay of another model's routing (most picks differ) at TP2 x EP2 (each TP rank routes
    its shard of the sequence) and PP2 x EP2 (each stage its layers), two minibatches of micro-batches
    of one row: the replayed log-probabilities are the torch trainer's under replay (and far from the
    policy's own routing's), and the step has its loss, gradient norm, expert load (the replayed
    experts) and routing_mismatch, and moves the weights as it does; with activation recompute (each
    layer's forward rerun in the backward, the record taken back in order) the same step."""
    batch, want_logp, reference = replay_batch(policy)
    own_logp, _ = hf_scores(policy, batch)
    assert max_diff(want_logp, own_logp, batch) > 0.05  # the record changes what is computed
    start = load_file(policy / "model.safetensors")
    want = reference.train_step(batch)
    want_weights = on_disk(reference.model.state_dict())
    results = run_world(_replayed_steps, 4, tmp_path / "world", policy, tp, pp, batch, timeout_s=500)
    for out in results:
        for recompute, (logp, metrics, weights) in out.items():
            assert max_diff(logp, want_logp, batch) <= TOL, recompute
            assert_same_metrics(metrics, want, rel=1e-6)
            assert metrics["routing_mismatch"] == pytest.approx(want["routing_mismatch"], rel=1e-12)
            assert_same_update(weights, want_weights, start)
        assert out[True][1]["loss"] == pytest.approx(out[False][1]["loss"], rel=1e-9)
    assert 0.3 < want["routing_mismatch"] < 1.0
    print(f"\nreplay TP{tp} x PP{pp} x EP2: loss {results[0][False][1]['loss']:.9g} vs {want['loss']:.9g}, "
          f"routing_mismatch {results[0][False][1]['routing_mismatch']:.4f}")


def _router_losses_on_two_paddings(rank, world, policy_dir):
    """TP2 x PP2 with the router's load-balancing and z-losses: one GRPO step on the test batch, and one
    on the same batch with other token ids at its padding; each step's metrics and weights after it."""
    out = []
    batch = grpo_batch()
    for padding_ids in (False, True):
        if padding_ids:
            batch = grpo_batch()
            pad = batch.attention_mask == 0
            batch.input_ids[pad] = torch.randint(3, VOCAB, (int(pad.sum()),), generator=torch.Generator().manual_seed(5))
        trainer = _trainer(policy_dir, 2, 2, 1, dict(GRPO_ONE, micro_batch_size=3), router_aux_loss=0.05,
                           router_z_loss=0.01)
        batch.engine_logprobs = trainer.logprobs(batch) * batch.response_mask
        out.append((trainer.train_step(batch), dict(trainer.export_weights())))
    return out


@pytest.mark.slow  # a world of 4
def test_padding_is_left_out_of_the_router_losses_at_tp2_x_pp2(tmp_path, policy):
    """What padding holds cannot move a step with the router's losses on: with other token ids at the
    padding (micro-batches of rows of unequal lengths, plus the columns sequence parallelism adds), the
    same loss, gradient norm and weights, on the first stage (megatron scatters the mask over the TP
    ranks) and the second (the trainer passes each TP rank its shard)."""
    results = run_world(_router_losses_on_two_paddings, 4, tmp_path / "world", policy, timeout_s=400)
    for (plain, plain_weights), (other, other_weights) in results:
        assert int((grpo_batch().attention_mask == 0).sum()) > 10  # padding in the micro-batches
        for key in ("loss", "grad_norm"):
            assert other[key] == pytest.approx(plain[key], rel=1e-6), key
        assert all(torch.allclose(other_weights[k], t, rtol=0, atol=1e-7) for k, t in plain_weights.items())
    print(f"\nrouter losses, other padding ids: grad norm {results[0][1][0]['grad_norm']:.9g} vs "
          f"{results[0][0][0]['grad_norm']:.9g}")
