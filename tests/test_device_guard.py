"""Every path that runs on the accelerator in production, run under `StrictDevice` (tests/device_guard.py)
with every device context entered as a GPU run enters it: a tensor factory in fastgrpo's code that names
no device would, on a GPU, make a CPU tensor that meets CUDA ones. The GRPO step of the three trainers
(with the reference policy and its KL term too), the embedded engine's generate (plain, speculative,
with top-k / top-p sample sets, capturing states), the online draft learner, the weight bridge's push,
and sampling itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fastgrpo.device
from fastgrpo.bridge import WeightBridge
from fastgrpo.config import DraftConfig, GRPOConfig, OptimConfig
from fastgrpo.draft_learning.online import OnlineDraftLearner
from fastgrpo.models.draft import DraftHead
from fastgrpo.engines.embedded.engine import EmbeddedEngine
from fastgrpo.models.sampling import sample, sampling_logprobs
from fastgrpo.grpo.batch import build_batch
from fastgrpo.local_world import run_world
from fastgrpo.models.policy import new_policy, policy_config
from fastgrpo.speculation.policy import Static
from fastgrpo.speculation.spec import SpecConfig
from fastgrpo.trainers.torch_trainer import TorchPolicyTrainer
from fastgrpo.types import Request, SamplingParams
from tests.conftest import tiny_config
from tests.device_guard import StrictDevice, strict_device

VOCAB, EOS = 61, 60
CUT = SamplingParams(temperature=1.0, top_k=5, top_p=0.9, max_new_tokens=12)


@pytest.fixture(autouse=True)
def gpu_like_contexts(monkeypatch):
    """Enter the device contexts the CPU skips, as a GPU run enters them."""
    monkeypatch.setattr(fastgrpo.device, "ENTER_CPU_CONTEXT", True)


def policy(seed: int = 0):
    return new_policy(policy_config("test", VOCAB, 96, bos_id=1, eos_id=EOS, pad_id=0), seed=seed).eval()


def grpo_batch(kl: bool):
    prompts = [[1, 5, 6], [1, 5, 6], [1, 7], [1, 7]]
    responses = [[7, 8, 9], [10, 11], [12, 13, 14, 15], [16]]
    sets = [[[t, t + 1, t + 2] for t in r] for r in responses]  # sample sets: the trainer scores inside them
    return build_batch(prompts, responses, [[-1.0] * len(r) for r in responses],
                       torch.tensor([1.0, -1.0, 0.5, -0.5]), pad_id=0, sample_sets=sets)


def no_violations(guard: StrictDevice) -> None:
    assert not guard.violations, "tensors made without a device:\n" + "\n".join(guard.violations)


def test_the_guard_sees_a_factory_without_a_device_in_fastgrpo_code_only():
    code = compile("a = torch.zeros(3)\nb = torch.zeros(3, device='cpu')\nwith torch.device('cpu'):\n"
                   "    c = torch.arange(4)\nd = x.new_zeros(2)\ne = torch.as_tensor(x)\n", "fastgrpo/fake.py", "exec")
    with strict_device() as guard:
        exec(code, {"__name__": "fastgrpo.fake", "torch": torch, "x": torch.ones(2)})
        torch.zeros(3)  # the test's own call: not fastgrpo's
    assert guard.violations == ["torch.zeros without a device at fastgrpo/fake.py:1"]


@pytest.mark.parametrize("kl_coef", [0.0, 0.5])
def test_the_torch_trainers_grpo_step(kl_coef):
    model, reference = policy(), policy() if kl_coef else None
    trainer = TorchPolicyTrainer(model, GRPOConfig(minibatches=2, kl_coef=kl_coef), OptimConfig(lr=1e-3), CUT,
                                 reference)
    batch = grpo_batch(kl=kl_coef > 0)
    with strict_device() as guard:
        batch.engine_logprobs = trainer.logprobs(batch) * batch.response_mask
        metrics = trainer.train_step(batch)
    assert metrics["updates"] == 2 and (metrics["kl_ref"] > 0) == (kl_coef > 0)
    no_violations(guard)


def _distributed_step(rank, world, backend, policy_dir, tmp):
    import fastgrpo.device as device

    from fastgrpo.trainers import build_trainer

    device.ENTER_CPU_CONTEXT = True
    cfg = tiny_config(Path(tmp), Path(policy_dir), **{"trainer.backend": backend, "grpo.minibatches": 2,
                                                         "grpo.kl_coef": 0.5, "rollout.top_k": 5, "rollout.top_p": 0.9,
                                                         "threads": 1})
    trainer = build_trainer(cfg)
    batch = grpo_batch(kl=True)
    with strict_device() as guard:
        batch.engine_logprobs = trainer.logprobs(batch) * batch.response_mask
        metrics = trainer.train_step(batch)
    return metrics["updates"], metrics["kl_ref"], guard.violations


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["megatron", "deepspeed"])
def test_the_distributed_trainers_grpo_step(backend, tiny_policy, tmp_path):
    pytest.importorskip("megatron.core" if backend == "megatron" else "deepspeed")
    updates, kl_ref, violations = run_world(_distributed_step, 1, tmp_path / "world", backend, str(tiny_policy),
                                            str(tmp_path), timeout_s=600.0)[0]
    assert updates == 2 and kl_ref > 0
    assert not violations, "tensors made without a device:\n" + "\n".join(violations)


def engine(target, draft=None, spec: SpecConfig | None = None) -> EmbeddedEngine:
    e = EmbeddedEngine(target.config, 8, 96, eos_id=EOS, pad_id=0, policy=Static(spec) if spec else None)
    e.update_weights(target.state_dict().items(), 0)
    if draft is not None:
        e.update_draft(draft.state_dict().items(), 0)
    return e


def draft_for(target) -> DraftHead:
    torch.manual_seed(0)
    draft = DraftHead(target.config, 96)
    draft.bind_target(target.model.embed_tokens.weight, target.lm_head.weight)
    return draft


@pytest.mark.parametrize("spec", [None, SpecConfig(depth=3, topk=2, num_verify=6)], ids=["plain", "speculative"])
@pytest.mark.parametrize("sampling", [SamplingParams(temperature=1.0, max_new_tokens=12), CUT], ids=["full", "cut"])
def test_the_engines_generate(spec, sampling):
    target = policy(1)
    e = engine(target, draft_for(target) if spec else None, spec)
    requests = [Request([1, 3 + i, 9]) for i in range(5)]
    with strict_device() as guard:
        out = e.generate(requests, sampling, seed=3, capture=True)
    assert all(len(c.token_ids) > 0 for c in out)
    assert (spec is None) == (e.stats()["spec_steps"] == 0)
    no_violations(guard)


def test_the_online_draft_learner_and_the_weight_push():
    target = policy(2)
    draft = draft_for(target)
    e = engine(target, draft, SpecConfig(depth=3, topk=2, num_verify=6))
    learner = OnlineDraftLearner(draft, DraftConfig(online_lr=3e-3, batch_size=4, sync_max_steps=5), [e])
    prompts = [[1, 4 + i] for i in range(6)]
    with strict_device() as guard:
        out = e.generate([Request(p) for p in prompts], SamplingParams(temperature=1.0, max_new_tokens=10), seed=1,
                         capture=True)
        learner.observe(prompts, out, policy_version=0)
        metrics = learner.train(budget_s=60.0)
        report = WeightBridge([e, learner]).push(policy(3).state_dict().items(), version=1)
    assert metrics["draft_steps"] > 0 and report.tensors > 0 and e.weights_version == 1
    no_violations(guard)


def test_sampling():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    sets = torch.tensor([[3, 4, -1], [5, -1, -1], [-1, -1, -1], [7, 8, 9]])
    with strict_device() as guard:
        logprobs = sampling_logprobs(logits, CUT, sampled=torch.tensor([3, 5, 0, 9]), sets=sets)
        tokens = sample(logprobs, CUT)  # fresh randomness: no uniforms given
    assert torch.isfinite(logprobs.gather(-1, tokens[:, None])).all()
    no_violations(guard)
