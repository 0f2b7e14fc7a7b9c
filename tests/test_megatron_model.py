"""megatron-core's GPTModel from a Hugging Face policy, on gloo: weights in and out bit-exact at any
TP x PP, logits equal to the Hugging Face model's. Each world runs in processes of its own."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from fastgrpo.local_world import run_world
from tests.conftest import assert_same_update

pytest.importorskip("megatron.core")

SHAPE = dict(vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=64)


def hf_model(kind: str):
    torch.manual_seed(0)
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=False, **SHAPE)).eval()
    return LlamaForCausalLM(LlamaConfig(tie_word_embeddings=kind == "llama-tied", rope_theta=5e5, **SHAPE)).eval()


def _load(kind, tp, pp):
    from fastgrpo.trainers.megatron.layout import Layout
    from fastgrpo.trainers.megatron.model import build_model, load_hf_state

    hf = hf_model(kind)
    layout = Layout.of(hf.config, tp, pp)
    model = build_model(hf.config, layout).eval()
    load_hf_state(model, hf.state_dict(), layout)
    return model, layout


def _export_and_logits(rank, world, tp, pp, kinds, ids):
    """For each kind of model: the Hugging Face tensors every rank streams out, and (PP 1) the logits."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from fastgrpo.trainers.megatron.model import export_hf, initialize

    initialize(tp, pp)
    out = {}
    for kind in kinds:
        model, layout = _load(kind, tp, pp)
        exported = dict(export_hf(model, layout))
        out[kind] = {"exported": exported if rank == world - 1 else sorted(exported)}
        if pp == 1:
            s = ids.shape[1]
            with torch.no_grad():
                local = model(ids, torch.arange(s).expand(ids.shape[0], -1),
                              attention_mask=torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None])
            shards = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(shards, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
            out[kind]["logits"] = torch.cat(shards, -1)
    return out


IDS = torch.randint(3, 301, (3, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.slow  # a multi-process world
@pytest.mark.parametrize("tp, pp, kinds", [(2, 1, ("llama-tied", "qwen2")), (1, 2, ("llama-tied",)),
                                           (2, 2, ("llama-tied", "qwen2"))])
def test_weights_in_and_out_are_bit_exact_and_logits_equal_hugging_faces(tmp_path, tp, pp, kinds):
    """Tied embeddings across pipeline stages (the last stage's copy), Qwen2's QKV bias, GQA split over
    TP, vocabulary padding: the tensors streamed out are the ones loaded, bit for bit."""
    results = run_world(_export_and_logits, tp * pp, tmp_path, tp, pp, kinds, IDS)
    for kind in kinds:
        hf = hf_model(kind)
        exported = results[-1][kind]["exported"]
        expected = hf.state_dict()
        assert set(exported) == set(expected)
        for name, t in expected.items():
            assert torch.equal(exported[name], t), name
        assert all(r[kind]["exported"] == sorted(exported) for r in results[:-1])  # every rank streams them all
        if pp == 1:
            with torch.no_grad():
                reference = hf(IDS).logits
            logits = results[0][kind]["logits"]
            torch.testing.assert_close(logits[..., :301], reference, atol=1e-5, rtol=1e-5)
            assert logits.shape[-1] % (128 * tp) == 0 and torch.all(logits[..., 301:] == 0)  # padded rows


def _bad_layout(rank, world, tp, pp):
    from fastgrpo.trainers.megatron.model import initialize

    initialize(tp, pp)


@pytest.mark.slow  # a multi-process world
def test_a_world_that_does_not_split_fails_clearly(tmp_path):
    with pytest.raises(RuntimeError, match="does not split into tensor 2 x pipeline 2"):
        run_world(_bad_layout, 2, tmp_path, 2, 2)


def test_the_layer_spec_is_transformer_engines_only_where_it_is_installed():
    """`auto` falls back to the local spec without Transformer Engine (as here); asking for Transformer
    Engine where it is missing names the key. The Transformer Engine path itself (its fused-norm names,
    taken from megatron's local spec's own map) needs a CUDA machine and is not exercised here."""
    import importlib.util

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from fastgrpo.protocols import BackendUnavailable
    from fastgrpo.trainers.megatron.model import layer_spec

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed: auto picks it")
    spec, renames = layer_spec("auto")
    assert renames == {} and spec.submodules.input_layernorm == get_gpt_layer_local_spec(normalization="RMSNorm").submodules.input_layernorm
    with pytest.raises(BackendUnavailable, match=r"trainer\.layer_spec=transformer_engine"):
        layer_spec("transformer_engine")


def test_patches_refuse_a_megatron_core_they_were_not_written_for(monkeypatch):
    import megatron.core
    import megatron.core.tensor_parallel.random as tp_random
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    import megatron_patches

    monkeypatch.setattr(megatron_patches, "_applied", {})  # as in a fresh process
    assert megatron_patches.mismatches() == []  # the pinned version, unchanged

    def _get_cuda_rng_state(device="cuda", clone=False, graph_safe=False):  # a changed upstream function
        return None

    monkeypatch.setattr(tp_random, "_get_cuda_rng_state", _get_cuda_rng_state)
    monkeypatch.setattr(megatron.core, "__version__", "0.17.0")

    def _build_model_and_main_param_groups(*args):  # what a wrapped constructor calls, changed upstream
        return None

    monkeypatch.setattr(DistributedOptimizer, "_build_model_and_main_param_groups",
                        staticmethod(_build_model_and_main_param_groups))
    problems = megatron_patches.mismatches()
    assert any("megatron-core 0.17.0 is installed" in p for p in problems)
    assert any("_get_cuda_rng_state changed" in p for p in problems)
    assert any("DistributedOptimizer._build_model_and_main_param_groups changed" in p
               and "the patch of DistributedOptimizer.__init__" in p for p in problems), problems
    if megatron_patches.needed():
        with pytest.raises(megatron_patches.PatchMismatch, match="_get_cuda_rng_state changed"):
            megatron_patches.apply()
        assert tp_random._get_cuda_rng_state is _get_cuda_rng_state  # nothing was patched


SAMPLINGS = [dict(temperature=0.7), dict(temperature=1.0, top_p=0.9, top_k=5)]


def _hf_logprobs_and_grads(kind, ids, sampling, weights):
    from fastgrpo.trainers.torch_trainer import token_logprobs
    from fastgrpo.grpo.batch import build_batch

    hf = hf_model(kind)
    batch = build_batch([row[:4].tolist() for row in ids], [row[4:].tolist() for row in ids],
                        [[0.0] * (ids.shape[1] - 4)] * ids.shape[0], torch.zeros(ids.shape[0]), pad_id=0)
    logp, entropy = token_logprobs(hf, batch, sampling)
    ((logp[:, 1:] * weights[0]).sum() + (entropy[:, 1:] * weights[1]).sum()).backward()
    return logp[:, 1:].detach(), entropy[:, 1:].detach(), {n: p.grad for n, p in hf.named_parameters()}


def _megatron_logprobs_and_grads(rank, world, tp, kind, ids, samplings, weights):
    from fastgrpo.trainers.megatron.logprobs import vocab_parallel_logprobs
    from fastgrpo.trainers.megatron.model import export_hf, initialize
    from fastgrpo.types import SamplingParams

    initialize(tp, 1)
    out = []
    for s in samplings:
        model, layout = _load(kind, tp, 1)
        n = ids.shape[1]
        logits = model(ids, torch.arange(n).expand(ids.shape[0], -1),
                       attention_mask=torch.triu(torch.ones(n, n, dtype=torch.bool), 1)[None, None])
        logp, entropy = vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:], SamplingParams(**s), layout.vocab)
        ((logp * weights[0]).sum() + (entropy * weights[1]).sum()).backward()
        out.append((logp.detach(), entropy.detach(), dict(export_hf(model, layout, grads=True))))
    return out


@pytest.mark.slow  # a multi-process world
@pytest.mark.parametrize("tp", [1, 2])
def test_vocab_parallel_logprobs_entropy_and_gradients_equal_the_torch_trainers(tmp_path, tp):
    """The trainer scores the engine's sampling distribution (temperature; top-k and top-p), with the
    entropy's gradient: the same numbers and the same parameter gradients as the torch trainer."""
    from fastgrpo.types import SamplingParams

    kind = "qwen2"
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 301, (2, 10), generator=gen)
    weights = (torch.randn(2, 9, generator=gen), torch.randn(2, 9, generator=gen))
    results = run_world(_megatron_logprobs_and_grads, tp, tmp_path, tp, kind, ids, SAMPLINGS, weights)[0]
    for s, (logp, entropy, grads) in zip(SAMPLINGS, results):
        ref_logp, ref_entropy, ref_grads = _hf_logprobs_and_grads(kind, ids, SamplingParams(**s), weights)
        torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0)
        torch.testing.assert_close(entropy, ref_entropy, atol=1e-5, rtol=0)
        assert set(grads) == set(ref_grads)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-4, msg=name)


