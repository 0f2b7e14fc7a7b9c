"""The Megatron trainer at TP2 x PP2 (a world of 4) against the torch trainer, and its distributed
checkpoints: saved at one layout, loaded at another; resumed bit for bit. One world of 4 trains,
scores and saves (shared by the tests of this module); one world of 2 loads it at two other layouts
and resumes at TP2."""

import pytest
import torch

from fastgrpo.local_world import run_world
from tests.test_megatron_model import GRPO, OPTIM, _grpo_batch, assert_same_step_as_torch, hf_model, torch_trainer_run

pytest.importorskip("megatron.core")

KIND = "qwen2"  # QKV bias, GQA split over TP, untied head
IDS = torch.randint(3, 301, (3, 11), generator=torch.Generator().manual_seed(5))


def _full_logits(trainer, ids):
    """The logits of the whole (unpadded) vocabulary, [n, s, V], on every rank of the layout."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from fastgrpo.types import RolloutBatch

    zeros = torch.zeros(ids.shape)
    micro = RolloutBatch(ids, torch.ones_like(ids), zeros, zeros, torch.zeros(ids.shape[0]))
    out = torch.zeros(*ids.shape, trainer.layout.vocab)

    def keep(rows, micro, logits, weight):
        assert weight is None  # 30 scored tokens, fewer than trainer.logits_chunk_tokens: the logits themselves
        out.copy_(gather_from_tensor_model_parallel_region(logits)[..., : trainer.layout.vocab])

    with torch.no_grad():
        trainer._run([(list(range(ids.shape[0])), micro)], keep, forward_only=True)
    if trainer.layout.pipeline > 1:
        dist.all_reduce(out, group=trainer.pp_group)  # only the last stage has them
    return out


def _new_trainer(policy_dir, tp, pp, **kwargs):
    from fastgrpo.trainers.megatron.trainer import MegatronPolicyTrainer
    from fastgrpo.config import GRPOConfig, OptimConfig
    from fastgrpo.types import SamplingParams

    return MegatronPolicyTrainer(policy_dir, GRPOConfig(**GRPO), OptimConfig(**OPTIM), SamplingParams(temperature=0.7),
                                 tensor=tp, pipeline=pp, **kwargs)


def _train_score_and_save(rank, world, policy_dir, checkpoint):
    """TP2 x PP2: what `_megatron_train_step` returns, then the logits of IDS, then a checkpoint."""
    trainer = _new_trainer(policy_dir, 2, 2)
    batch = _grpo_batch(trainer.logprobs)
    scores = trainer.logprobs_and_entropy(batch)
    metrics = [trainer.train_step(batch), trainer.train_step(batch)]
    weights = dict(trainer.export_weights())
    logits = _full_logits(trainer, IDS)
    trainer.save(checkpoint)
    return scores, metrics, weights, logits


@pytest.fixture(scope="module")
def tp2pp2(tmp_path_factory):
    """A world of 4 at TP2 x PP2: what each rank scored and trained, the logits of IDS, a checkpoint."""
    tmp = tmp_path_factory.mktemp("tp2pp2")
    hf_model(KIND).save_pretrained(tmp / "policy")
    results = run_world(_train_score_and_save, 4, tmp / "world", tmp / "policy", tmp / "checkpoint", timeout_s=400.0)
    return tmp, results


@pytest.mark.slow  # a multi-process world
def test_tp2_pp2_scores_and_trains_as_the_torch_trainer(tp2pp2):
    """Log-probabilities and entropy (max abs error <= 1e-5), then two GRPO steps of two minibatches
    each with clipping active: the same losses, gradient norms and weights (relative error <= 1e-5) as
    the torch trainer, on all four ranks (two stages of two TP ranks)."""
    tmp, results = tp2pp2
    assert_same_step_as_torch([r[:3] for r in results], tmp / "policy", KIND)


def _reshard_and_resume(rank, world, policy_dir, tp2pp2_checkpoint, tmp):
    """In one world of 2: (1) at TP2, 2 steps + save + load (a new trainer) + 2 steps against 4 steps;
    (2) the TP2 x PP2 checkpoint loaded at TP1 x PP2, then (3) at TP1 x PP1 (two DP ranks): the
    loaded weights, the logits of IDS and one more train step."""
    from megatron.core import parallel_state

    out = {}
    a = _new_trainer(policy_dir, 2, 1)
    batch = _grpo_batch(a.logprobs)
    straight = [a.train_step(batch), a.train_step(batch)]
    a.save(tmp / "tp2")
    straight += [a.train_step(batch), a.train_step(batch)]
    b = _new_trainer(policy_dir, 2, 1)
    b.load(tmp / "tp2")
    resumed = [b.train_step(batch), b.train_step(batch)]
    wa, wb = dict(a.export_weights()), dict(b.export_weights())
    out["tp2"] = {"straight": straight[2:], "resumed": resumed,
                  "same_weights": all(torch.equal(wa[k], wb[k]) for k in wa), "moved": float(sum(
                      (wa[k] - t).abs().sum() for k, t in hf_model(KIND).state_dict().items()))}
    del a, b
    for tp, pp in ((1, 2), (1, 1)):
        parallel_state.destroy_model_parallel()
        trainer = _new_trainer(policy_dir, tp, pp)
        trainer.load(tp2pp2_checkpoint)
        out[f"tp{tp}pp{pp}"] = {"weights": dict(trainer.export_weights()), "logits": _full_logits(trainer, IDS),
                                "third_step": trainer.train_step(batch), "updates": trainer.updates}
    return out


@pytest.mark.slow
def test_a_checkpoint_reshards_and_resumes_bit_for_bit(tp2pp2, tmp_path):
    """Saved at TP2 x PP2 after two steps, loaded at TP1 x PP2 and at TP1 x PP1: the same weights bit
    for bit, identical logits at both layouts (and the saving layout's to rounding), and a third step
    equal to the torch trainer's third (Adam's moments and step, the warm-up count: the optimizer
    state was resharded, not reset). At TP2, 2 steps + save + load + 2 steps equals 4 steps bit for bit."""
    tmp, saved = tp2pp2
    results = run_world(_reshard_and_resume, 2, tmp_path / "world", tmp / "policy", tmp / "checkpoint", tmp_path,
                        timeout_s=400.0)
    tp2 = results[0]["tp2"]
    assert tp2["resumed"] == tp2["straight"] and tp2["same_weights"] and tp2["moved"] > 1.0
    _, _, expected, _ = torch_trainer_run(tmp / "policy", 3)
    saved_weights, saved_logits = saved[-1][2], saved[0][3]
    for r in results:
        for layout in ("tp1pp2", "tp1pp1"):
            got = r[layout]
            assert set(got["weights"]) == set(saved_weights)
            for name, t in saved_weights.items():
                assert torch.equal(got["weights"][name], t), (layout, name)
            assert torch.equal(got["logits"], results[0]["tp1pp2"]["logits"]), layout  # identical
            torch.testing.assert_close(got["logits"], saved_logits, atol=1e-5, rtol=1e-5)
            assert got["updates"] == 4 + 2  # warm-up counted on from the saved 4 updates
            for key in ("loss", "grad_norm", "clip_fraction", "entropy", "lr"):
                assert got["third_step"][key] == pytest.approx(expected[2][key], rel=1e-5, abs=1e-7), (layout, key)


def _load_into(rank, world, policy_dir, checkpoint):
    from fastgrpo.trainers.megatron.layout import LayoutError

    trainer = _new_trainer(policy_dir, 1, 1)
    try:
        trainer.load(checkpoint)
    except LayoutError as e:
        return str(e)
    return None


@pytest.mark.slow  # a multi-process world
def test_a_checkpoint_of_another_model_is_refused_by_name(tp2pp2, tmp_path):
    """A Megatron checkpoint of the qwen2 policy loaded by a trainer of a Llama policy fails before any
    tensor is read, naming what differs."""
    tmp, _ = tp2pp2
    hf_model("llama-tied").save_pretrained(tmp_path / "llama")
    error = run_world(_load_into, 1, tmp_path / "world", tmp_path / "llama", tmp / "checkpoint")[0]
    assert error is not None and "another model" in error and "model_type" in error, error


def _train_with_and_without_recompute(rank, world, policy_dir):
    """TP2 with `recompute`: the usual scores, metrics and weights; and, with and without recompute,
    how the first layer's training-mode forward ran during two train steps (by whether autograd
    recorded it)."""
    from fastgrpo.trainers.megatron.trainer import MegatronPolicyTrainer
    from fastgrpo.config import GRPOConfig, OptimConfig
    from fastgrpo.types import SamplingParams

    out, calls = None, {}
    for recompute in (False, True):
        trainer = MegatronPolicyTrainer(policy_dir, GRPOConfig(**GRPO), OptimConfig(**OPTIM),
                                        SamplingParams(temperature=0.7), tensor=2, pipeline=1, recompute=recompute)
        batch = _grpo_batch(trainer.logprobs)
        scores = trainer.logprobs_and_entropy(batch)
        counts = calls[recompute] = {True: 0, False: 0}

        def count(layer, *_, counts=counts):
            if layer.training:
                counts[torch.is_grad_enabled()] += 1

        trainer.model.module.decoder.layers[0].register_forward_hook(count)
        out = scores, [trainer.train_step(batch), trainer.train_step(batch)], dict(trainer.export_weights())
    return out, calls


@pytest.mark.slow  # a multi-process world
def test_full_recompute_trains_as_the_torch_trainer(tmp_path):
    """`trainer.recompute`: every training forward of a layer runs once more without recording (the
    forward whose input alone is kept; the recording one is the backward's rerun), and the two
    steps are still the torch trainer's."""
    hf_model(KIND).save_pretrained(tmp_path / "policy")
    results = run_world(_train_with_and_without_recompute, 2, tmp_path / "world", tmp_path / "policy",
                        timeout_s=400.0)
    for _, calls in results:
        plain, recomputed = calls[False], calls[True]
        assert recomputed[True] == plain[True] > 0, calls
        assert recomputed[False] - plain[False] == plain[True], calls  # plain[False]: scoring the old policy
    assert_same_step_as_torch([r for r, _ in results], tmp_path / "policy", KIND)


def _resume_before_any_update(rank, world, policy_dir, tmp):
    """In one world of 2, at TP2 and at DP2 (with the replicated and the distributed optimizer, and the
    latter in bf16: fp32 main weights): a checkpoint saved before the optimizer's first step (a run
    whose every group was dropped so far: no Adam state yet), loaded by a new trainer; two steps of
    each against two of the one that saved."""
    from megatron.core import parallel_state

    from fastgrpo.device import Compute

    bf16 = Compute(torch.device("cpu"), torch.bfloat16)
    out = {}
    for name, tp, kwargs in (("tp2", 2, {}), ("dp2", 1, {}), ("dp2-distributed", 1, {"distributed_optimizer": True}),
                             ("dp2-distributed-bf16", 1, {"distributed_optimizer": True, "compute": bf16})):
        parallel_state.destroy_model_parallel()
        a = _new_trainer(policy_dir, tp, 1, **kwargs)
        batch = _grpo_batch(a.logprobs)
        a.save(tmp / name)
        straight = [a.train_step(batch), a.train_step(batch)]
        b = _new_trainer(policy_dir, tp, 1, **kwargs)
        b.load(tmp / name)
        resumed = [b.train_step(batch), b.train_step(batch)]
        wa, wb = dict(a.export_weights()), dict(b.export_weights())
        out[name] = {"straight": straight, "resumed": resumed, "same_weights": all(torch.equal(wa[k], wb[k]) for k in wa),
                     "updates": (a.updates, b.updates)}
        del a, b
    return out


@pytest.mark.slow  # a multi-process world
def test_a_checkpoint_before_the_first_update_resumes_at_tp2_and_dp2(tmp_path):
    """A checkpoint of an optimizer that never stepped holds no Adam moments: it resumes (a fresh
    optimizer) and the next two steps equal those of the run that never stopped, bit for bit."""
    hf_model(KIND).save_pretrained(tmp_path / "policy")
    results = run_world(_resume_before_any_update, 2, tmp_path / "world", tmp_path / "policy", tmp_path,
                        timeout_s=400.0)
    for r in results:
        for name, got in r.items():
            assert got["straight"][0]["updates"] == 2 and got["updates"] == (4, 4), name
            assert got["resumed"] == got["straight"] and got["same_weights"], name
