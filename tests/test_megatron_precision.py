"""The Megatron trainer's precision and optimizer settings on gloo: megatron-core's DistributedOptimizer
(`trainer.distributed_optimizer`: fp32 main weights and Adam's moments sharded over data-parallel
ranks) against the replicated optimizer, bf16 (`trainer.precision`: bf16 weights and activations,
fp32 gradient reduction and main weights) against fp32, and their checkpoints: resumed bit for bit,
reloaded at another data-parallel size, refused where they cannot load. Each world runs in processes
of its own."""

import pytest
import torch

from fastgrpo.local_world import run_world
from tests.test_megatron_model import GRPO, OPTIM, _grpo_batch, hf_model

pytest.importorskip("megatron.core")

KIND = "qwen2"  # QKV bias, GQA, untied head
KEYS = ("loss", "grad_norm", "clip_fraction", "entropy", "kl_ref", "kl_engine_trainer", "lr")


def _trainer(policy_dir, tp=1, pp=1, distributed_optimizer=False, dtype=torch.float32):
    from fastgrpo.trainers.megatron.trainer import MegatronPolicyTrainer
    from fastgrpo.config import GRPOConfig, OptimConfig
    from fastgrpo.device import Compute
    from fastgrpo.types import SamplingParams

    return MegatronPolicyTrainer(policy_dir, GRPOConfig(**GRPO), OptimConfig(**OPTIM), SamplingParams(temperature=0.7),
                                 tensor=tp, pipeline=pp, compute=Compute(torch.device("cpu"), dtype),
                                 distributed_optimizer=distributed_optimizer)


def _two_steps(trainer) -> dict:
    """Two GRPO steps (two minibatches each, clipping active, the KL term) on the test batch: their
    metrics, the weights after them (as exported: Hugging Face names), the optimizer's bytes."""
    batch = _grpo_batch(trainer.logprobs)
    metrics = [trainer.train_step(batch), trainer.train_step(batch)]
    return {"metrics": metrics, "weights": dict(trainer.export_weights()), "optimizer_bytes": trainer.optimizer_bytes()}


def _relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _plain_and_distributed(rank, world, policy_dir):
    return {"plain": _two_steps(_trainer(policy_dir)),
            "distributed": _two_steps(_trainer(policy_dir, distributed_optimizer=True))}


@pytest.mark.slow  # a multi-process world
def test_the_distributed_optimizer_steps_as_the_replicated_one_at_dp2(tmp_path):
    """DP2, fp32: the same losses and gradient norms (relative 1e-6) over two steps with clipping
    active, the same weights (each tensor within 1e-6 of its norm), on both ranks; and each rank's
    optimizer holds half of the replicated optimizer's Adam state (8 B per parameter in fp32, where
    the optimizer steps the weights themselves). The key bias's gradient is exactly zero (it shifts
    all of a query's scores alike): Adam moves it by rounding noise alone, held to an absolute bound."""
    hf_model(KIND).save_pretrained(tmp_path / "policy")
    results = run_world(_plain_and_distributed, 2, tmp_path / "world", tmp_path / "policy", timeout_s=400.0)
    parameters = sum(t.numel() for t in hf_model(KIND).state_dict().values())
    for r in results:
        plain, distributed = r["plain"], r["distributed"]
        assert plain["metrics"][0]["grad_norm"] > OPTIM["grad_clip"]  # clipping active
        for got, want in zip(distributed["metrics"], plain["metrics"]):
            assert got["updates"] == want["updates"] == 2
            for key in ("loss", "grad_norm"):
                assert _relative(got[key], want[key]) <= 1e-6, (key, got[key], want[key])
            for key in KEYS:
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
        assert set(distributed["weights"]) == set(plain["weights"])
        for name, want in plain["weights"].items():
            error = float((distributed["weights"][name] - want).norm())
            if name.endswith("k_proj.bias"):  # an exactly zero gradient: Adam moves it by rounding noise alone
                assert error <= 1e-6, name
            else:
                assert error <= 1e-6 * float(want.norm()), (name, error / float(want.norm()))
        # the replicated optimizer: Adam's moments of every parameter (the vocabulary padded to 384 rows)
        assert plain["optimizer_bytes"] >= 8 * parameters
        assert distributed["optimizer_bytes"] == pytest.approx(plain["optimizer_bytes"] / 2, rel=0.02)
    assert results[0]["distributed"]["metrics"] == results[1]["distributed"]["metrics"]


