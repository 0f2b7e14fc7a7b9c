"""Routing replay (fastgrpo/models/routing.py) on a tiny Qwen3-MoE: the record of one forward imposed on
another, gate weights from the replaying forward's own router, the router's gradient kept, and the
mismatch counted as the share of recorded picks the router would have changed."""

import pytest
import torch

from fastgrpo.models.routing import (Mismatch, bytes_per_token, record_routing, replay_routing, routers,
                                     stack_record)
from fastgrpo.bench.family_checkpoints import MOE_EXPERTS, MOE_TOP_K, family_config


def moe(seed: int = 0, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = family_config("qwen3_moe", 300, 1, 2, 0)
    cfg.mlp_only_layers = []  # three sparse layers
    return AutoModelForCausalLM.from_config(cfg).to(dtype).eval()


def forward_record(model, ids):
    with record_routing(model) as per_layer:
        out = model(input_ids=ids).logits
    return out, stack_record(per_layer, *ids.shape)


def picks_differing(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int]:
    """Written out with Python sets: of b's picks per (row, position, layer), how many are not in a's set."""
    total = differ = 0
    for x, y in zip(a.reshape(-1, a.shape[-1]).tolist(), b.reshape(-1, b.shape[-1]).tolist()):
        total += len(y)
        differ += sum(e not in set(x) for e in y)
    return total, differ


def test_replaying_a_models_own_routing_changes_nothing():
    model, ids = moe(), torch.randint(3, 300, (2, 24))
    want, own = forward_record(model, ids)
    assert own.shape == (2, 24, 3, MOE_TOP_K) and len(routers(model)) == 3
    with replay_routing(model, own) as found:
        got = model(input_ids=ids).logits
    assert torch.equal(got, want) and (found.picks, found.differ) == (2 * 24 * 3 * MOE_TOP_K, 0)


def test_another_forwards_routing_is_imposed_with_this_forwards_gate_weights():
    """A record from another model (other weights: most picks differ) is imposed on every sparse layer;
    a layer's output equals Hugging Face's experts run on the recorded ids with the weights written out
    here (softmax of this forward's router logits at those ids, renormalised)."""
    model, other, ids = moe(0), moe(1), torch.randint(3, 300, (2, 16))
    _, recorded = forward_record(other, ids)
    layer = model.model.layers[0].mlp
    seen = {}
    layer.register_forward_hook(lambda m, i, o: seen.update(x=i[0], y=o))
    # hooks run in the order registered: `own` sees the router's own picks, `replayed` what replaced them
    with record_routing(model) as own, replay_routing(model, recorded) as found, record_routing(model) as replayed:
        model(input_ids=ids)
    assert torch.equal(stack_record(replayed, 2, 16), recorded)  # what the experts ran
    total, differ = picks_differing(stack_record(own, 2, 16), recorded)
    assert (found.picks, found.differ) == (total, differ) and differ > total // 4
    x = seen["x"].reshape(-1, seen["x"].shape[-1])
    probs = torch.softmax(torch.nn.functional.linear(x, layer.gate.weight).float(), -1)
    idx = recorded[:, :, 0].reshape(-1, MOE_TOP_K).long()
    w = probs.gather(-1, idx)
    w = w / w.sum(-1, keepdim=True)
    want = layer.experts(x, idx, w).reshape(seen["y"].shape)
    torch.testing.assert_close(seen["y"], want, rtol=0, atol=1e-6)


def test_the_router_still_learns_under_replay_and_unrecorded_positions_keep_their_own_routing():
    model, other, ids = moe(0), moe(1), torch.randint(3, 300, (1, 12))
    _, recorded = forward_record(other, ids)
    partial = recorded.clone()
    partial[:, 6:] = -1  # the second half unrecorded
    with record_routing(model) as mine, replay_routing(model, partial) as found, record_routing(model) as replayed:
        model(input_ids=ids).logits.sum().backward()
    ran, own = stack_record(replayed, 1, 12), stack_record(mine, 1, 12)
    assert torch.equal(ran[:, :6], recorded[:, :6]) and torch.equal(ran[:, 6:], own[:, 6:])
    assert found.picks == 6 * 3 * MOE_TOP_K  # only recorded positions are counted
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in routers(model))