# 4-row minibatches (micro-batches of 3 and 1 rows); a k3 KL to the initial policy (a second model in the layout)
GRPO = dict(minibatches=2, micro_batch_size=3, tis_cap=2.0, kl_coef=0.05)
OPTIM = dict(lr=1e-3, grad_clip=0.5, warmup_steps=2)


def _grpo_batch(trainer_logprobs):
    from fastgrpo.grpo.batch import build_batch

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 301, (4,), generator=gen).tolist() for _ in range(8)]
    responses = [torch.randint(3, 301, (3 + i % 4,), generator=gen).tolist() for i in range(8)]
    batch = build_batch(prompts, responses, [[0.0] * len(r) for r in responses], torch.randn(8, generator=gen), pad_id=0)
    batch.engine_logprobs = trainer_logprobs(batch) * batch.response_mask  # the engine sampled with the same weights
    return batch


def _megatron_train_step(rank, world, tp, pp, policy_dir):
    from fastgrpo.trainers.megatron.trainer import MegatronPolicyTrainer
    from fastgrpo.config import GRPOConfig, OptimConfig
    from fastgrpo.types import SamplingParams

    trainer = MegatronPolicyTrainer(policy_dir, GRPOConfig(**GRPO), OptimConfig(**OPTIM), SamplingParams(temperature=0.7),
                                    tensor=tp, pipeline=pp)
    batch = _grpo_batch(trainer.logprobs)
    scores = trainer.logprobs_and_entropy(batch)
    metrics = [trainer.train_step(batch), trainer.train_step(batch)]
    return scores, metrics, dict(trainer.export_weights())