def _save_resume_and_refuse(rank, world, policy_dir, tmp):
    """DP2 with the distributed optimizer: 2 steps, save, 2 more, against a new trainer that loads the
    checkpoint and takes 2 steps; then the checkpoint refused by a replicated optimizer, by a bf16
    trainer, and at TP2 (all before reading any tensor)."""
    from megatron.core import parallel_state

    from fastgrpo.trainers.megatron.layout import LayoutError

    a = _trainer(policy_dir, distributed_optimizer=True)
    batch = _grpo_batch(a.logprobs)
    straight = [a.train_step(batch), a.train_step(batch)]
    a.save(tmp / "dp2")
    saved = dict(a.export_weights())
    straight += [a.train_step(batch), a.train_step(batch)]
    b = _trainer(policy_dir, distributed_optimizer=True)
    b.load(tmp / "dp2")
    loaded = dict(b.export_weights())
    resumed = [b.train_step(batch), b.train_step(batch)]
    wa, wb = dict(a.export_weights()), dict(b.export_weights())
    out = {"straight": straight, "resumed": resumed, "saved": saved, "loaded": loaded, "updates": b.updates,
           "same_weights": all(torch.equal(wa[k], wb[k]) for k in wa), "refused": {}}
    del a, b
    for name, make in (("replicated", lambda: _trainer(policy_dir)),
                       ("bf16", lambda: _trainer(policy_dir, distributed_optimizer=True, dtype=torch.bfloat16)),
                       ("tp2", lambda: _trainer(policy_dir, tp=2, distributed_optimizer=True))):
        if name == "tp2":
            parallel_state.destroy_model_parallel()
        try:
            make().load(tmp / "dp2")
        except LayoutError as e:
            out["refused"][name] = str(e)
    return out


def _load_and_step(rank, world, policy_dir, checkpoint):
    trainer = _trainer(policy_dir, distributed_optimizer=True)
    batch = _grpo_batch(trainer.logprobs)
    trainer.load(checkpoint)
    return {"loaded": dict(trainer.export_weights()), "steps": [trainer.train_step(batch), trainer.train_step(batch)],
            "updates": trainer.updates}


@pytest.mark.slow
def test_a_sharded_optimizer_checkpoint_resumes_bit_for_bit_and_reloads_at_another_dp_size(tmp_path):
    """Saved at DP2 after two steps: a new DP2 trainer loads it and its next two steps equal the
    uninterrupted run's bit for bit (Adam's moments, main weights and step count restored, the
    warm-up count too); a DP1 trainer (one rank holds all of the state) loads the same weights bit for
    bit and steps as the DP2 run did (relative 1e-6: only the gradient sum's order differs). The
    checkpoint is refused, naming why, by a replicated optimizer, by a bf16 trainer and at TP2 (the
    `dp_reshardable` format reshards over data-parallel ranks only)."""
    hf_model(KIND).save_pretrained(tmp_path / "policy")
    dp2 = run_world(_save_resume_and_refuse, 2, tmp_path / "world2", tmp_path / "policy", tmp_path, timeout_s=400.0)
    for r in dp2:
        assert r["resumed"] == r["straight"][2:] and r["same_weights"] and r["updates"] == 8  # 4 saved + 2 x 2
        assert all(torch.equal(r["loaded"][k], t) for k, t in r["saved"].items())
        refused = r["refused"]
        assert "distributed_optimizer': (True, False)" in refused["replicated"], refused
        assert "precision': ('fp32', 'bf16')" in refused["bf16"], refused
        assert "saved at tensor 1 x pipeline 1" in refused["tp2"] and "not at tensor 2 x pipeline 1" in refused["tp2"]
    dp1 = run_world(_load_and_step, 1, tmp_path / "world1", tmp_path / "policy", tmp_path / "dp2", timeout_s=400.0)[0]
    assert dp1["updates"] == 8  # the warm-up counted on from the saved 4 updates
    assert all(torch.equal(dp1["loaded"][k], t) for k, t in dp2[0]["saved"].items())
    for got, want in zip(dp1["steps"], dp2[0]["straight"][2:]):
        for key in ("loss", "grad_norm"):
            assert _relative(got[key], want[key]) <= 1e-6, (key, got[key], want[key])


def _fp32_and_bf16(rank, world, policy_dir, tmp):
    """DP2: fp32, bf16, and bf16 with the distributed optimizer (which also saves, takes two more
    steps, and is resumed by a new trainer)."""
    out = {"fp32": _two_steps(_trainer(policy_dir)), "bf16": _two_steps(_trainer(policy_dir, dtype=torch.bfloat16))}
    a = _trainer(policy_dir, distributed_optimizer=True, dtype=torch.bfloat16)
    out["bf16 distributed"] = _two_steps(a)
    out["dtypes"] = {p.dtype for p in a.gpt.parameters()}
    batch = _grpo_batch(a.logprobs)
    a.save(tmp / "bf16")
    straight = [a.train_step(batch), a.train_step(batch)]
    b = _trainer(policy_dir, distributed_optimizer=True, dtype=torch.bfloat16)
    b.load(tmp / "bf16")
    out["resumed"] = [b.train_step(batch), b.train_step(batch)] == straight
    out["same_weights"] = all(torch.equal(x, y) for (_, x), (_, y) in zip(a.export_weights(), b.export_weights()))
    return out


