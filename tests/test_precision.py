"""Device and precision: bf16 training (bf16 weights and activations, fp32 master weights and fp32
gradient accumulation) against fp32 on the same batch, a bf16 engine serving the bf16 trainer's
weights, and configs asking for what the machine lacks."""

import dataclasses

import pytest
import torch

from fastgrpo.trainers.torch_trainer import TorchPolicyTrainer
from fastgrpo.config import ConfigError, GRPOConfig, OptimConfig, load_config
from fastgrpo.device import Compute, cpu_has_bf16, resolve
from fastgrpo.engines.embedded.engine import EmbeddedEngine
from fastgrpo.grpo.batch import build_batch
from fastgrpo.models.policy import load_policy
from fastgrpo.types import Request, SamplingParams

CPU = torch.device("cpu")
needs_bf16 = pytest.mark.skipif(not cpu_has_bf16(), reason="this CPU has no native bf16 (AVX512-BF16 or AMX)")


def trainer(policy_dir, dtype, **grpo) -> TorchPolicyTrainer:
    return TorchPolicyTrainer(load_policy(policy_dir), GRPOConfig(minibatches=2, **grpo), OptimConfig(lr=1e-3),
                              SamplingParams(), compute=Compute(CPU, dtype))


def rollout(policy_dir, t: TorchPolicyTrainer, dtype):
    """A batch sampled by an engine of `dtype` holding `t`'s weights (pushed as the bridge does)."""
    policy = load_policy(policy_dir)
    engine = EmbeddedEngine(policy.config, 16, 160, eos_id=2, dtype=dtype)
    engine.update_weights(t.export_weights(), 0)
    prompts = [[1, 5 + i % 4, 6, 7, 8] for i in range(16)]
    out = engine.generate([Request(p) for p in prompts], SamplingParams(max_new_tokens=32), seed=1)
    # advantages of one sign: a loss that is not a difference of nearly equal sums, so that its
    # relative error is the step's, not cancellation's
    return engine, build_batch(prompts, [c.token_ids for c in out], [c.logprobs for c in out],
                               torch.linspace(0.2, 1.0, 16), pad_id=0)


@needs_bf16
def test_a_bf16_step_is_the_fp32_step_within_bf16_rounding(tiny_policy):
    """The same batch, two minibatches (the second off-policy), clipping on: loss and gradient norm of
    the bf16 step within 2e-2 of the fp32 step's; the weights are bf16 and moved, the master copies
    fp32. The engine serving bf16 holds the trainer's bf16 weights bit for bit (its checksummed
    commit), and engine and trainer log-probabilities agree to bf16 rounding."""
    fp32 = trainer(tiny_policy, torch.float32)
    _, batch = rollout(tiny_policy, fp32, torch.float32)
    bf16 = trainer(tiny_policy, torch.bfloat16)
    start = {n: t.clone() for n, t in bf16.export_weights()}
    # each with the engine log-probabilities its own precision's engine reports (its own scores: an
    # engine of that precision computes them to rounding), so that only the step itself is compared
    own = [dataclasses.replace(batch, engine_logprobs=t.logprobs(batch) * batch.response_mask) for t in (fp32, bf16)]
    want, got = fp32.train_step(own[0]), bf16.train_step(own[1])
    assert want["updates"] == got["updates"] == 2
    for key in ("loss", "grad_norm"):
        print(f"bf16 against fp32, {key}: {got[key] / want[key] - 1:+.2e} relative")
        assert got[key] == pytest.approx(want[key], rel=2e-2), key
    assert all(t.dtype == torch.bfloat16 for _, t in bf16.export_weights())
    assert all(m.dtype == torch.float32 for m in bf16.master)
    assert any(not torch.equal(t, start[n]) for n, t in bf16.export_weights())

    from fastgrpo.bridge import WeightBridge

    engine, served = rollout(tiny_policy, bf16, torch.bfloat16)
    WeightBridge([engine]).push(bf16.export_weights(), version=1)  # commit checks every tensor's checksum
    assert all(torch.equal(t, dict(bf16.export_weights())[n]) for n, t in engine.model.named_weights())
    kl = {}
    for name, t, b in (("fp32", fp32, rollout(tiny_policy, fp32, torch.float32)[1]), ("bf16", bf16, served)):
        d = (t.logprobs(b) - b.engine_logprobs)[b.response_mask]
        kl[name] = float(d.abs().max())
    print(f"max |engine - trainer| log-probability: fp32 {kl['fp32']:.2e}, bf16 {kl['bf16']:.2e}")
    assert kl["fp32"] < 1e-4 and kl["bf16"] < 0.1


@needs_bf16
def test_a_bf16_trainer_resumes_from_its_fp32_master_weights(tiny_policy, tmp_path):
    """The checkpoint keeps the fp32 master weights (the policy/ directory's bf16 ones are rounded):
    save, load into a fresh trainer, and the next step is the same step."""
    a = trainer(tiny_policy, torch.bfloat16)
    _, batch = rollout(tiny_policy, a, torch.bfloat16)
    a.train_step(batch)
    a.save(tmp_path)
    b = trainer(tiny_policy, torch.bfloat16)
    b.load(tmp_path)
    assert all(torch.equal(x, y) for x, y in zip(a.master, b.master))
    assert a.train_step(batch) == b.train_step(batch)
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a.export_weights(), b.export_weights()))


def test_a_device_or_precision_the_machine_lacks_fails_naming_the_key(monkeypatch):
    assert resolve(load_config(None, [])) == Compute(CPU, torch.float32)  # auto on a CPU: fp32
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"device cuda: this machine has no CUDA device"):
        resolve(load_config(None, ["device=cuda"]))
    monkeypatch.setattr("fastgrpo.device.cpu_has_bf16", lambda: False)
    with pytest.raises(ConfigError, match=r"trainer\.precision bf16: this CPU has no native bf16"):
        resolve(load_config(None, ["trainer.precision=bf16"]))
    with pytest.raises(ConfigError, match=r"device"):
        load_config(None, ["device=tpu"])
    with pytest.raises(ConfigError, match=r"trainer\.precision"):
        load_config(None, ["trainer.precision=fp16"])


def test_train_refuses_cuda_on_a_machine_without_it_before_any_work(tmp_path, monkeypatch, capsys):
    from fastgrpo.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    status = main(["train", "--config", "configs/tiny_cpu.yaml", "device=cuda", f"run_dir={tmp_path / 'run'}",
                   f"model.path={tmp_path / 'no-policy'}"])
    assert status == 2 and "device cuda" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
