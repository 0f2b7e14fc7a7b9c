"""The Hugging Face <-> Megatron layout: bit-exact round trips at every TP x PP, and clear errors."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from fastgrpo.trainers.megatron.layout import Layout, LayoutError

LLAMA = dict(vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=8)


def llama(tied=True):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(tie_word_embeddings=tied, **LLAMA))


def qwen2():
    torch.manual_seed(1)
    return Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=False, **LLAMA))


def hf_state(model):
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def round_trip(model, tp, pp):
    """HF -> the tensors every (tp, pp) rank holds -> gathered back -> HF."""
    layout = Layout.of(model.config, tp, pp)
    full = layout.to_megatron(hf_state(model))
    ranks = {(t, p): layout.rank_tensors(full, t, p) for t in range(tp) for p in range(pp)}
    back = {}
    for p in range(pp):
        for local in ranks[(0, p)]:
            name = layout.global_name(local, p)
            if layout.tied and name == "output_layer.weight":
                continue  # the last stage's copy of the embedding
            back.update(layout.to_hf(name, layout.unshard(name, [ranks[(t, p)][local] for t in range(tp)])))
    return layout, ranks, back


@pytest.mark.parametrize("make", [llama, lambda: llama(tied=False), qwen2], ids=["llama-tied", "llama-untied", "qwen2"])
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 4)])
def test_hf_to_megatron_to_hf_is_bit_exact(make, tp, pp):
    model = make()
    layout, ranks, back = round_trip(model, tp, pp)
    expected = dict(model.state_dict())
    assert set(back) == set(expected)
    for name, t in expected.items():
        assert torch.equal(back[name], t), name
    # each rank holds its stage's layers only, under stage-local indices, and a 1/tp slice of the big matrices
    per_stage = model.config.num_hidden_layers // pp
    for (t, p), tensors in ranks.items():
        layers = {int(n.split(".")[2]) for n in tensors if n.startswith("decoder.layers.")}
        assert layers == set(range(per_stage))
        qkv = tensors["decoder.layers.0.self_attention.linear_qkv.weight"]
        assert qkv.shape == ((8 + 2 * 4) * 8 // tp, 64)
        assert ("embedding.word_embeddings.weight" in tensors) == (p == 0)
        assert ("decoder.final_layernorm.weight" in tensors) == (p == pp - 1)
        if p == 0:
            assert tensors["embedding.word_embeddings.weight"].shape == (layout.padded_vocab // tp, 64)
    assert layout.padded_vocab % (128 * tp) == 0 and layout.padded_vocab >= 301


def test_qkv_rows_are_grouped_per_query_group():
    """Megatron's fused QKV holds, for each KV group, that group's query heads, then its k, then its v."""
    model = llama()
    layout = Layout.of(model.config)
    qkv = layout.to_megatron(hf_state(model))["decoder.layers.0.self_attention.linear_qkv.weight"]
    attn = model.model.layers[0].self_attn
    d, hpg = 8, 2
    group1 = qkv[(hpg + 2) * d: 2 * (hpg + 2) * d]
    assert torch.equal(group1[: hpg * d], attn.q_proj.weight[hpg * d: 2 * hpg * d])
    assert torch.equal(group1[hpg * d: (hpg + 1) * d], attn.k_proj.weight[d: 2 * d])
    assert torch.equal(group1[(hpg + 1) * d:], attn.v_proj.weight[d: 2 * d])


def test_fc1_shards_hold_their_own_gate_and_up():
    model = llama()
    layout = Layout.of(model.config, tensor=2)
    full = layout.to_megatron(hf_state(model))
    shard1 = layout.rank_tensors(full, 1, 0)["decoder.layers.0.mlp.linear_fc1.weight"]
    mlp = model.model.layers[0].mlp
    assert torch.equal(shard1, torch.cat([mlp.gate_proj.weight[48:], mlp.up_proj.weight[48:]]))


def test_layouts_that_cannot_split_fail_clearly():
    cfg = LlamaConfig(**LLAMA)
    with pytest.raises(LayoutError, match="key/value heads"):
        Layout.of(cfg, tensor=8)  # 8 query heads split, but only 4 KV heads
    with pytest.raises(LayoutError, match=r"parallel\.pipeline breaks a layout rule: pipeline \d+ divides the 4 layers"):
        Layout.of(cfg, pipeline=3)
    with pytest.raises(LayoutError, match="attention heads"):
        Layout.of(cfg, tensor=3)
    with pytest.raises(LayoutError, match="vocabulary"):
        Layout.of(cfg).to_megatron({"model.embed_tokens.weight": torch.zeros(7, 64), "model.norm.weight": torch.ones(64)})
    with pytest.raises(LayoutError, match="unknown Megatron parameter"):
        list(Layout.of(cfg).to_hf("decoder.layers.0.self_attention.q_layernorm.weight", torch.ones(8)))