def test_bf16_engine_routing_differs_from_an_fp32_trainers_and_replay_removes_the_difference():
    """The pair that really flips routes here: the same weights in bf16 (an engine) and fp32 (a trainer).
    Without replay some recorded picks differ; replayed, the fp32 forward runs the bf16 picks and its
    log-probabilities move toward the bf16 forward's."""
    trainer = moe(0)
    engine = moe(0, torch.bfloat16)
    ids = torch.randint(3, 300, (8, 64))
    engine_logits, recorded = forward_record(engine, ids)
    plain = trainer(input_ids=ids).logits
    with replay_routing(trainer, recorded, replay=False) as off:
        trainer(input_ids=ids)
    with replay_routing(trainer, recorded) as on, record_routing(trainer) as ran:
        replayed = trainer(input_ids=ids).logits
    # (with replay on, a later layer's own picks are made on hidden states the replayed layers before it
    # computed, so its count may differ slightly from replay off's; the picks counted are the same)
    assert off.differ > 0 and off.fraction < 0.2 and on.picks == off.picks
    assert torch.equal(stack_record(ran, 8, 64), recorded)
    ref = torch.log_softmax(engine_logits.float(), -1)
    gap = lambda logits: (torch.log_softmax(logits, -1) - ref).abs().mean()  # noqa: E731
    assert gap(replayed) < gap(plain)


def test_bad_records_are_refused_and_a_dense_model_has_nothing_to_replay():
    model, ids = moe(), torch.randint(3, 300, (1, 8))
    with pytest.raises(ValueError, match="2 sparse layers; the model has 3"):
        with replay_routing(model, torch.zeros(1, 8, 2, MOE_TOP_K, dtype=torch.int16)):
            pass
    with pytest.raises(ValueError, match="covers 14 tokens, the forward 8"):
        with replay_routing(model, torch.zeros(2, 7, 3, MOE_TOP_K, dtype=torch.int16)):
            model(input_ids=ids)
    with replay_routing(model, None) as found:
        model(input_ids=ids)
    assert found == Mismatch() and found.fraction == 0.0
    assert bytes_per_token(48, 8) == 768 and bytes_per_token(94, 8) == 1504  # 30B-A3B, 235B-A22B
    assert MOE_EXPERTS < 2**15  # ids fit int16


