"""The Megatron trainer and HF <-> Megatron conversion on each family fastgrpo serves: Llama 3.1
(llama3 rope scaling, untied head), Qwen2.5 (QKV biases, tied head), Qwen3 (q/k norms, head_dim other
than hidden / heads), as `fastgrpo/bench/family_checkpoints.py` writes them (every norm weight and bias drawn
away from 1 / 0, so a part left out shows).

- At TP2 x PP2 (a world of 4 on gloo) the trainer's per-token log-probabilities and entropy equal
  Hugging Face's within 1e-5 (fp32), past Llama's original_max_position_embeddings; its weight push
  (`export_weights`) carries every tensor under its Hugging Face name, bit for bit; a converted
  checkpoint (another seed's weights) loads into it; a GRPO step on Qwen3 (whose q/k norm gradients
  each TP rank sees only a part of) equals the torch trainer's, with the pad token (id 0, a zero row,
  as Hugging Face initialises it) in the batch: Hugging Face's padding_idx sends its row no gradient,
  and neither does the Megatron trainer. A negative control: Llama 3.1 scored
  with megatron's own rotary frequencies (no scaling, or megatron's llama3 scaling with its fixed
  original_max_position_embeddings of 8192) is far beyond 1e-5.
- HF -> Megatron (TP2 x PP2) -> HF through the conversion command is bit-exact per family, and
  `verify` agrees; the dist-checkpoint keys it writes are the ones megatron's model asks for.
- An unsupported model_type or a config with custom code (auto_map) is refused by convert and by the
  layout, naming the supported families; so are the options of a supported family that megatron-core
  cannot represent.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fastgrpo.local_world import run_world
from fastgrpo.bench.family_checkpoints import FAMILY_NAMES, write_family_checkpoint

pytest.importorskip("megatron.core")

SAMPLING = dict(temperature=0.8)
GRPO = dict(minibatches=1, micro_batch_size=3, tis_cap=2.0, kl_coef=0.0)
OPTIM = dict(lr=1e-3, grad_clip=1.0)
TOL = 1e-5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {f: write_family_checkpoint(f, root / f) for f in FAMILY_NAMES}


def hf_tensors(directory: Path) -> dict:
    out = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def batch_of(vocab: int, seed: int = 0):
    """Six rows of mixed lengths, the longest 84 tokens: past Llama 3.1's (test) original context of 64."""
    from fastgrpo.grpo.batch import build_batch

    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (6 + i,), generator=gen).tolist() for i in range(6)]
    responses = [torch.randint(0, vocab, (l,), generator=gen).tolist() for l in (78, 40, 9, 60, 3, 25)]
    return build_batch(prompts, responses, [[0.0] * len(r) for r in responses], torch.randn(6, generator=gen),
                       pad_id=0)


def _trainer(policy_dir):
    from fastgrpo.config import GRPOConfig, OptimConfig
    from fastgrpo.trainers.megatron.trainer import MegatronPolicyTrainer
    from fastgrpo.types import SamplingParams

    return MegatronPolicyTrainer(policy_dir, GRPOConfig(**GRPO), OptimConfig(**OPTIM), SamplingParams(**SAMPLING),
                                 tensor=2, pipeline=2)


