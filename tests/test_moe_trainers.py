"""Qwen3-MoE trained by the torch and DeepSpeed trainers: the Hugging Face model computes
the experts; every step reports its expert load (a typed StepRecord field, None for a dense policy);
the router's load-balancing loss is added only when trainer.router_aux_loss is set; and what a push
sends SGLang names each expert as SGLang's Qwen3-MoE `load_weights` maps it (that check reads
SGLang's source: tests/test_sglang_conformance.py).

The policy is fastgrpo/bench/family_checkpoints.py's tiny Qwen3-MoE (fp32: three layers, the first and last
sparse with 8 experts, top-2, the middle one dense), written as a Hugging Face directory holds it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fastgrpo.config import ConfigError, GRPOConfig, OptimConfig, TrainerConfig, load_config
from fastgrpo.grpo.record import StepRecord
from fastgrpo.models.families import checkpoint_tensors
from fastgrpo.models.policy import load_policy
from fastgrpo.trainers.torch_trainer import TorchPolicyTrainer, expert_load, routed_tokens
from fastgrpo.types import SamplingParams
from fastgrpo.bench.family_checkpoints import MOE_EXPERTS, MOE_FAMILY, MOE_TOP_K, write_family_checkpoint

SPARSE_LAYERS = (0, 2)


@pytest.fixture(scope="module")
def moe_policy(tmp_path_factory) -> Path:
    return write_family_checkpoint(MOE_FAMILY, tmp_path_factory.mktemp("qwen3_moe"))


@pytest.fixture(scope="module")
def dense_policy(tmp_path_factory) -> Path:
    return write_family_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"))


def a_batch(policy_dir: Path, rows: int = 4, seed: int = 0):
    """Sequences of several lengths (padded), scored by the policy itself, advantages of both signs."""
    from fastgrpo.grpo.batch import build_batch
    from fastgrpo.trainers.torch_trainer import token_logprobs

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(5, 300, (3 + i,), generator=g).tolist() for i in range(rows)]
    responses = [torch.randint(5, 300, (4 + 2 * i,), generator=g).tolist() for i in range(rows)]
    batch = build_batch(prompts, responses, [[0.0] * len(r) for r in responses], torch.linspace(-1, 1, rows), pad_id=0)
    with torch.no_grad():
        lp, _ = token_logprobs(load_policy(policy_dir), batch, SamplingParams())
    batch.engine_logprobs = lp * batch.response_mask
    return batch


def torch_trainer(policy_dir: Path, trainer: TrainerConfig | None = None, model=None, **grpo) -> TorchPolicyTrainer:
    grpo = {"micro_batch_size": 8} | grpo
    return TorchPolicyTrainer(model or load_policy(policy_dir), GRPOConfig(**grpo), OptimConfig(lr=1e-3),
                              SamplingParams(), trainer=trainer)


def test_the_tiny_moe_is_what_it_claims(moe_policy):
    policy = load_policy(moe_policy)
    sd = policy.state_dict()
    assert policy.config.model_type == "qwen3_moe"
    assert [i for i in range(3) if f"model.layers.{i}.mlp.gate.weight" in sd] == list(SPARSE_LAYERS)
    assert sd["model.layers.0.mlp.experts.gate_up_proj"].shape == (MOE_EXPERTS, 64, 64)
    assert "model.layers.1.mlp.gate_proj.weight" in sd  # the dense layer among the sparse ones


# -- the expert layout a checkpoint and SGLang use ---------------------------------------------------
def test_checkpoint_tensors_are_what_save_pretrained_writes(moe_policy, tmp_path):
    """`checkpoint_tensors` of the trainer's state dict (stacked experts) gives exactly the tensors, under
    exactly the names, that transformers' own save_pretrained writes (one tensor per expert)."""
    policy = load_policy(moe_policy)
    policy.save_pretrained(tmp_path)
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    ours = dict(checkpoint_tensors(policy.state_dict().items()))
    assert ours.keys() == on_disk.keys()
    assert len([n for n in ours if ".mlp.experts." in n]) == 3 * MOE_EXPERTS * len(SPARSE_LAYERS)
    assert all(torch.equal(ours[n], on_disk[n]) for n in on_disk)