def test_the_batch_carries_each_sequences_routing_through_select_shard_and_to():
    from fastgrpo.grpo.batch import build_batch

    prompts, responses = [[5, 6], [5, 6, 7], [8], [9, 9]], [[1, 2, 3], [4], [1, 1], [2]]
    routing = [torch.randint(0, 8, (len(p) + len(r), 3, 2), dtype=torch.int16) for p, r in zip(prompts, responses)]
    for r in routing:
        r[-1] = -1  # the last token never ran
    batch = build_batch(prompts, responses, [[0.0] * len(r) for r in responses], torch.zeros(4), routing=routing)
    assert batch.routing.shape == (4, 5, 3, 2) and batch.routing.dtype == torch.int16
    for i, r in enumerate(routing):
        assert torch.equal(batch.routing[i, : len(r)], r) and (batch.routing[i, len(r):] == -1).all()
    part = batch.shard(1, 2, 2).to("cpu")  # rows 2, 3 trimmed to their width (3)
    assert torch.equal(part.routing, batch.routing[2:, :3])
    assert build_batch(prompts, responses, [[0.0] * len(r) for r in responses], torch.zeros(4)).routing is None
    with pytest.raises(ValueError, match="every sequence of a batch, or for none"):
        build_batch(prompts, responses, [[0.0] * len(r) for r in responses], torch.zeros(4),
                    routing=[routing[0], None, None, None])


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "speculative"])
def test_the_engine_records_the_experts_hugging_face_routes_each_position_to(speculate, static):
    """The embedded engine's record (prefill, plain steps, and a verify forward's accepted nodes; eager
    steps or static ones, which run every expert and capture as graphs) is the routing Hugging Face
    computes on the finished sequence, position for position; the last token, never run, is -1;
    recording changes no token. (A mixed model: one sparse layer between dense ones.)"""
    from fastgrpo.models.draft import DraftHead
    from fastgrpo.speculation.policy import Static
    from fastgrpo.speculation.spec import SpecConfig
    from fastgrpo.types import Request, SamplingParams
    from tests.test_families import engine_for, prompts
    from tests.test_moe_engine import CONFIGS, hf_model

    cfg = CONFIGS["mixed"]()
    hf = hf_model(cfg)
    draft, policy = (DraftHead(cfg), Static(SpecConfig(3, 3, 8))) if speculate else (None, None)
    engine = engine_for(cfg, hf, draft, policy, static_steps=static)
    requests, sampling = [Request(p) for p in prompts(4, seed=3)], SamplingParams(temperature=1.0, max_new_tokens=20)
    plain = engine.generate(requests, sampling, seed=1)
    static_calls = []
    if static:  # every step of the recording call is a static one
        step = engine._static_step
        engine._static_step = lambda *args: static_calls.append(1) or step(*args)
        engine._decode = engine._speculate = None
    recorded = engine.generate(requests, sampling, seed=1, routing=True)
    assert [c.token_ids for c in recorded] == [c.token_ids for c in plain] and plain[0].routing is None
    assert len(static_calls) >= 10 if static else not static_calls
    if speculate:
        assert engine.stats()["spec_steps"] > 0
    for r, c in zip(requests, recorded):
        ids = torch.tensor([r.prompt_ids + c.token_ids])
        _, want = forward_record(hf, ids)
        assert c.routing.shape == (ids.shape[1], 1, 2) and c.routing.dtype == torch.int16
        assert torch.equal(c.routing[:-1], want[0, :-1]) and (c.routing[-1] == -1).all()


def test_replay_is_refused_where_it_cannot_run_naming_the_key():
    from fastgrpo.config import ConfigError, load_config

    assert load_config(None, ["trainer.routing_replay=rollout"]).trainer.routing_replay == "rollout"
    assert load_config(None, ["trainer.routing_replay=rollout", "trainer.backend=megatron"]).trainer.backend == "megatron"
    # SGLang records routing (tests/test_sglang_adapter.py), but not the accepted tokens' under EAGLE
    assert load_config(None, ["trainer.routing_replay=rollout", "engine.backend=sglang"]).engine.backend == "sglang"
    with pytest.raises(ConfigError, match=r"trainer\.routing_replay.*backend=sglang needs speculation\.policy=off"):
        load_config(None, ["trainer.routing_replay=rollout", "engine.backend=sglang", "speculation.policy=static"])
    with pytest.raises(ConfigError, match="trainer.routing_replay"):
        load_config(None, ["trainer.routing_replay=always"])


def engine_batch(policy_dir, rows: int = 8, new_tokens: int = 24):
    """Rollouts of a bf16 embedded engine (routing recorded) scored into a batch: the engine's own
    sampling log-probabilities, advantages of both signs."""
    from fastgrpo.engines.embedded.engine import EmbeddedEngine
    from fastgrpo.grpo.batch import build_batch
    from fastgrpo.models.policy import load_policy
    from fastgrpo.types import Request, SamplingParams

    policy = load_policy(policy_dir)
    engine = EmbeddedEngine(policy.config, rows, 128, eos_id=-1, pad_id=0, dtype=torch.bfloat16)
    engine.update_weights(policy.state_dict().items(), version=0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 300, (6 + i,), generator=g).tolist() for i in range(rows)]
    out = engine.generate([Request(p) for p in prompts], SamplingParams(max_new_tokens=new_tokens), seed=3, routing=True)
    return build_batch(prompts, [c.token_ids for c in out], [c.logprobs for c in out], torch.linspace(-1, 1, rows),
                       routing=[c.routing for c in out])


