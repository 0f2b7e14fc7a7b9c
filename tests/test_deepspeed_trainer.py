"""The DeepSpeed trainer (ZeRO over gloo, DeepSpeed's CPU accelerator) against the torch trainer, and
under torchrun as the loop runs it."""

from __future__ import annotations

import pytest
import torch

from fastgrpo.config import load_config
from fastgrpo.local_world import run_world
from tests.conftest import assert_same_update, tiny_overrides

pytest.importorskip("deepspeed")


def a_batch(policy_dir, rows: int = 5):
    """Sequences of several lengths, scored by the policy itself (as an engine would have)."""
    from fastgrpo.trainers.torch_trainer import token_logprobs
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
    from fastgrpo.trainers import build_trainer

    torch.manual_seed(0)
    cfg = load_config(None, args + [f"trainer.backend={backend}"])
    trainer = build_trainer(cfg)
    metrics = trainer.train_step(a_batch(cfg.model.path))
    return metrics, {n: t.clone() for n, t in trainer.export_weights()}


def initial_weights(args):
    from fastgrpo.models.policy import load_policy

    return load_policy(load_config(None, args).model.path).state_dict()


@pytest.mark.slow  # a multi-process world
@pytest.mark.parametrize("stage,kl_coef", [(2, 0.0), (3, 0.0), (3, 0.5)])
def test_a_zero_step_at_dp2_equals_the_torch_trainer(tmp_path, tiny_policy, stage, kl_coef):
    """Five rows over two ranks (shares of 2 and 3 rows, micro-batches of 2: one rank pads), two
    minibatches (two updates, the second off-policy), clipping on, and the KL to the reference: the
    same loss, gradient norm, KL and weights as one process's torch trainer on the whole batch."""
    args = tiny_overrides(tmp_path, tiny_policy, **{"grpo.micro_batch_size": 2, "grpo.minibatches": 2,
                                                     "optim.grad_clip": 0.5, "optim.lr": 1e-3,
                                                     "deepspeed.zero_stage": stage, "grpo.kl_coef": kl_coef})
    reference, weights = _one_step(0, 1, args, "torch")
    results = run_world(_one_step, 2, tmp_path / "world", args, "deepspeed", timeout_s=240.0)
    assert reference["updates"] == 2.0 and reference["grad_norm"] > 0.5  # clipping did act
    for metrics, exported in results:
        for key in ("loss", "grad_norm", "clip_fraction", "entropy", "kl_engine_trainer", "updates", "lr"):
            assert metrics[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-9), key
        assert metrics["kl_ref"] == pytest.approx(reference["kl_ref"], rel=1e-5, abs=1e-7)
        assert (reference["kl_ref"] > 1e-7) == (kl_coef > 0)  # the second update is away from the reference
        assert exported.keys() == weights.keys()
        assert_same_update(exported, weights, initial_weights(args))


def ds_overrides(tmp, policy, draft, **extra) -> list[str]:
    from tests.test_distributed_run import overrides

    return overrides(tmp, policy, draft, **{"trainer.backend": "deepspeed", "deepspeed.zero_stage": 3} | extra)


@pytest.mark.slow  # a multi-process world
def test_torchrun_zero3_trains_with_speculation_and_the_draft_learning_on_its_rank(tmp_path, tiny_policy, tiny_draft):
    """`torchrun --nproc-per-node 2 -m fastgrpo train trainer.backend=deepspeed deepspeed.zero_stage=3
    parallel.draft_ranks=1 draft.online=async`: one ZeRO-3 rank with its engine speculating, one draft
    rank learning from its states; every pushed version served, the draft rank's versions swapped in
    (6 steps: the draft rank's first version takes a few of these 0.3 s steps to arrive)."""
    from tests.test_distributed_run import run
    from tests.test_train import history

    args = ds_overrides(tmp_path, tiny_policy, tiny_draft, **{
        "parallel.draft_ranks": 1, "draft.online": "async", "draft.async_publish_s": 0.5, "speculation.policy": "aware",
        "grpo.steps": 6, "checkpoint.every": 6})
    out = run(2, args, tmp_path / "async.log")
    assert "step 6/6" in out and "summary:" in out
    assert history(tmp_path / "run", "weights_version") == {s: float(s - 1) for s in range(1, 7)}
    assert min(history(tmp_path / "run", "accept_len").values()) > 1.0  # the engine speculated, drafts accepted
    versions = history(tmp_path / "run", "draft_version")
    assert versions[6] >= 1 and list(versions.values()) == sorted(versions.values()), versions
    saved = tmp_path / "run" / "checkpoints" / "step_00000006"
    assert (saved / "deepspeed" / "fastgrpo.json").is_file() and (saved / "draft" / "draft.safetensors").is_file()