# -- the expert load ---------------------------------------------------------------------------------
def test_routed_tokens_are_the_models_routing(moe_policy):
    """The counts the trainer takes from the router's logits are the experts the model's own router
    chose (its top-k indices, captured from the router module), over the real tokens only."""
    policy = load_policy(moe_policy)
    batch = a_batch(moe_policy)
    chosen = []
    hooks = [policy.model.layers[i].mlp.gate.register_forward_hook(lambda m, args, out: chosen.append(out[2]))
             for i in SPARSE_LAYERS]
    with torch.no_grad():
        out = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_router_logits=True)
    for h in hooks:
        h.remove()
    real = batch.attention_mask.reshape(-1).bool()
    want = torch.stack([torch.bincount(c[real].reshape(-1), minlength=MOE_EXPERTS).double() for c in chosen])
    got = routed_tokens(out.router_logits, batch.attention_mask, MOE_TOP_K)
    assert torch.equal(got, want) and got.sum() == MOE_TOP_K * len(SPARSE_LAYERS) * real.sum()
    assert (batch.attention_mask == 0).any()  # padding was there to leave out


def test_expert_load_of_known_counts():
    balanced = torch.full((2, 8), 5.0)
    assert expert_load(balanced) == {"expert_load_max_over_mean": 1.0, "expert_idle_fraction": 0.0}
    collapsed = torch.zeros(2, 8)
    collapsed[:, :2] = 10.0  # every token to the same k = 2 experts: the bound E / k
    assert expert_load(collapsed) == {"expert_load_max_over_mean": 4.0, "expert_idle_fraction": 0.75}
    mixed = torch.stack([balanced[0], collapsed[0]])
    assert expert_load(mixed) == {"expert_load_max_over_mean": 2.5, "expert_idle_fraction": 0.375}


def _load_by_hand(policy, batch) -> tuple[float, float]:
    """The expert load of one forward, from the experts the model's own routers chose (their top-k
    indices, captured from the router modules) and counted here over the real tokens: the busiest
    expert over the mean per sparse layer, averaged over the layers, and the share of idle experts."""
    chosen = []
    hooks = [policy.model.layers[i].mlp.gate.register_forward_hook(lambda m, args, out: chosen.append(out[2]))
             for i in SPARSE_LAYERS]
    with torch.no_grad():
        policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    for h in hooks:
        h.remove()
    real = batch.attention_mask.reshape(-1).tolist()
    ratios, idle = [], 0
    for layer in chosen:
        counts = [0] * MOE_EXPERTS
        for token, experts in enumerate(layer.tolist()):
            for e in experts if real[token] else ():
                counts[e] += 1
        ratios.append(max(counts) / (sum(counts) / MOE_EXPERTS))
        idle += counts.count(0)
    return sum(ratios) / len(ratios), idle / (MOE_EXPERTS * len(chosen))


def test_a_moe_step_reports_its_expert_load_and_a_dense_step_none(moe_policy, dense_policy):
    """Through the record the loop fills (StepRecord) to MLflow's metrics: the MoE step's load within
    [1, E/k], equal to the load counted by hand from the routers' own choices; a dense step has
    neither field."""
    batch = a_batch(moe_policy)
    trainer = torch_trainer(moe_policy)
    want_max_over_mean, want_idle = _load_by_hand(trainer.model, batch)
    assert want_max_over_mean > 1.0  # an unbalanced load: a trainer reporting the balanced 1.0 would fail
    report = trainer.train_step(batch)  # one update: its one forward routes as the weights before it
    record = _record(report)
    assert 1.0 <= record.expert_load_max_over_mean <= MOE_EXPERTS / MOE_TOP_K
    assert record.expert_load_max_over_mean == pytest.approx(want_max_over_mean, rel=1e-12)
    assert record.expert_idle_fraction == pytest.approx(want_idle, abs=1e-12)
    metrics = record.metrics()
    assert metrics["expert_load_max_over_mean"] == record.expert_load_max_over_mean
    assert "expert_load_max_over_mean" not in record.policy  # the field, not the trainer's free-form report
    assert StepRecord.from_metrics(1, metrics).expert_load_max_over_mean == record.expert_load_max_over_mean

    dense = _record(torch_trainer(dense_policy).train_step(a_batch(dense_policy)))
    assert dense.expert_load_max_over_mean is None and dense.expert_idle_fraction is None
    assert not any(k.startswith("expert_") for k in dense.metrics())