def _families_at_tp2_pp2(rank, world, dirs, converted):
    """For each family: the trainer's scores of its batch, the weights it pushes, the same after loading
    the converted checkpoint of another seed; for llama3.1 the scores with megatron's own rotary
    frequencies (the control); for qwen3 one GRPO step's metrics and weights."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from fastgrpo.models.rope import rope_parameters

    out = {}
    last = rank == world - 1  # only one rank returns full tensors (every rank streams them all)
    for family, policy_dir in dirs.items():
        trainer = _trainer(policy_dir)
        batch = batch_of(trainer.layout.vocab)
        r = out[family] = {"scores": trainer.logprobs_and_entropy(batch)}
        exported = dict(trainer.export_weights())
        r["exported"] = exported if last else sorted(exported)
        if family == "llama3.1":
            rotary = trainer.gpt.rotary_pos_emb
            right = rotary.inv_freq
            d, theta = trainer.layout.head_dim, rope_parameters(trainer.hf_config)["rope_theta"]
            plain = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))  # megatron without scaling
            factor = rope_parameters(trainer.hf_config)["factor"]
            controls = {"no scaling": plain, "megatron llama3 scaling": rotary._apply_scaling(plain, factor=factor)}
            r["controls"] = {}
            for name, inv_freq in controls.items():
                rotary.inv_freq = inv_freq
                RotaryEmbedding.forward.cache_clear()
                r["controls"][name] = trainer.logprobs_and_entropy(batch)[0]
            rotary.inv_freq = right
            RotaryEmbedding.forward.cache_clear()
        if family == "qwen3":
            batch.engine_logprobs = r["scores"][0] * batch.response_mask
            r["metrics"] = trainer.train_step(batch)
            trained = dict(trainer.export_weights())  # every rank takes part in the gathers
            r["trained"] = trained if last else None
        trainer.load(converted[family])
        loaded = dict(trainer.export_weights())
        r["loaded"] = loaded if last else sorted(loaded)
        r["loaded_scores"] = trainer.logprobs_and_entropy(batch)
        del trainer
    return out


def hf_scores(policy_dir, batch):
    from fastgrpo.models.policy import load_policy
    from fastgrpo.trainers.torch_trainer import token_logprobs
    from fastgrpo.types import SamplingParams

    with torch.no_grad():
        return token_logprobs(load_policy(policy_dir), batch, SamplingParams(**SAMPLING))


def max_diff(got, want, batch) -> float:
    real = batch.attention_mask.bool()
    real[:, 0] = False  # position 0 has no prediction
    return float((got - want)[real].abs().max())


@pytest.mark.slow  # a world of 4 building three models each
def test_megatron_tp2_pp2_scores_each_family_as_hugging_face_and_pushes_hf_tensors(tmp_path, checkpoints):
    from fastgrpo.config import GRPOConfig, OptimConfig
    from fastgrpo.models.policy import load_policy
    from fastgrpo.trainers.torch_trainer import TorchPolicyTrainer
    from fastgrpo.types import SamplingParams
    from tests.conftest import assert_same_update

    # another seed's weights of each family, converted to a Megatron checkpoint at TP1 x PP1: the
    # trainer (at TP2 x PP2) loads it by megatron's distributed checkpointing
    other, converted = {}, {}
    for family in FAMILY_NAMES:
        other[family] = write_family_checkpoint(family, tmp_path / f"{family}-seed1", seed=1)
        converted[family] = tmp_path / f"{family}-mg"
        assert run("hf-to-megatron", "--hf", other[family], "--out", converted[family]) == 0
    results = run_world(_families_at_tp2_pp2, 4, tmp_path / "world", checkpoints, converted, timeout_s=600)
    figures = {}
    for family in FAMILY_NAMES:
        batch = batch_of(load_policy(checkpoints[family]).config.vocab_size)
        want_logp, want_entropy = hf_scores(checkpoints[family], batch)
        for r in results:  # every rank returns the same scores, whichever stage it is
            logp, entropy = r[family]["scores"]
            figures[family] = max_diff(logp, want_logp, batch)
            assert figures[family] <= TOL, (family, figures[family])
            assert max_diff(entropy, want_entropy, batch) <= TOL, family
            assert all(r[family]["exported"] == sorted(results[-1][family]["exported"]) for r in results[:-1])
        # the weight push: every tensor under its Hugging Face name (q/k norms, biases), bit for bit
        expected = load_policy(checkpoints[family]).state_dict()
        exported = results[-1][family]["exported"]
        assert set(exported) == set(expected), set(exported) ^ set(expected)
        for name, t in expected.items():
            assert torch.equal(exported[name], t), (family, name)
        # the converted checkpoint of the other seed: loaded bit for bit, and scored as Hugging Face scores it
        expected = load_policy(other[family]).state_dict()
        loaded = results[-1][family]["loaded"]
        assert set(loaded) == set(expected) and all(torch.equal(loaded[k], t) for k, t in expected.items()), family
        assert max_diff(results[0][family]["loaded_scores"][0], hf_scores(other[family], batch)[0], batch) <= TOL
    print(f"\nmax |log-prob diff| vs Hugging Face at TP2 x PP2 (fp32): {figures}")
    # the control: megatron's own rotary frequencies move Llama 3.1's log-probabilities far beyond 1e-5
    batch = batch_of(load_policy(checkpoints["llama3.1"]).config.vocab_size)
    want = hf_scores(checkpoints["llama3.1"], batch)[0]
    controls = {k: max_diff(v, want, batch) for k, v in results[0]["llama3.1"]["controls"].items()}
    print(f"llama3.1 with megatron's own rotary frequencies: {controls}")
    assert all(d > 100 * TOL for d in controls.values()), controls

    # Qwen3: one GRPO step equals the torch trainer's (q/k norm gradients summed over the TP ranks)
    policy = load_policy(checkpoints["qwen3"])
    start = {k: v.clone() for k, v in policy.state_dict().items()}
    torch_trainer = TorchPolicyTrainer(policy, GRPOConfig(**GRPO), OptimConfig(**OPTIM), SamplingParams(**SAMPLING))
    batch = batch_of(policy.config.vocab_size)
    batch.engine_logprobs = hf_scores(checkpoints["qwen3"], batch)[0] * batch.response_mask
    want = torch_trainer.train_step(batch)
    got = results[0]["qwen3"]["metrics"]
    assert all(r["qwen3"]["metrics"] == got for r in results)
    for key in ("loss", "grad_norm", "entropy", "clip_fraction"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    assert want["grad_norm"] > 0
    trained = results[-1]["qwen3"]["trained"]
    norms = [k for k in start if k.endswith(("q_norm.weight", "k_norm.weight"))]
    assert norms and set(trained) == set(start)
    assert_same_update(trained, torch_trainer.model.state_dict(), start, norms, min_moved=1e-4)


def run(*argv) -> int:
    from tools import convert_checkpoint as cc

    return cc.main([str(a) for a in argv])


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_hf_to_megatron_tp2_pp2_to_hf_is_bit_exact(tmp_path, checkpoints, family):
    """Every tensor (Qwen2.5's biases, Qwen3's q/k norms, Llama's untied head) through a Megatron
    checkpoint at TP2 x PP2 and back; `verify` finds the two equal, tensors and logits."""
    from fastgrpo.conversion import verify

    src = checkpoints[family]
    assert run("hf-to-megatron", "--hf", src, "--out", tmp_path / "mg", "--tensor", 2, "--pipeline", 2) == 0
    assert run("megatron-to-hf", "--megatron", tmp_path / "mg", "--out", tmp_path / "back") == 0
    expected, got = hf_tensors(src), hf_tensors(tmp_path / "back")
    assert set(got) == set(expected), set(got) ^ set(expected)
    for k, t in expected.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
    if family == "qwen3":
        assert "model.layers.1.self_attn.k_norm.weight" in got
        assert "decoder.layers.self_attention.q_layernorm.weight" in json.dumps(
            [str(k) for k in _stored_keys(tmp_path / "mg")])
    if family == "qwen2.5":
        assert "model.layers.0.self_attn.v_proj.bias" in got and "lm_head.weight" not in got  # tied
    # the tokenizer and generation_config travel with the weights
    for name in ("tokenizer.json", "generation_config.json", "config.json"):
        assert (tmp_path / "back" / name).read_text() == (src / name).read_text(), name
    assert verify(src, tmp_path / "back", logits_atol=0.0)
    assert verify(src, tmp_path / "mg", logits_atol=0.0)


def _stored_keys(directory: Path) -> set:
    from fastgrpo.conversion import MegatronSource

    return set(MegatronSource(directory).metadata.state_dict_metadata)


def _model_keys(rank, world, directory):
    """The keys (and global shapes) megatron's own model asks a distributed checkpoint for."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
    from transformers import AutoConfig

    from fastgrpo.trainers.megatron.layout import Layout
    from fastgrpo.trainers.megatron.model import build_model, initialize

    config = AutoConfig.from_pretrained(directory)
    initialize(1, 1)
    out = {}
    for v in build_model(config, Layout.of(config), "local").sharded_state_dict().values():
        if isinstance(v, ShardedTensor):
            out[v.key] = tuple(v.global_shape)
        elif isinstance(v, ShardedObject):
            out[v.unique_key] = None
        elif isinstance(v, ShardedTensorFactory):  # swiglu fc1: [gate; up] stacked over layers
            out[v.key] = (config.num_hidden_layers, 2 * config.intermediate_size, config.hidden_size)
    return out


@pytest.mark.slow  # a world of one
def test_the_converted_qwen3_checkpoint_holds_what_megatrons_model_asks_for(tmp_path, checkpoints):
    from fastgrpo.conversion import MegatronSource

    assert run("hf-to-megatron", "--hf", checkpoints["qwen3"], "--out", tmp_path / "mg") == 0
    md = MegatronSource(tmp_path / "mg").metadata.state_dict_metadata
    ours = {k: tuple(v.size) if hasattr(v, "size") else None for k, v in md.items()}
    theirs = run_world(_model_keys, 1, tmp_path / "world", checkpoints["qwen3"])[0]
    assert ours == theirs
    assert ours["decoder.layers.self_attention.q_layernorm.weight"] == (2, 32)  # replicated, stacked over layers


@pytest.mark.parametrize("config, says", [
    ({"model_type": "mistral"}, "model_type 'mistral' is not supported"),
    ({"model_type": "qwen3", "auto_map": {"AutoModelForCausalLM": "modeling_x.X"}}, "custom modelling code"),
])
def test_convert_refuses_an_unsupported_family_naming_the_supported_ones(tmp_path, capsys, checkpoints, config, says):
    from fastgrpo.safetensors_dir import CheckpointError
    from fastgrpo.conversion.sources import load_config

    bad = tmp_path / "bad"
    bad.mkdir()
    raw = {**json.loads((checkpoints["qwen3"] / "config.json").read_text()), **config}
    (bad / "config.json").write_text(json.dumps(raw))
    for name in ("model.safetensors", "tokenizer.json"):
        (bad / name).write_bytes((checkpoints["qwen3"] / name).read_bytes())
    for argv in (("hf-to-megatron", "--hf", bad, "--out", tmp_path / "out", "--tensor", 2),
                 ("hf-to-megatron", "--dry-run", "--config", bad / "config.json"),
                 ("inspect", bad)):
        assert run(*argv) == 2
        err = capsys.readouterr().err
        assert says in err and all(f in err for f in ("llama:", "qwen2:", "qwen3:")), err
    assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError, match=says):
        load_config(bad)


