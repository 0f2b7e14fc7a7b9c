"""tools/convert_checkpoint.py: Hugging Face <-> Megatron round trips bit-exact at TP2 x PP2 and through
a reshard, sharded Hugging Face input and output, the Megatron trainer loading a converted checkpoint
and a training checkpoint converted to Hugging Face with the trainer's logits, inspect/verify and the
manifest, bad input (a clear error and no partial output), the 70B dry run on the meta device."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tools import convert_checkpoint as cc

pytest.importorskip("megatron.core")

MODELS = Path(__file__).resolve().parents[1] / "configs" / "models"


def real_scaled(name: str, **kw):
    """A real configuration (configs/models) scaled down: the real structure, test size."""
    return cc.scaled_config(cc.load_config(MODELS / f"{name}.json"), **kw)


def save_hf(config, directory: Path, seed: int = 0, **save_kw) -> dict:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory, **save_kw)
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


def hf_tensors(directory: Path) -> dict:
    out = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def assert_bit_exact(got: dict, expected: dict) -> None:
    assert set(got) == set(expected), set(got) ^ set(expected)
    for k, t in expected.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k


def run(*argv) -> int:
    return cc.main([str(a) for a in argv])


@pytest.mark.parametrize("model", ["llama-3-70b", "qwen2.5-7b"])
def test_hf_to_megatron_tp2_pp2_to_hf_is_bit_exact(tmp_path, model):
    """Real structures (GQA 8:1 and 7:1, Qwen's QKV bias) through TP2 x PP2 and back; the Hugging Face
    output loads in transformers; the manifests of all three agree."""
    from transformers import AutoModelForCausalLM

    config = real_scaled(model)
    expected = save_hf(config, tmp_path / "hf")
    assert run("hf-to-megatron", "--hf", tmp_path / "hf", "--out", tmp_path / "mg", "--tensor", 2, "--pipeline", 2) == 0
    assert run("megatron-to-hf", "--megatron", tmp_path / "mg", "--out", tmp_path / "back") == 0
    assert_bit_exact(hf_tensors(tmp_path / "back"), expected)
    info = json.loads((tmp_path / "mg" / "megatron" / "fastgrpo.json").read_text())
    assert info["saved_at"] == {"tensor": 2, "pipeline": 2, "expert": 1, "data": 1} and info["optimizer"] is False
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    assert all(torch.equal(back.state_dict()[k], t) for k, t in expected.items())
    manifests = [json.loads((d / cc.MANIFEST).read_text())["tensors"] for d in (tmp_path / "back", tmp_path / "mg" / "megatron")]
    assert manifests[0] == manifests[1] and set(manifests[0]) == set(expected)


def test_reshard_tp2_to_pp2_and_sharded_hf_in_and_out(tmp_path):
    """Sharded Hugging Face input (index file) -> Megatron TP2 -> reshard to PP2 -> sharded output
    with an index, bit-exact; the stored pieces follow the layout asked for."""
    config = real_scaled("qwen2.5-72b")
    expected = save_hf(config, tmp_path / "hf", max_shard_size="100KB")
    assert (tmp_path / "hf" / cc.INDEX).is_file()
    assert run("hf-to-megatron", "--hf", tmp_path / "hf", "--out", tmp_path / "tp2", "--tensor", 2) == 0
    # --tp and --pp: the older names of --tensor and --pipeline, the same options
    assert run("reshard", "--megatron", tmp_path / "tp2", "--out", tmp_path / "pp2", "--tp", 1, "--pp", 2) == 0
    assert run("megatron-to-hf", "--megatron", tmp_path / "pp2", "--out", tmp_path / "back",
               "--max-shard-size", "100KB") == 0
    index = json.loads((tmp_path / "back" / cc.INDEX).read_text())
    assert set(index["weight_map"]) == set(expected) and len(set(index["weight_map"].values())) > 1
    assert_bit_exact(hf_tensors(tmp_path / "back"), expected)
    qkv = cc.MegatronSource(tmp_path / "tp2").metadata.state_dict_metadata["decoder.layers.self_attention.linear_qkv.weight"]
    assert len(qkv.chunks) == 2 * config.num_hidden_layers  # a piece per TP rank per layer
    qkv = cc.MegatronSource(tmp_path / "pp2").metadata.state_dict_metadata["decoder.layers.self_attention.linear_qkv.weight"]
    assert len(qkv.chunks) == config.num_hidden_layers


@pytest.mark.parametrize("model, key", [
    ("qwen2.5-7b", None),
    # a mixture of experts: extra states per layer and expert included
    ("qwen3-30b-a3b", "decoder.layers.mlp.experts.experts.linear_fc2._extra_state/shard_1.7_2.8"),
])
def test_dist_keys_and_shapes_are_megatrons(tmp_path, model, key):
    """The keys, stacked shapes and pieces written are those of the trainer's GPTModel
    (`sharded_state_dict` of megatron's own model at TP1, where every piece is local; with megatron's
    MoELayer for a mixture of experts)."""
    from fastgrpo.local_world import run_world

    config = real_scaled(model)
    save_hf(config, tmp_path / "hf")
    assert run("hf-to-megatron", "--hf", tmp_path / "hf", "--out", tmp_path / "mg") == 0
    md = cc.MegatronSource(tmp_path / "mg").metadata.state_dict_metadata
    ours = {k: tuple(v.size) if hasattr(v, "size") else None for k, v in md.items()}
    theirs = run_world(_megatron_keys, 1, tmp_path / "world", config.to_dict())[0]
    assert ours == theirs
    assert key is None or key in ours


def _megatron_keys(rank, world, raw):
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
    from transformers import AutoConfig

    from fastgrpo.trainers.megatron.layout import Layout
    from fastgrpo.trainers.megatron.model import build_model, initialize

    config = AutoConfig.for_model(**raw)
    layout = Layout.of(config)
    initialize(1, 1)
    out = {}
    for v in build_model(config, layout, "local").sharded_state_dict().values():
        if isinstance(v, ShardedTensor):
            out[v.key] = tuple(v.global_shape)
        elif isinstance(v, ShardedObject):
            out[v.unique_key] = None
        elif isinstance(v, ShardedTensorFactory):  # swiglu fc1: [gate; up] stacked over layers (and experts)
            out[v.key] = ((config.num_hidden_layers, layout.experts, 2 * layout.expert_ffn, config.hidden_size)
                          if layout.experts else (config.num_hidden_layers, 2 * config.intermediate_size,
                                                  config.hidden_size))
    return out


def _trainer_loads_and_saves(rank, world, policy_dir, converted, checkpoint):
    """At TP2: a trainer loads the converted (model-only) checkpoint, then trains a step and saves a
    training checkpoint; returns the loaded weights, the trained weights and logits."""
    from tests.test_megatron_model import _grpo_batch
    from tests.test_megatron_trainer import IDS, _full_logits, _new_trainer

    trainer = _new_trainer(policy_dir, 2, 1)
    trainer.load(converted)
    loaded = dict(trainer.export_weights())
    trainer.train_step(_grpo_batch(trainer.logprobs))
    trained = dict(trainer.export_weights())
    logits = _full_logits(trainer, IDS)
    trainer.save(checkpoint)
    return loaded, trained, logits


@pytest.mark.slow  # a multi-process world
def test_the_trainer_loads_a_conversion_and_its_checkpoint_converts_back(tmp_path):
    """hf-to-megatron at TP2 x PP2 loaded by the trainer at TP2 (dist-checkpointing reshards), weights
    bit-exact; a GRPO training checkpoint (with optimizer state) of that run -> Hugging Face: the
    trainer's weights bit for bit and logits equal to the trainer's."""
    from transformers import AutoModelForCausalLM

    from fastgrpo.local_world import run_world
    from tests.test_megatron_model import hf_model
    from tests.test_megatron_trainer import IDS, KIND

    hf_model(KIND).save_pretrained(tmp_path / "policy")
    other = hf_model(KIND)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # another model of the same shape: the load must show
    other.save_pretrained(tmp_path / "other")
    assert run("hf-to-megatron", "--hf", tmp_path / "other", "--out", tmp_path / "converted", "--tensor", 2, "--pipeline", 2) == 0
    loaded, trained, logits = run_world(_trainer_loads_and_saves, 2, tmp_path / "world", tmp_path / "policy",
                                        tmp_path / "converted", tmp_path / "step", timeout_s=300.0)[0]
    assert_bit_exact(loaded, other.state_dict())
    assert run("megatron-to-hf", "--megatron", tmp_path / "step", "--out", tmp_path / "exported") == 0
    exported = hf_tensors(tmp_path / "exported")
    assert_bit_exact(exported, {k: trained[k] for k in exported})
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, logits, atol=1e-5, rtol=1e-5)
    assert run("verify", tmp_path / "step", tmp_path / "exported") == 0  # Megatron vs HF, names mapped
    assert run("verify", tmp_path / "step" / "policy", tmp_path / "exported") == 0  # the trainer's own HF copy


def test_qwen3_moe_through_megatron_at_tp2_pp2_ep2_is_bit_exact(tmp_path, capsys):
    """Qwen3-30B-A3B's structure (8 experts here, top-2, renormalised) through a Megatron checkpoint
    written at TP2 x PP2 x EP2 and back: every tensor bit for bit under the checkpoint's per-expert
    names, each expert one slice of megatron's [layers, experts, ...] stacks, split over TP as the
    trainer holds it; `verify` agrees (tensors and logits); the dry run counts a rank's share of the
    experts; an EP size that does not divide the experts is refused naming parallel.expert."""
    config = real_scaled("qwen3-30b-a3b")
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 2, 48)
    save_hf(config, tmp_path / "hf")
    expected = hf_tensors(tmp_path / "hf")  # as save_pretrained writes them: each expert its own tensors
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in expected
    assert run("hf-to-megatron", "--hf", tmp_path / "hf", "--out", tmp_path / "mg", "--tensor", 2, "--pipeline", 2, "--expert", 2) == 0
    assert run("megatron-to-hf", "--megatron", tmp_path / "mg", "--out", tmp_path / "back") == 0
    assert_bit_exact(hf_tensors(tmp_path / "back"), expected)
    info = json.loads((tmp_path / "mg" / "megatron" / "fastgrpo.json").read_text())
    assert info["saved_at"]["expert"] == 2 and info["model"]["experts"] == 8
    md = cc.MegatronSource(tmp_path / "mg").metadata.state_dict_metadata
    fc1 = md["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    assert tuple(fc1.size) == (2, 8, 2 * 48, 128) and len(fc1.chunks) == 2 * 8 * 2 * 2  # layer, expert, gate/up, TP
    assert tuple(md["decoder.layers.mlp.experts.experts.linear_fc2.weight"].size) == (2, 8, 128, 48)
    assert tuple(md["decoder.layers.mlp.router.weight"].size) == (2, 8, 128)
    assert run("verify", tmp_path / "hf", tmp_path / "back", "--logits-atol", 0) == 0
    assert run("verify", tmp_path / "hf", tmp_path / "mg", "--logits-atol", 0) == 0
    capsys.readouterr()
    result = cc.dry_run(config, 2, 1, expert=2)
    out = capsys.readouterr().out
    assert "decoder.layers.1.mlp.experts.local_experts.7.linear_fc1.weight" in out and "at TP2 x PP1 x EP2" in out
    experts = 2 * 8 * 3 * 48 * 128 * 4  # layers x experts x (gate, up, down) x their size, fp32
    assert result["per_rank"]["tp0_pp0"] - cc.dry_run(config, 2, 1, expert=1)["per_rank"]["tp0_pp0"] == -experts // 2 // 2
    assert run("hf-to-megatron", "--hf", tmp_path / "hf", "--out", tmp_path / "bad", "--expert", 3) == 2
    assert "parallel.expert=3 divides the 8 experts" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_inspect_verify_and_the_manifest(tmp_path, capsys):
    config = real_scaled("llama-3-8b")
    save_hf(config, tmp_path / "hf")
    save_hf(config, tmp_path / "hf2", seed=1)
    assert run("hf-to-megatron", "--hf", tmp_path / "hf", "--out", tmp_path / "mg", "--tensor", 2) == 0
    capsys.readouterr()
    info = cc.inspect(tmp_path / "mg", check=True, tensors=True)
    assert info["kind"] == "megatron" and info["layout"] == {"tensor": 2, "pipeline": 1}
    assert info["architecture"] == "LlamaForCausalLM" and info["dtype"] == ["float32"]
    assert info["parameters"] == sum(t.numel() for t in hf_tensors(tmp_path / "hf").values())
    assert "sha256" in info["manifest"] and "model.layers.1.mlp.up_proj.weight" in capsys.readouterr().out
    assert run("verify", tmp_path / "hf", tmp_path / "mg") == 0
    assert "largest difference 0 " in capsys.readouterr().out
    assert run("verify", tmp_path / "hf", tmp_path / "hf2", "--no-logits") == 1
    assert "MISMATCH" in capsys.readouterr().out


def _corrupt(file: Path, at: int) -> None:
    data = bytearray(file.read_bytes())
    data[at] ^= 0xFF
    file.write_bytes(bytes(data))


def test_bad_input_is_named_and_leaves_no_output(tmp_path, capsys):
    config = real_scaled("qwen2.5-7b")  # 14 heads, 2 KV heads
    save_hf(config, tmp_path / "hf")
    assert run("hf-to-megatron", "--hf", tmp_path / "hf", "--out", tmp_path / "mg", "--tensor", 2) == 0
    capsys.readouterr()

    def fails(*argv, says: str) -> None:
        out = tmp_path / "out"
        assert run(*argv) == 2
        err = capsys.readouterr().err
        assert says in err, err
        assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))  # nothing half-written

    o = tmp_path / "out"
    fails("hf-to-megatron", "--hf", tmp_path / "hf", "--out", o, "--tensor", 4, says="tensor 4 divides the 14 attention heads")
    save_hf(real_scaled("llama-3-70b"), tmp_path / "gqa")  # 16 heads, 2 KV heads
    fails("hf-to-megatron", "--hf", tmp_path / "gqa", "--out", o, "--tensor", 4, says="tensor 4 divides the 2 key/value heads")
    fails("megatron-to-hf", "--megatron", tmp_path / "hf", "--out", o, says="not a Megatron checkpoint")
    fails("hf-to-megatron", "--hf", tmp_path / "mg" / "megatron", "--out", o, says="is a Megatron checkpoint, not a")
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    fails("hf-to-megatron", "--hf", tmp_path / "noweights", "--out", o, says="holds no safetensors weights")
    fails("megatron-to-hf", "--megatron", tmp_path / "nowhere", "--out", o, says="does not exist")
    fails("hf-to-megatron", "--hf", tmp_path / "hf", "--out", tmp_path / "mg", says="already exists")
    # an architecture not supported, a pickled checkpoint
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    fails("hf-to-megatron", "--hf", gpt2, "--out", o, says="model_type 'gpt2' is not supported")
    binary = tmp_path / "bin"
    binary.mkdir()
    (binary / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    (binary / "pytorch_model.bin").write_bytes(b"not unpickled")
    fails("hf-to-megatron", "--hf", binary, "--out", o, says="pickled checkpoints are never read")
    # a missing shard: of a sharded Hugging Face directory, of a Megatron checkpoint
    save_hf(config, tmp_path / "sharded", max_shard_size="50KB")
    index = json.loads((tmp_path / "sharded" / cc.INDEX).read_text())
    (tmp_path / "sharded" / sorted(set(index["weight_map"].values()))[-1]).unlink()
    fails("hf-to-megatron", "--hf", tmp_path / "sharded", "--out", o, says="missing shard(s) model-")
    (tmp_path / "mg" / "megatron" / "__0_0.distcp").rename(tmp_path / "moved.distcp")
    fails("megatron-to-hf", "--megatron", tmp_path / "mg", "--out", o, says="missing shard file(s) __0_0.distcp")
    (tmp_path / "moved.distcp").rename(tmp_path / "mg" / "megatron" / "__0_0.distcp")
    # a checksum mismatch, found mid-way: the output written so far is removed
    assert run("megatron-to-hf", "--megatron", tmp_path / "mg", "--out", tmp_path / "good") == 0
    st = tmp_path / "good" / "model.safetensors"
    _corrupt(st, st.stat().st_size - 5)  # in the last tensor's data
    fails("hf-to-megatron", "--hf", tmp_path / "good", "--out", o, says="checksum mismatch for tensor model.layers.1.mlp.down_proj.weight")
    _corrupt(tmp_path / "mg" / "megatron" / "__0_0.distcp", (tmp_path / "mg" / "megatron" / "__0_0.distcp").stat().st_size // 2)
    fails("megatron-to-hf", "--megatron", tmp_path / "mg", "--out", o, says="checksum mismatch")


def test_the_70b_dry_run_lists_every_tensor_on_the_meta_device(capsys):
    """The real Llama-3-70B at TP8 x PP4: every Megatron tensor with its piece, and the bytes per rank
    add up to the model (with the padded vocabulary rows and the norms every TP rank holds)."""
    config = cc.load_config(MODELS / "llama-3-70b.json")
    result = cc.dry_run(config, 8, 4)
    out = capsys.readouterr().out
    assert "decoder.layers.79.mlp.linear_fc1.weight" in out and "57344x8192" in out and "7168x8192" in out
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in out and "10240x8192" in out and "1280x8192" in out
    padding = 2 * (129024 - 128256) * 8192 * 2  # embedding and LM head rows, bf16
    norms = (2 * 80 + 1) * 8192 * 2  # replicated on every TP rank
    assert sum(result["per_rank"].values()) == result["model_bytes"] + padding + 7 * norms
    assert "70.55B parameters" in out
    with pytest.raises(cc.CheckpointError, match="divides the 28 attention heads"):
        cc.dry_run(cc.load_config(MODELS / "qwen2.5-7b.json"), 8, 1)


# What SGLang's EAGLE Llama draft loads, from python/sglang/srt/models/llama_eagle.py (sgl-project/sglang,
# 0.5 line, read at commit 034b3be): class LlamaForCausalLMEagle; load_weights prefixes names without
# "lm_head" with "model."; LlamaModel has `fc = nn.Linear(hidden_size * 2, hidden_size)` (weight and
# bias) and `layers.{i}` Llama decoder layers (q/k/v/o_proj, gate/up/down_proj, post_attention_layernorm;
# layer 0's input_layernorm replaced by an identity) and no final norm; embed_tokens/lm_head are the target's.
SGLANG_EAGLE_NAMES = {
    "fc.weight": lambda h, q, kv, f: (h, 2 * h), "fc.bias": lambda h, q, kv, f: (h,),
    "layers.0.self_attn.q_proj.weight": lambda h, q, kv, f: (q, h),
    "layers.0.self_attn.k_proj.weight": lambda h, q, kv, f: (kv, h),
    "layers.0.self_attn.v_proj.weight": lambda h, q, kv, f: (kv, h),
    "layers.0.self_attn.o_proj.weight": lambda h, q, kv, f: (h, q),
    "layers.0.mlp.gate_proj.weight": lambda h, q, kv, f: (f, h), "layers.0.mlp.up_proj.weight": lambda h, q, kv, f: (f, h),
    "layers.0.mlp.down_proj.weight": lambda h, q, kv, f: (h, f),
    "layers.0.post_attention_layernorm.weight": lambda h, q, kv, f: (h,),
}


def test_export_draft_has_sglang_eagle_names_shapes_and_config(tmp_path, capsys):
    """Checked against llama_eagle.py's names (SGLang cannot run on this machine): the tensors, their
    shapes, the config SGLang builds its LlamaConfig from; a draft whose norms SGLang's class cannot hold
    is refused unless --drop-norms."""
    from transformers import LlamaConfig

    from fastgrpo.models.draft import DraftHead
    from tests.test_megatron_model import hf_model

    policy = hf_model("llama-tied")
    policy.save_pretrained(tmp_path / "policy")
    c = policy.config
    draft = DraftHead(LlamaConfig.from_dict(c.to_dict()), max_len=64)
    draft.reset_parameters(seed=3)
    draft.save(tmp_path / "draft")
    args = ("export-draft", "--draft", tmp_path / "draft", "--policy", tmp_path / "policy", "--out", tmp_path / "eagle")
    assert run(*args) == 2 and "no final norm" in capsys.readouterr().err and not (tmp_path / "eagle").exists()
    assert run(*args, "--drop-norms") == 0
    got = hf_tensors(tmp_path / "eagle")
    h, d = c.hidden_size, c.head_dim
    q, kv, f = c.num_attention_heads * d, c.num_key_value_heads * d, c.intermediate_size
    assert {k: tuple(t.shape) for k, t in got.items()} == {k: s(h, q, kv, f) for k, s in SGLANG_EAGLE_NAMES.items()}
    assert torch.equal(got["fc.weight"], draft.fc.detach()) and torch.all(got["fc.bias"] == 0)
    assert torch.equal(torch.cat([got[f"layers.0.self_attn.{x}_proj.weight"] for x in "qkv"]), draft.layer["wqkv"].detach())
    assert torch.equal(torch.cat([got["layers.0.mlp.gate_proj.weight"], got["layers.0.mlp.up_proj.weight"]]),
                       draft.layer["w_gate_up"].detach())
    config = json.loads((tmp_path / "eagle" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "rms_norm_eps"):
        assert config[key] == getattr(c, key), key
    # a tied policy's draft is untied (SGLang would delete the shared weight twice) and names its dtype
    assert c.tie_word_embeddings and config["tie_word_embeddings"] is False and config["dtype"] in ("float32", "bfloat16")
    assert LlamaConfig.from_dict(config).hidden_size == h  # SGLang reads it as a LlamaConfig