def torch_trainer_run(policy_dir, steps: int):
    """The torch trainer on the same batch: its per-token log-probabilities and entropy, the metrics of
    `steps` train steps, and its weights after them."""
    from fastgrpo.trainers.torch_trainer import TorchPolicyTrainer, token_logprobs
    from fastgrpo.config import GRPOConfig, OptimConfig
    from fastgrpo.models.policy import load_policy
    from fastgrpo.types import SamplingParams

    sampling = SamplingParams(temperature=0.7)
    trainer = TorchPolicyTrainer(load_policy(policy_dir), GRPOConfig(**GRPO), OptimConfig(**OPTIM), sampling,
                                 reference=load_policy(policy_dir))
    batch = _grpo_batch(trainer.logprobs)
    with torch.no_grad():
        scores = token_logprobs(trainer.model, batch, sampling)
    metrics = [trainer.train_step(batch) for _ in range(steps)]
    return batch, scores, metrics, trainer.model.state_dict()


def assert_same_step_as_torch(results, policy_dir, kind):
    """`results`: each rank's (log-probabilities and entropy, the metrics of two train steps, the
    exported weights) from `_megatron_train_step`; all equal to the torch trainer's."""
    batch, (want_logp, want_entropy), expected, state = torch_trainer_run(policy_dir, 2)
    real = batch.attention_mask.bool()
    real[:, 0] = False  # position 0 has no prediction
    for (logp, entropy), _, _ in results:  # every rank, whichever stage it is
        assert float((logp - want_logp)[real].abs().max()) <= 1e-5
        assert float((entropy - want_entropy)[real].abs().max()) <= 1e-5
        assert float(entropy[real].min()) > 0.1  # real numbers, not zeros on both sides
    for _, metrics, _ in results:
        assert metrics == results[0][1]  # every rank reports the same metrics
    for got, want in zip(results[0][1], expected):
        assert got["updates"] == want["updates"] == 2 and want["grad_norm"] > OPTIM["grad_clip"]  # clipping active
        for key in ("loss", "grad_norm", "clip_fraction", "entropy", "lr"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
        # means of differences of nearly equal log-probabilities: their error is the log-probabilities'
        # own fp32 rounding (absolute, ~1e-6 per token), not relative to the small difference
        for key in ("kl_engine_trainer", "kl_ref"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    assert expected[1]["kl_ref"] > 1e-6  # the policy has moved away from its reference
    initial = hf_model(kind).state_dict()
    for _, _, weights in results:
        assert set(weights) == set(state)
    weights = results[-1][2]
    # relative error of each tensor as a whole: Adam divides each coordinate's step by its gradient's
    # running scale, so a coordinate whose gradient is ~0 moves by a rounding-level amount either way.
    # The key bias has an exactly zero gradient (it shifts all of a query's scores alike, which softmax
    # ignores): both trainers move it by rounding noise alone, so it is held to an absolute bound.
    biases = [name for name in state if name.endswith("k_proj.bias")]
    assert all(float((weights[name] - state[name]).abs().max()) < 1e-4 for name in biases)
    assert_same_update(weights, state, initial, [name for name in state if name not in biases], min_moved=1e-3)


@pytest.mark.slow  # a multi-process world
@pytest.mark.parametrize("tp, pp, world, kind", [(2, 1, 2, "qwen2"), (1, 1, 2, "qwen2"),
                                                 pytest.param(1, 2, 2, "llama-tied", marks=pytest.mark.slow)],
                         ids=["TP2", "DP2", "PP2-tied"])
def test_a_grpo_train_step_equals_the_torch_trainers(tmp_path, tp, pp, world, kind):
    """Per-token log-probabilities and entropy of a batch of mixed lengths, then two GRPO steps of two
    minibatches each (clipping active, warm-up, truncated importance sampling): the same numbers,
    losses, gradient norms and updated weights as the torch trainer, on every rank. The micro-batches
    of a minibatch differ in length and row count (3 rows, then 1). PP2 with tied embeddings: the
    embedding's gradient is the sum of its first-stage and last-stage copies'. TP2 x PP2:
    tests/test_megatron_trainer.py."""
    hf_model(kind).save_pretrained(tmp_path / "policy")
    results = run_world(_megatron_train_step, world, tmp_path / "world", tp, pp, tmp_path / "policy")
    assert_same_step_as_torch(results, tmp_path / "policy", kind)


def _train(rank, world, overrides, resume):
    from fastgrpo.config import load_config
    from fastgrpo.train import train

    return [r.metrics() for r in train(load_config(None, overrides), resume=resume).steps]


@pytest.mark.slow  # a multi-process world
def test_fastgrpo_train_on_the_megatron_backend_matches_torch_and_resumes_exactly(tmp_path, tiny_policy):
    """The single-process loop with trainer.backend=megatron (a world of one): its first step's
    gradient norm and entropy equal the torch trainer's, and 1 step + resume + 1 step gives the same
    second step as 2 steps in one go."""
    from tests.conftest import tiny_overrides

    def run(name, backend, steps, resume=False):
        overrides = tiny_overrides(tmp_path / name, tiny_policy, **{
            "trainer.backend": backend, "grpo.steps": steps, "speculation.policy": "off", "draft.online": "off",
            "grpo.drop_equal_reward_groups": "false", "eval.at_start": "false", "checkpoint.every": 1})
        if backend == "torch":
            return _train(0, 1, overrides, resume)
        return run_world(_train, 1, tmp_path / f"{name}-world", overrides, resume)[0]

    torch_steps = run("torch", "torch", 1)
    megatron_steps = run("megatron", "megatron", 2)
    for key in ("grad_norm", "entropy", "reward_mean"):
        assert megatron_steps[0][key] == pytest.approx(torch_steps[0][key], rel=1e-4), key
    run("resumed", "megatron", 1)
    resumed = run("resumed", "megatron", 2, resume=True)
    assert len(resumed) == 1
    for key in ("grad_norm", "loss", "entropy", "reward_mean"):
        assert resumed[0][key] == megatron_steps[1][key], key


@pytest.mark.slow  # a multi-process world
def test_bench_trainer_times_the_torch_and_megatron_steps(tmp_path, tiny_policy):
    import json

    from fastgrpo.trainers.megatron.layout import Layout
    from fastgrpo.bench.trainer import bench_trainer
    from fastgrpo.models.policy import load_policy
    from fastgrpo.plan import Shape, parameters
    from tests.conftest import tiny_config

    out = tmp_path / "trainer.json"
    bench_trainer(tiny_config(tmp_path, tiny_policy), quick=True, output=out,
                  layouts=(("torch", 1, 1, 1, 1), ("megatron", 2, 2, 1, 1), ("megatron-distopt", 2, 1, 1, 1),
                           ("torch-bf16", 1, 1, 1, 1)))
    rows = json.loads(out.read_text())["rows"]
    assert [r["layout"] for r in rows] == ["torch", "megatron TP2", "megatron DP2 distributed optimizer", "torch bf16"]
    assert rows[0]["vs_torch"] == 1.0
    assert rows[0]["comm_s"] == 0.0  # one process: no collectives
    assert 0 < rows[1]["comm_s"] < rows[1]["step_s"]  # TP all-reduces inside the step, and compute besides
    # the push carries the same Hugging Face tensors whatever the layout (TP shards gathered first)
    assert rows[0]["sync_bytes"] == rows[1]["sync_bytes"] == rows[2]["sync_bytes"] > 4 * 296 * 64
    assert [r["engines"] for r in rows] == [1, 1, 2, 1]
    assert all(r["sync_s"] > 0 and r["memcpy_gb_s"] > 0 and 0 < r["sync_share"] < 1 for r in rows)
    # optimizer bytes per rank: Adam's two fp32 moments (8 B) of every parameter in one process (the
    # torch trainer steps the fp32 weights themselves); in megatron, of the parameters with the
    # vocabulary padded (to 384 rows at TP1, 512 at TP2), half of them per rank at TP2 (the model's
    # shards) and with the distributed optimizer at DP2 (the replicas' shards of the state): 1/DP
    config = load_policy(tiny_policy).config
    assert rows[0]["optimizer_bytes"] == 8 * parameters(Shape.of(config))
    assert rows[3]["optimizer_bytes"] == 12 * parameters(Shape.of(config))  # bf16: fp32 masters (4 B) and moments

    def padded(tp):
        s = Layout.of(config, tp, 1)
        return parameters(Shape.of(config)) + (s.padded_vocab - s.vocab) * s.hidden * (1 if s.tied else 2)
    assert rows[1]["optimizer_bytes"] == pytest.approx(8 * padded(2) / 2, rel=0.01)  # (norms are replicated)
    assert rows[2]["optimizer_bytes"] == pytest.approx(8 * padded(1) / 2, rel=0.01)


@pytest.mark.slow  # worlds of 1 and 2 on a random-weight MoE
def test_bench_trainer_moe_pushes_the_same_tensors_with_and_without_expert_parallelism(tmp_path, tiny_policy):
    """`fastgrpo bench trainer --moe`: at EP2 each rank holds half the experts, the push gathers them from
    their ranks, and the engine gets the same Hugging Face tensors (bytes) as from one process."""
    import json

    from fastgrpo.bench.trainer import bench_trainer
    from tests.conftest import tiny_config

    out = tmp_path / "trainer-moe.json"
    bench_trainer(tiny_config(tmp_path, tiny_policy), quick=True, output=out, moe=True,
                  layouts=(("torch", 1, 1, 1, 1), ("megatron", 2, 1, 1, 2)))
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r["layout"] for r in rows] == ["torch", "megatron DP2xEP2"]
    assert "Qwen3-MoE" in result["meta"]["policy"]
    assert rows[0]["sync_bytes"] == rows[1]["sync_bytes"] > 6 * 8 * 3 * 512 * 768 * 4  # every expert, fp32
    assert [r["engines"] for r in rows] == [1, 2] and all(r["sync_s"] > 0 for r in rows)
    # Adam's moments: EP2 halves the experts' (each rank steps its own), the rest stays replicated
    assert rows[1]["optimizer_bytes"] < 0.6 * rows[0]["optimizer_bytes"]


def _load_from_disk(rank, world, policy_dir, tp, pp):
    """This rank's model loaded from the checkpoint on disk and from the state dict, and which Hugging
    Face tensors the disk loader read."""
    from fastgrpo.safetensors_dir import SafetensorsDir
    from fastgrpo.trainers.megatron.model import build_model, initialize, load_hf_checkpoint

    initialize(tp, pp)
    read = []
    getitem = SafetensorsDir.__getitem__

    def recorded(self, name):
        read.append(name)
        return getitem(self, name)

    SafetensorsDir.__getitem__ = recorded
    model, layout = _load("llama-tied", tp, pp)
    from_disk = build_model(hf_model("llama-tied").config, layout).eval()
    load_hf_checkpoint(from_disk, policy_dir, layout)
    expected, loaded = model.state_dict(), from_disk.state_dict()
    same = sorted(expected) == sorted(loaded) and all(
        torch.equal(expected[k], loaded[k]) for k in expected if not k.endswith("_extra_state"))
    return {"same": same, "read": sorted(set(read))}


@pytest.mark.slow  # a multi-process world
def test_a_rank_reads_from_disk_only_the_tensors_it_holds(tmp_path):
    """`load_hf_checkpoint` (what the trainer loads the policy with) gives each rank the same weights as
    loading the whole state dict, reading from the safetensors only the tensors whose pieces it holds:
    at PP2 stage 0 its two layers and the embedding, stage 1 its two layers, the final norm and (tied)
    the embedding for its output layer; no rank reads the whole model."""
    policy = tmp_path / "policy"
    hf_model("llama-tied").save_pretrained(policy)
    first, last = run_world(_load_from_disk, 2, tmp_path / "world", policy, 1, 2)
    assert first["same"] and last["same"]
    layers = lambda r: {int(n.split(".")[2]) for n in r["read"] if n.startswith("model.layers.")}  # noqa: E731
    assert layers(first) == {0, 1} and layers(last) == {2, 3}
    assert "model.embed_tokens.weight" in first["read"] and "model.embed_tokens.weight" in last["read"]
    assert "model.norm.weight" in last["read"] and "model.norm.weight" not in first["read"]