def _record(report: dict[str, float]) -> StepRecord:
    """A step's record as the loop makes it (a rollout record, the trainer's report added by replace)."""
    import dataclasses

    rollout = StepRecord(1, 0.5, 0.5, 0.5, 10.0, 12.0, 0.0, 100.0, 4.0, 0.0, 1, 1, 0)
    return dataclasses.replace(rollout, policy=report)


# -- the router's load-balancing loss ----------------------------------------------------------------
def test_no_router_loss_unless_configured(moe_policy):
    """The default (0) adds nothing, whatever the checkpoint asks of Hugging Face (output_router_logits
    and a router_aux_loss_coef of its own): the gradient is the GRPO loss's alone, the same as with
    those settings off. trainer.router_aux_loss = c adds c times Hugging Face's own load-balancing loss
    of the batch (`aux_loss` of its forward with output_router_logits), gradient for gradient."""
    batch = a_batch(moe_policy)
    plain = torch_trainer(moe_policy).loss_gradient(batch)
    eager = load_policy(moe_policy)
    eager.config.output_router_logits, eager.config.router_aux_loss_coef = True, 0.5
    assert torch.equal(torch_trainer(moe_policy, model=eager).loss_gradient(batch), plain)

    coef = 0.05
    with_aux = torch_trainer(moe_policy, TrainerConfig(router_aux_loss=coef)).loss_gradient(batch)
    hf = load_policy(moe_policy)
    aux = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_router_logits=True).aux_loss
    aux.backward()
    aux_grad = torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel())
                          for p in hf.parameters()])
    router = torch.cat([torch.ones(p.numel()) if ".mlp.gate." in n else torch.zeros(p.numel())
                        for n, p in hf.named_parameters()]).bool()
    assert aux_grad[router].abs().max() > 1e-3  # the loss reaches the routers
    assert torch.allclose(with_aux - plain, coef * aux_grad, atol=1e-6, rtol=1e-4)
    assert (with_aux - plain)[router].abs().max() > 1e-5


def test_the_router_losses_are_refused_where_they_cannot_act(moe_policy, dense_policy):
    with pytest.raises(ConfigError, match="trainer.router_z_loss"):
        torch_trainer(moe_policy, TrainerConfig(router_z_loss=1e-3))
    with pytest.raises(ConfigError, match="trainer.router_aux_loss=0.01: the policy is not a mixture of experts"):
        torch_trainer(dense_policy, TrainerConfig(router_aux_loss=0.01))


def test_the_config_reaches_the_trainer(moe_policy, tmp_path):
    from fastgrpo.trainers import build_trainer

    cfg = load_config(None, [f"model.path={moe_policy}", f"run_dir={tmp_path}", "trainer.router_aux_loss=0.02"])
    assert build_trainer(cfg).router_aux_loss == 0.02
    cfg = load_config(None, [f"model.path={moe_policy}", f"run_dir={tmp_path}", "trainer.router_z_loss=0.001"])
    with pytest.raises(ConfigError, match="trainer.router_z_loss"):
        build_trainer(cfg)


