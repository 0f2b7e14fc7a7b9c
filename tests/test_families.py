"""The embedded engine serves the model families people RL-train, each as Hugging Face computes it:
Llama 3.1 (llama3 rope scaling, untied head), Qwen2.5 (q/k/v biases, tied head), Qwen3 dense (q/k norms
per head before the rotation, a head size other than hidden / heads). Tiny random-weight models from
transformers' own config classes, fp32; every norm weight and bias drawn away from its initial 1 / 0, so
a part the engine left out or applied in the wrong place shows in the logits."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

import fastgrpo.device
from fastgrpo.draft_learning.pretrain import target_states
from fastgrpo.draft_learning.trainer import DraftTrainer
from fastgrpo.models.draft import DraftHead
from fastgrpo.engines.embedded.engine import EmbeddedEngine
from fastgrpo.models.layouts import layer_layout
from fastgrpo.engines.embedded.model import InferenceModel, KVCache
from fastgrpo.models.layers import attention, onednn_available
from fastgrpo.models.rope import rope_tables
from fastgrpo.speculation.policy import Static
from fastgrpo.speculation.spec import SpecConfig
from fastgrpo.types import Request, SamplingParams
from tests.device_guard import strict_device

VOCAB, EOS = 61, 2
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1,
             eos_token_id=EOS, pad_token_id=None,
             initializer_range=0.1)  # weights large enough that attention depends on positions (rope)
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)  # small: in a 16-wide head most frequencies are scaled


def llama31():
    return LlamaConfig(**SIZES, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False)


def qwen25():
    return Qwen2Config(**SIZES, rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
                       tie_word_embeddings=True)


def qwen3():
    return Qwen3Config(**SIZES, head_dim=32, rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
                       tie_word_embeddings=False)  # head_dim 32, not 64 / 4: q_proj is [128, 64]


FAMILIES = {"llama3.1": llama31, "qwen2.5": qwen25, "qwen3": qwen3}
KERNELS = ["dense"] + (["onednn"] if onednn_available() else [])


def hf_model(cfg, seed=0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(4.0)  # peaked next-token distributions: few near ties
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    cfg = FAMILIES[request.param]()
    return request.param, cfg, hf_model(cfg)


def chunked_logits(model, cfg, ids):
    """The engine's logits over `ids` [3, 24] through the KV cache: prefill, one decode, two blocks."""
    cache = KVCache(cfg, 4, 128)
    rows = slice(1, 4)
    chunks = []
    for a, b in [(0, 10), (10, 11), (11, 17), (17, 24)]:
        logits, _ = model.forward(ids[:, a:b], cache, rows)
        cache.lengths[rows] += b - a
        chunks.append(logits)
    return torch.cat(chunks, 1)


def test_the_families_are_the_shapes_they_claim():
    """The fixtures hold each family's distinguishing parts (else the tests below would prove less)."""
    names = {k: set(dict(hf_model(f()).named_parameters())) for k, f in FAMILIES.items()}
    assert "model.layers.0.self_attn.q_proj.bias" in names["qwen2.5"]
    assert "model.layers.0.self_attn.q_norm.weight" in names["qwen3"]
    assert "lm_head.weight" in names["llama3.1"] and "lm_head.weight" not in names["qwen2.5"]  # untied / tied
    assert hf_model(qwen3()).model.layers[0].self_attn.q_proj.weight.shape == (128, 64)
    assert llama31().rope_parameters["rope_type"] == "llama3"