def test_the_layout_refuses_what_megatron_core_cannot_represent(checkpoints):
    """Options of a supported family the Megatron model has no place for are refused by name, before
    any world exists, rather than dropped: o_proj's bias alone (attention_bias on Llama / Qwen3:
    megatron's add_bias_linear would bias the MLP too), a rope whose tables change with the length,
    a rope scaling cos/sin (yarn), an unsupported family."""
    from transformers import AutoConfig

    from fastgrpo.trainers.megatron.layout import Layout, LayoutError

    def config(family, **changes):
        raw = json.loads((checkpoints[family] / "config.json").read_text())
        raw.update(changes)
        return AutoConfig.for_model(**raw)

    assert Layout.of(config("qwen3"), 2, 2).qk_norm and Layout.of(config("qwen3")).head_dim == 32
    assert Layout.of(config("qwen2.5")).qkv_bias and Layout.of(config("qwen2.5")).tied
    assert not Layout.of(config("llama3.1")).tied
    with pytest.raises(LayoutError, match="attention_bias=True"):
        Layout.of(config("qwen3", attention_bias=True))
    with pytest.raises(LayoutError, match="attention_bias=True"):
        Layout.of(config("llama3.1", attention_bias=True))
    with pytest.raises(LayoutError, match="rope type 'dynamic' is not supported"):
        Layout.of(config("llama3.1", rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=1e4)))
    with pytest.raises(LayoutError, match="scales cos/sin"):
        Layout.of(config("qwen3", rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=1e6,
                                                       original_max_position_embeddings=256)))
    with pytest.raises(LayoutError, match="model_type 'mistral' is not supported.*qwen3"):
        Layout.of(AutoConfig.for_model("mistral"))


def test_hugging_faces_rotary_frequencies_are_those_of_its_rotary_embedding(checkpoints):
    """`fastgrpo.models.rope.hf_inv_freq` (what the Megatron model is given) equals each family's own
    Hugging Face rotary embedding, bit for bit; for Llama 3.1's test scaling (original context 64)
    megatron's own llama3 scaling does not."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from fastgrpo.models.policy import load_policy
    from fastgrpo.models.rope import hf_inv_freq

    for family, directory in checkpoints.items():
        model = load_policy(directory)
        inv_freq, scale = hf_inv_freq(model.config)
        assert scale == 1.0 and torch.equal(inv_freq, model.model.rotary_emb.inv_freq), family
    config = load_policy(checkpoints["llama3.1"]).config
    megatron = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_base=500000.0, rope_scaling=True,
                               rope_scaling_factor=8.0, use_cpu_initialization=True)
    assert float((megatron.inv_freq - hf_inv_freq(config)[0]).abs().max()) > 1e-2