# -- checkpoints -------------------------------------------------------------------------------------
def test_save_and_load_continue_exactly(moe_policy, tmp_path):
    """The torch trainer's checkpoint of a MoE (policy/ as save_pretrained writes it: one tensor per
    expert) loads back into the stacked experts: the same weights and the same next step."""
    batch = a_batch(moe_policy)
    a = torch_trainer(moe_policy)
    a.train_step(batch)
    a.save(tmp_path)
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in load_file(str(tmp_path / "policy" / "model.safetensors"))
    b = torch_trainer(moe_policy)
    b.load(tmp_path)
    wa, wb = dict(a.export_weights()), dict(b.export_weights())
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert a.train_step(batch) == b.train_step(batch)


# -- GRPO from the Hugging Face directory --------------------------------------------------------------
def moe_run(tmp_path: Path, path: Path, *extra: str) -> list[str]:
    from tests.test_real_checkpoints import family_run

    return family_run(tmp_path, path, "speculation.policy=off", "draft.online=off", *extra)


@pytest.mark.parametrize("replay", ["off", "rollout"])
def test_grpo_trains_qwen3_moe_from_its_hugging_face_directory(moe_policy, tmp_path, replay):
    """Two GRPO steps (torch trainer, the embedded engine, top-k sample sets): the trainer scores what
    the engine sampled with the engine's own log-probabilities (the engine's grouped experts against
    Hugging Face's MoE forward, at the same weights); each step has its expert load; the checkpoint
    reloads as a Qwen3-MoE. With routing replay the engine's routing reaches the trainer and each step
    reports routing_mismatch (fp32 on both sides: no pick differs)."""
    from transformers import AutoConfig

    from fastgrpo.train import train

    result = train(load_config(None, moe_run(tmp_path, moe_policy) + [f"trainer.routing_replay={replay}"]))
    assert len(result.steps) == 2
    for r in result.steps:
        assert r.policy["updates"] > 0 and abs(r.policy["kl_engine_trainer"]) < 1e-5, r.policy
        assert ("routing_mismatch" in r.policy) == (replay == "rollout")
        assert r.policy.get("routing_mismatch", 0.0) == 0.0
        assert 1.0 <= r.expert_load_max_over_mean <= MOE_EXPERTS / MOE_TOP_K
        assert 0.0 <= r.expert_idle_fraction < 1.0
    assert AutoConfig.from_pretrained(result.checkpoint / "policy").model_type == "qwen3_moe"


# -- DeepSpeed ZeRO-3 at DP2 ----------------------------------------------------------------------------
def _one_step(rank, world, args, backend):
    from fastgrpo.trainers import build_trainer

    torch.manual_seed(0)
    cfg = load_config(None, args + [f"trainer.backend={backend}"])
    trainer = build_trainer(cfg)
    rows = 5 if cfg.grpo.minibatches > 1 else 4
    batch = a_batch(Path(cfg.model.path), rows)
    if cfg.trainer.routing_replay == "rollout":
        from tests.routing_records import with_foreign_routing

        batch = with_foreign_routing(batch, Path(cfg.model.path))
    metrics = trainer.train_step(batch)
    leaves = []
    if backend == "deepspeed":
        from deepspeed.utils import get_z3_leaf_modules

        leaves = sorted({type(m).__name__ for m in get_z3_leaf_modules(trainer.model.module)})
    return metrics, {n: t.clone() for n, t in trainer.export_weights()}, leaves