@pytest.mark.slow  # a multi-process world
def test_bf16_steps_as_fp32_within_bf16_rounding(tmp_path):
    """DP2 in bf16 (bf16 weights and activations, gradients accumulated and summed over the ranks in
    fp32, fp32 main weights stepped by Adam): the losses and gradient norms of two steps within 2e-2
    of the fp32 run's on the same batch (2.8e-3 and 4.9e-4 at most, measured); the exported weights
    are bf16 under the Hugging Face names, within bf16 rounding of the fp32 run's or a small part of
    the update. The distributed optimizer in bf16 shards the fp32 main
    weights too (12 B per parameter replicated, halved at DP2) and steps as the replicated bf16
    optimizer (relative 1e-6; the bf16 weights equal but for a rare last-bit rounding flip); its
    checkpoint resumes bit for bit."""
    hf_model(KIND).save_pretrained(tmp_path / "policy")
    results = run_world(_fp32_and_bf16, 2, tmp_path / "world", tmp_path / "policy", tmp_path, timeout_s=400.0)
    initial = hf_model(KIND).state_dict()
    parameters = sum(t.numel() for t in initial.values())
    for r in results:
        fp32, bf16, distributed = r["fp32"], r["bf16"], r["bf16 distributed"]
        assert r["dtypes"] == {torch.bfloat16}
        for got, want in zip(bf16["metrics"], fp32["metrics"]):
            assert got["updates"] == 2
            for key in ("loss", "grad_norm"):
                assert _relative(got[key], want[key]) <= 2e-2, (key, got[key], want[key])
        for got, want in zip(distributed["metrics"], bf16["metrics"]):  # sharded: only the norm's sum order differs
            for key in ("loss", "grad_norm"):
                assert _relative(got[key], want[key]) <= 1e-6, (key, got[key], want[key])
        assert set(bf16["weights"]) == set(fp32["weights"])
        for name, want in fp32["weights"].items():
            got = bf16["weights"][name]
            assert got.dtype == torch.bfloat16 and distributed["weights"][name].dtype == torch.bfloat16, name
            flips = (distributed["weights"][name] != got).float().mean()  # a last-bit rounding flip here and there
            assert flips <= 1e-2, (name, float(flips))
            # within bf16 rounding of the weight (2^-8 relative per element) or a small part of how far the
            # four updates moved it (measured: 7% at most, the embedding; 0.5% of the norm at most, the
            # norms' weights at 1.0); a wrong or lost update is off by the order of the update itself
            error, moved = float((got.float() - want).norm()), float((want - initial[name]).norm())
            if name.endswith("k_proj.bias"):  # a zero gradient: Adam's rounding-noise steps, at most lr each
                assert float((got.float() - want).abs().max()) <= 4 * OPTIM["lr"] * 1.25, name
            else:
                assert error <= max(0.15 * moved, 5e-3 * float(want.norm())), (name, error, moved)
        assert bf16["optimizer_bytes"] >= 12 * parameters  # fp32 main weights + two moments
        assert distributed["optimizer_bytes"] == pytest.approx(bf16["optimizer_bytes"] / 2, rel=0.02)
        assert r["resumed"] and r["same_weights"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a CPU build of torch")
def test_optimizer_offload_is_refused_on_a_cpu_saying_why(tmp_path):
    """trainer.optimizer_offload (megatron-core's optimizer CPU offload) cannot run on a CPU build: the
    run's trainer, built from a config that validates (device auto, precision auto), refuses it naming
    megatron-core's source lines, before any process group exists; and without the distributed
    optimizer the trainer refuses it for that first, whatever the device."""
    import torch.distributed as dist

    from fastgrpo.config import GRPOConfig, OptimConfig, load_config
    from fastgrpo.trainers import build_trainer
    from fastgrpo.trainers.megatron.trainer import MegatronPolicyTrainer
    from fastgrpo.types import SamplingParams

    cfg = load_config(None, ["trainer.backend=megatron", "trainer.distributed_optimizer=true",
                             "trainer.optimizer_offload=true", f"model.path={tmp_path}"])
    with pytest.raises(ValueError, match=r"cannot run on a CPU build of torch: megatron-core 0\.16\.1's "
                                         r"HybridDeviceOptimizer chooses what to offload by param\.is_cuda") as refused:
        build_trainer(cfg)
    for cited in ("hybrid_optimizer.py:256-258, 273", "KeyError (hybrid_optimizer.py:99-101)",
                  "torch.cuda.Stream()s (hybrid_optimizer.py:219-221)", "optimizer_config.py:383"):
        assert cited in str(refused.value)
    with pytest.raises(ValueError, match=r"needs the distributed optimizer \(trainer\.distributed_optimizer=true\)"):
        MegatronPolicyTrainer(tmp_path, GRPOConfig(), OptimConfig(), SamplingParams(), optimizer_offload=True)
    assert not dist.is_initialized()