def test_replay_trains_on_the_engines_experts_and_brings_the_trainer_closer_to_the_engine(tmp_path):
    """A bf16 engine's rollouts of a tiny Qwen3-MoE scored and trained in fp32. Both steps report the
    picks the trainer's router would have changed (measured before replay applies, so > 0 either way).
    With replay the trainer's log-probabilities of the sampled tokens are nearer the engine's: bf16
    rounding leaves a gap of ~1e-2 everywhere, a flipped expert a gap several times that on the tokens it
    touches (measured: the largest gap 0.093 -> 0.045, tokens beyond 0.05 3 -> 0, the mean 1.09e-2 ->
    0.96e-2). The router still gets a gradient under replay."""
    from fastgrpo.config import GRPOConfig, OptimConfig, TrainerConfig
    from fastgrpo.models.policy import load_policy
    from fastgrpo.trainers.torch_trainer import TorchPolicyTrainer
    from fastgrpo.types import SamplingParams
    from fastgrpo.bench.family_checkpoints import MOE_FAMILY, write_family_checkpoint

    policy_dir = write_family_checkpoint(MOE_FAMILY, tmp_path / "moe", mlp_only_layers=[])
    batch = engine_batch(policy_dir)
    assert batch.routing is not None and batch.routing.shape[2:] == (3, MOE_TOP_K)
    mask = batch.response_mask
    metrics, gap, router_grad = {}, {}, {}
    for mode in ("off", "rollout"):
        trainer = TorchPolicyTrainer(load_policy(policy_dir), GRPOConfig(micro_batch_size=4), OptimConfig(lr=1e-3),
                                     SamplingParams(), trainer=TrainerConfig(routing_replay=mode))
        gap[mode] = (trainer.logprobs(batch) - batch.engine_logprobs).abs()[mask]
        before = [r.weight.detach().clone() for r in routers(trainer.model)]
        metrics[mode] = trainer.train_step(batch)
        router_grad[mode] = all(not torch.equal(b, r.weight) for b, r in zip(before, routers(trainer.model)))
    off, on = metrics["off"], metrics["rollout"]
    print(f"\nrouting_mismatch {off['routing_mismatch']:.4f} / {on['routing_mismatch']:.4f}; |logp gap| max "
          f"{gap['off'].max():.3e} / {gap['rollout'].max():.3e}, mean {gap['off'].mean():.3e} / {gap['rollout'].mean():.3e}")
    assert 0 < off["routing_mismatch"] < 0.2 and 0 < on["routing_mismatch"] < 0.2
    assert gap["rollout"].max() < 0.75 * gap["off"].max() and gap["rollout"].mean() < gap["off"].mean()
    assert router_grad["rollout"] and router_grad["off"]  # each step moved every router


def test_replay_on_a_dense_policy_is_refused_naming_the_key(tmp_path):
    from fastgrpo.config import ConfigError, GRPOConfig, OptimConfig, TrainerConfig
    from fastgrpo.models.policy import load_policy
    from fastgrpo.trainers.torch_trainer import TorchPolicyTrainer
    from fastgrpo.types import SamplingParams
    from fastgrpo.bench.family_checkpoints import write_family_checkpoint

    dense = write_family_checkpoint("qwen3", tmp_path / "qwen3")
    with pytest.raises(ConfigError, match="trainer.routing_replay=rollout: the policy \\(qwen3\\) has no"):
        TorchPolicyTrainer(load_policy(dense), GRPOConfig(), OptimConfig(), SamplingParams(),
                           trainer=TrainerConfig(routing_replay="rollout"))