@pytest.mark.slow  # a world of 2 (gloo)
@pytest.mark.parametrize("aux, replay", [(0.0, "off"), (0.05, "off"), (0.0, "rollout")])
def test_a_zero3_step_at_dp2_equals_the_torch_trainer(moe_policy, tmp_path, aux, replay):
    """ZeRO-3 over two ranks, the sparse blocks ZeRO leaves: the same loss, gradient norm, engine/trainer
    mismatch, expert load and weights as one process's torch trainer on the whole batch. Without the
    auxiliary loss: five rows (shares of 2 and 3, one rank pads), two minibatches (the second update
    off-policy); with it: four rows in micro-batches of 2, so each rank's share is one of the torch
    trainer's micro-batches (the load-balancing loss is a micro-batch's, not additive over its rows),
    two epochs. With routing replay (of another model's routing, most picks differing): the same step
    and the same routing_mismatch, its counts summed over the ranks."""
    pytest.importorskip("deepspeed")
    from fastgrpo.local_world import run_world
    from tests.conftest import assert_same_update

    shape = {"grpo.minibatches": 2} if aux == 0 else {"grpo.epochs": 2}
    args = [f"model.path={moe_policy}", f"run_dir={tmp_path / 'run'}", "grpo.micro_batch_size=2", "optim.lr=1e-3",
            "optim.grad_clip=0.5", "deepspeed.zero_stage=3", f"trainer.router_aux_loss={aux}", "threads=1",
            f"trainer.routing_replay={replay}", *(f"{k}={v}" for k, v in shape.items())]
    reference, weights, _ = _one_step(0, 1, args, "torch")
    results = run_world(_one_step, 2, tmp_path / "world", args, "deepspeed", timeout_s=300.0)
    assert reference["updates"] == 2.0
    start = load_policy(moe_policy).state_dict()
    for metrics, exported, leaves in results:
        assert leaves == ["Qwen3MoeSparseMoeBlock"]
        for key in ("loss", "grad_norm", "clip_fraction", "entropy", "updates", "expert_load_max_over_mean",
                    "expert_idle_fraction") + (("routing_mismatch",) if replay == "rollout" else ()):
            assert metrics[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-9), key
        # the batch's engine log-probabilities are the policy's own: both mismatches are fp32 rounding
        # (the experts' matmuls grouped over other rows), ~1e-8
        if replay == "off":
            assert abs(metrics["kl_engine_trainer"]) < 1e-6 and abs(reference["kl_engine_trainer"]) < 1e-6
        else:  # the engine log-probabilities are the policy's own routing's, the step another's
            assert reference["routing_mismatch"] > 0.3
            assert metrics["kl_engine_trainer"] == pytest.approx(reference["kl_engine_trainer"], rel=1e-5)
        assert exported.keys() == weights.keys()
        assert_same_update(exported, weights, start)


def _train(rank, world, args):
    from fastgrpo.train import train

    return [r.metrics() for r in train(load_config(None, args)).steps]


@pytest.mark.slow  # a world of 2 (gloo)
def test_a_deepspeed_zero3_world_trains_qwen3_moe(moe_policy, tmp_path):
    """`fastgrpo train` with DeepSpeed ZeRO-3 at DP2 (an engine per rank) on the MoE: two GRPO steps whose
    trainer log-probabilities equal what the engines sampled with, and every rank's step reports the
    same expert load (the counts summed over the ranks); its checkpoint's policy names each expert's
    tensors as the Hugging Face directory it started from does (as the torch and Megatron trainers')."""
    pytest.importorskip("deepspeed")
    from fastgrpo.local_world import run_world

    args = moe_run(tmp_path, moe_policy, "trainer.backend=deepspeed", "deepspeed.zero_stage=3")
    steps = run_world(_train, 2, tmp_path / "world", args, timeout_s=300.0)
    for rank_steps in steps:
        assert len(rank_steps) == 2
        assert all(abs(m["kl_engine_trainer"]) < 1e-5 for m in rank_steps), rank_steps
        assert all(1.0 <= m["expert_load_max_over_mean"] <= MOE_EXPERTS / MOE_TOP_K for m in rank_steps)
    assert [m["expert_load_max_over_mean"] for m in steps[0]] == [m["expert_load_max_over_mean"] for m in steps[1]]
    saved = load_file(tmp_path / "run" / "checkpoints" / "step_00000002" / "policy" / "model.safetensors")
    start = load_file(moe_policy / "model.safetensors")
    assert saved.keys() == start.keys() and "model.layers.0.mlp.experts.0.gate_proj.weight" in saved
    assert all(saved[k].shape == t.shape for k, t in start.items())