@pytest.mark.slow  # a multi-process world
def test_a_zero3_run_at_dp2_resumes_bit_exact_and_converts_to_hugging_face(tmp_path, tiny_policy, tiny_draft):
    """ZeRO-3 at DP2 (two engines, a frozen draft with fixed trees): 2 steps + `--resume` + 1 step
    equals 3 steps bit for bit (losses, gradient norms, rollouts); `deepspeed-to-hf` turns the
    checkpoint's DeepSpeed state into the same Hugging Face policy the checkpoint holds; a resume at
    another data-parallel size is refused with what to do."""
    from safetensors.torch import load_file

    from tests.test_distributed_run import STEP_KEYS, Torchrun, run
    from tests.test_train import history
    from tools.convert_checkpoint import main as convert

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(2, ds_overrides(straight, tiny_policy, tiny_draft, **{"grpo.steps": 3}), tmp_path / "straight.log")
    run(2, ds_overrides(resumed, tiny_policy, tiny_draft, **{"grpo.steps": 2}), tmp_path / "a.log")
    out = run(2, ["--resume", *ds_overrides(resumed, tiny_policy, tiny_draft, **{"grpo.steps": 3})], tmp_path / "b.log")
    assert "resumed from" in out and "step 3/3" in out
    for key in STEP_KEYS:
        assert history(resumed / "run", key) == history(straight / "run", key), key

    checkpoint = resumed / "run" / "checkpoints" / "step_00000003"
    assert convert(["deepspeed-to-hf", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "hf")]) == 0
    converted = load_file(str(tmp_path / "hf" / "model.safetensors"))
    held = load_file(str(checkpoint / "policy" / "model.safetensors"))
    assert converted.keys() >= held.keys() and all(torch.equal(converted[k], held[k]) for k in held)
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "hf" / "tokenizer.json").is_file()

    other = Torchrun(1, ["--resume", *ds_overrides(resumed, tiny_policy, tiny_draft, **{"grpo.steps": 4})],
                     tmp_path / "c.log")
    assert other.wait() != 0 and "saved at ZeRO stage 3 with 2 data-parallel ranks" in other.output()


def _resume_before_any_update(rank, world, backend, stage, policy_dir, tmp):
    """A checkpoint saved before the optimizer's first step (a run whose every group was dropped so far:
    no Adam state yet), loaded by a new trainer; two steps of each against two of the one that saved."""
    from fastgrpo.config import DeepSpeedConfig, GRPOConfig, OptimConfig
    from fastgrpo.models.policy import load_policy
    from fastgrpo.trainers.deepspeed_trainer import DeepSpeedPolicyTrainer
    from fastgrpo.trainers.torch_trainer import TorchPolicyTrainer
    from fastgrpo.types import SamplingParams
    from tests.test_megatron_model import GRPO, OPTIM, _grpo_batch

    def new():
        grpo, optim, sampling = GRPOConfig(**GRPO), OptimConfig(**OPTIM), SamplingParams(temperature=0.7)
        if backend == "torch":
            return TorchPolicyTrainer(load_policy(policy_dir), grpo, optim, sampling, reference=load_policy(policy_dir))
        return DeepSpeedPolicyTrainer(policy_dir, grpo, optim, sampling, DeepSpeedConfig(zero_stage=stage),
                                      reference_dir=policy_dir)

    a = new()
    batch = _grpo_batch(a.logprobs)
    a.save(tmp / "saved")
    straight = [a.train_step(batch), a.train_step(batch)]
    b = new()
    b.load(tmp / "saved")
    resumed = [b.train_step(batch), b.train_step(batch)]
    wa, wb = dict(a.export_weights()), dict(b.export_weights())
    return straight, resumed, all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow  # a process of its own (DeepSpeed starts torch.distributed)
@pytest.mark.parametrize("backend,stage", [("torch", 0), ("deepspeed", 2), ("deepspeed", 3)])
def test_a_checkpoint_before_the_first_update_resumes(tmp_path, backend, stage):
    """The torch and DeepSpeed trainers resume a checkpoint whose optimizer never stepped (no Adam
    moments in it), and the next two steps equal those of the run that never stopped, bit for bit."""
    from tests.test_megatron_model import hf_model

    hf_model("qwen2").save_pretrained(tmp_path / "policy")
    (tmp_path / "saved").mkdir()
    straight, resumed, same_weights = run_world(_resume_before_any_update, 1, tmp_path / "world", backend, stage,
                                                tmp_path / "policy", tmp_path, timeout_s=240.0)[0]
    assert straight[0]["updates"] == 2 and resumed == straight and same_weights


def _build_then_leave(rank, world, args, out):
    """The DeepSpeed trainer built in a world nothing else initialised (the trainer makes the group), one
    step, then left; at exit the process records whether the group was still there."""
    import atexit

    import torch.distributed as dist

    from fastgrpo.trainers import build_trainer

    # registered before the trainer registers its handler, so it runs after it (last in, first out)
    atexit.register(lambda: (out / f"exit{rank}").write_text(f"initialized={dist.is_initialized()}"))
    cfg = load_config(None, args + ["trainer.backend=deepspeed"])
    return build_trainer(cfg).train_step(a_batch(cfg.model.path))["loss"]


@pytest.mark.slow  # a multi-process world
def test_the_group_the_deepspeed_trainer_makes_is_gone_before_the_interpreter_exits(tmp_path, tiny_policy):
    """A gloo group left to the interpreter's finalization can abort the rank after its work ("terminate
    called without an active exception", seen once in this module's DP2 test): the trainer's own group is
    destroyed at exit, as `init_world`'s are."""
    args = tiny_overrides(tmp_path, tiny_policy, **{"grpo.micro_batch_size": 2, "deepspeed.zero_stage": 2})
    losses = run_world(_build_then_leave, 2, tmp_path / "world", args, tmp_path, timeout_s=240.0)
    assert losses[0] == losses[1]
    assert [(tmp_path / f"exit{r}").read_text() for r in range(2)] == ["initialized=False"] * 2