@pytest.mark.parametrize("kernel", KERNELS)
def test_logits_equal_hf_through_the_kv_cache(family, kernel):
    name, cfg, hf = family
    ids = torch.randint(3, VOCAB, (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    model = InferenceModel(cfg, 128, kernel=kernel)
    assert model.load(hf.state_dict().items()) == len(model.named_weights())  # every engine tensor written
    got = chunked_logits(model, cfg, ids)
    diff = (got - ref).abs().max().item()
    print(f"\n{name} [{kernel}]: max |logit - HF| = {diff:.2e} (logits up to {ref.abs().max().item():.1f})")
    assert diff < 1e-4


def tree_of_four() -> tuple[torch.Tensor, torch.Tensor]:
    """A verify tree of four nodes (the root, two children, a grandchild under the first child): each
    node's depth, and which nodes each one sees (itself and its ancestors)."""
    parent = [None, 0, 0, 1]
    sees = torch.eye(4, dtype=torch.bool)
    for i, p in enumerate(parent):
        while p is not None:
            sees[i, p], p = True, parent[p]
    return torch.tensor([0, 1, 1, 2]), sees


def test_a_verify_tree_step_equals_hf_along_each_path(family):
    """A speculative verify step: after a prefill, one block of tree nodes (the root, two children, a
    grandchild under the first child), each at the position of its depth and seeing only its ancestors;
    every node's logits equal Hugging Face's over the prompt and the node's own path."""
    name, cfg, hf = family
    ids = torch.randint(3, VOCAB, (2, 14), generator=torch.Generator().manual_seed(4))
    depth, sees = tree_of_four()
    model = InferenceModel(cfg, 128, kernel="dense")
    model.load(hf.state_dict().items())
    cache = KVCache(cfg, 2, 128)
    model.forward(ids[:, :10], cache, slice(0, 2))
    cache.lengths += 10
    logits, _ = model.forward(ids[:, 10:], cache, slice(0, 2), positions=10 + depth.expand(2, 4),
                              new_mask=sees.expand(2, 4, 4))
    for b in range(2):
        for i in range(4):
            path = [j for j in range(4) if sees[i, j]]  # ancestors, in order, then the node
            with torch.no_grad():
                ref = hf(torch.cat([ids[b, :10], ids[b, 10:][path]])[None],
                         position_ids=torch.cat([torch.arange(10), 10 + depth[path]])[None]).logits[0, -1]
            assert (logits[b, i] - ref).abs().max() < 1e-4, (name, b, i)


def test_each_familys_own_part_changes_the_logits(family):
    """Leaving out what makes the family (Qwen2's biases, Qwen3's q/k norms, Llama 3.1's rope scaling)
    moves the logits far beyond the 1e-4 the test above holds them to: that test can fail."""
    name, cfg, hf = family
    ids = torch.randint(3, VOCAB, (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    model = InferenceModel(cfg, 128, kernel="dense")
    if name == "qwen2.5":
        model.load((n, t) for n, t in hf.state_dict().items() if not n.endswith(".bias"))  # biases stay 0
    else:
        model.load(hf.state_dict().items())
    if name == "qwen3":
        for L in model.layers:  # the forward skips the q/k norms
            del L["q_norm"], L["k_norm"]
    if name == "llama3.1":  # the rotations of the unscaled rope
        plain = LlamaConfig(**{**cfg.to_dict(), "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}})
        model.cos, model.sin = rope_tables(plain, 128)
    assert (chunked_logits(model, cfg, ids) - ref).abs().max() > 1e-2


@pytest.mark.parametrize("heads,kv_heads,n", [(8, 2, 1), (8, 2, 5), (6, 1, 3), (4, 4, 2)])
def test_masked_grouped_query_attention_equals_repeated_keys(heads, kv_heads, n):
    """The decoder's attention under a mask, its query heads grouped per key head, against the reference:
    each key head repeated for its query heads (Hugging Face's repeat_kv), one SDPA call per head count."""
    g = torch.Generator().manual_seed(heads * 10 + n)
    B, ctx, D = 3, 20, 16
    q = torch.randn(B, n, heads, D, generator=g)
    keys, values = torch.randn(B, kv_heads, ctx, D, generator=g), torch.randn(B, kv_heads, ctx, D, generator=g)
    mask = torch.rand(B, 1, n, ctx, generator=g) > 0.4
    mask[..., 0] = True  # every query sees a key
    reps = heads // kv_heads
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), keys.repeat_interleave(reps, 1), values.repeat_interleave(reps, 1), attn_mask=mask)
    got = attention(q, keys, values, mask)
    assert got.shape == (B, n, heads * D)
    torch.testing.assert_close(got, want.transpose(1, 2).reshape(B, n, heads * D), atol=1e-6, rtol=1e-5)



@pytest.mark.parametrize("rope", [dict(rope_type="default"), dict(rope_type="linear", factor=4.0), LLAMA3_ROPE,
                                  dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128)],
                         ids=lambda r: r["rope_type"])
def test_rope_tables_equal_hf_rotary_embedding(rope):
    """cos/sin of each static rope type as transformers' own rotary embedding computes them (yarn's
    attention factor included), for the families' head sizes."""
    for make in (llama31, qwen3):
        cfg = make()
        cfg.rope_parameters = {"rope_theta": 500000.0, **rope}
        cos, sin = rope_tables(cfg, 300)
        x = torch.zeros(1, 300, cfg.hidden_size)
        ref_cos, ref_sin = LlamaRotaryEmbedding(cfg)(x, torch.arange(300)[None])
        assert torch.allclose(cos, ref_cos[0], atol=1e-6, rtol=0) and torch.allclose(sin, ref_sin[0], atol=1e-6, rtol=0)


def test_unsupported_shapes_are_refused_clearly():
    with pytest.raises(ValueError, match="rope type 'dynamic'"):
        rope_tables(LlamaConfig(**SIZES, rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=1e4)), 64)
    with pytest.raises(ValueError, match="sliding-window"):
        layer_layout(Qwen2Config(**SIZES, use_sliding_window=True, max_window_layers=1))
    with pytest.raises(ValueError, match="mlp_bias"):
        layer_layout(LlamaConfig(**SIZES, mlp_bias=True))
    from transformers import GPT2Config
    with pytest.raises(ValueError, match=r"\['llama', 'qwen2', 'qwen3', 'qwen3_moe'\]"):
        layer_layout(GPT2Config())


def greedy_near_tie(hf, prompt, a, b, tol=1e-4) -> bool:
    """Two greedy continuations: equal, or where they first differ HF's own two choices are within
    `tol` of each other (a float-rounding flip between tied tokens)."""
    t = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if t is None:
        return len(a) == len(b)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + a[:t]])).logits[0, -1]
    top = logits.max()
    return bool(top - logits[a[t]] < tol and top - logits[b[t]] < tol)


def prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def engine_for(cfg, hf, draft=None, policy=None, max_batch=4, static_steps=None):
    engine = EmbeddedEngine(cfg, max_batch, 128, eos_id=EOS, pad_id=0, policy=policy, static_steps=static_steps)
    engine.update_weights(hf.state_dict().items(), version=0)
    if draft is not None:
        engine.update_draft(draft.state_dict().items(), version=0)
    return engine


def test_greedy_tokens_equal_hf_generate(family):
    name, cfg, hf = family
    ps = prompts(4, seed=2)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    ours = engine_for(cfg, hf).generate([Request(p) for p in ps], greedy)
    for p, o in zip(ps, ours):
        out = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=EOS, pad_token_id=0)
        theirs = out[0, len(p):].tolist()
        assert greedy_near_tie(hf, p, o.token_ids, theirs), (name, p, o.token_ids, theirs)


def trained_draft(cfg, hf, ps):
    """A draft of the family's shape trained briefly on the target's own greedy continuations of `ps`:
    accepted often, so speculation's accepted-path moves are exercised."""
    out = engine_for(cfg, hf, max_batch=8).generate([Request(p) for p in ps], SamplingParams(temperature=0.0,
                                                                                             max_new_tokens=40))
    hidden, tokens, mask = target_states(hf, [p + o.token_ids for p, o in zip(ps, out)])
    draft = DraftHead(cfg)
    draft.bind_target(hf.get_input_embeddings().weight, hf.get_output_embeddings().weight)
    trainer = DraftTrainer(draft, lr=1e-2)
    for _ in range(30):  # accept_len 2.6-3.8 per family
        trainer.step(hidden, tokens, mask)
    return draft


@pytest.mark.slow  # a draft trained per family: 12-17 s each
def test_speculative_greedy_equals_plain_greedy(family, monkeypatch):
    """One speculative generate (a static tree, a draft sized from the family) gives the plain engine's
    greedy tokens, with draft tokens accepted; it makes no tensor off the engine's device (the device
    contexts entered as a GPU run enters them, under tests/device_guard.py's StrictDevice)."""
    name, cfg, hf = family
    ps = prompts(6, seed=3)
    draft = trained_draft(cfg, hf, ps)
    layout = layer_layout(cfg)  # the draft's layer has the target's heads and head size
    assert draft.layer["wqkv"].shape == ((layout.heads + 2 * layout.kv_heads) * layout.head_dim, cfg.hidden_size)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=40)
    plain = engine_for(cfg, hf).generate([Request(p) for p in ps], greedy)
    monkeypatch.setattr(fastgrpo.device, "ENTER_CPU_CONTEXT", True)
    engine = engine_for(cfg, hf, draft, Static(SpecConfig(3, 3, 8)))
    with strict_device() as guard:
        spec = engine.generate([Request(p) for p in ps], greedy)
    assert not guard.violations, guard.violations
    for p, a, b in zip(ps, spec, plain):
        assert greedy_near_tie(hf, p, a.token_ids, b.token_ids), (name, p, a.token_ids, b.token_ids)
    stats = engine.stats()
    print(f"\n{name}: speculative accept_len {stats['accept_len']:.2f} over {stats['spec_steps']} steps")
    assert stats["spec_steps"] > 0 and stats["accept_len"] > 1.0


def test_the_cost_model_cache_tells_the_families_shapes_apart():
    """A cost model is cached per model shape: models of one hidden size, depth and MLP width but other
    heads, head size or family get their own calibration, not another shape's."""
    from fastgrpo.engines.embedded.calibrate import shape_key

    base = {k: SIZES[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                  "num_attention_heads", "num_key_value_heads")}
    keys = [shape_key(InferenceModel(cfg, 32)) for cfg in (
        LlamaConfig(**base), LlamaConfig(**{**base, "num_key_value_heads": 4}), Qwen3Config(**base, head_dim=32),
        Qwen2Config(**base))]
    assert len(set(keys)) == 4, keys
    assert shape_key(InferenceModel(LlamaConfig(**base), 32)) == keys[0]  # and a shape keeps its key
