"""The embedded engine serves Qwen3-MoE as Hugging Face computes it: softmax routing over the
router's logits, the top-k experts per token (their weights renormalised when `norm_topk_prob`), each
expert a SwiGLU, held stacked and run as grouped matmuls over the tokens routed to it; dense layers
among the sparse ones where the config says so (`decoder_sparse_step`, `mlp_only_layers`). The
trainers' side (GRPO steps, expert load, the SGLang push names) is tests/test_moe_trainers.py.

Tiny random-weight models from transformers' own config class, fp32. The reference is transformers'
eager experts loop (not its grouped_mm, which is the torch op the engine uses). Router weights are
scaled up so that no token's k-th and (k+1)-th experts are near a tie (checked: a tie would let float
rounding pick another expert); norm weights are drawn away from 1, as in test_families."""

import dataclasses

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from fastgrpo.bridge import checksum
from fastgrpo.models.families import checkpoint_tensors
from fastgrpo.models.draft import DraftHead
from fastgrpo.models.layouts import layer_layout, layer_layouts
from fastgrpo.engines.embedded.model import InferenceModel, KVCache
from fastgrpo.models.layers import onednn_available
from fastgrpo.speculation.policy import Static
from fastgrpo.speculation.spec import SpecConfig
from fastgrpo.types import Request, SamplingParams
from tests.test_families import (EOS, SIZES, VOCAB, chunked_logits, engine_for, greedy_near_tie, prompts,
                                 trained_draft, tree_of_four)

EXPERTS, TOP_K = 8, 2


def qwen3_moe(norm_topk_prob=True, **kw):
    return Qwen3MoeConfig(**{**SIZES, **kw}, head_dim=32, moe_intermediate_size=32, num_experts=EXPERTS,
                          num_experts_per_tok=TOP_K, norm_topk_prob=norm_topk_prob,
                          rope_parameters=dict(rope_type="default", rope_theta=1000000.0), tie_word_embeddings=False)


# "sparse": every layer a mixture of experts, top-k weights renormalised (Qwen3-30B-A3B's routing);
# "mixed": three layers of which only the middle one is sparse (decoder_sparse_step 2), and the
# top-k softmax weights used as they are (norm_topk_prob false)
CONFIGS = {"sparse": lambda: qwen3_moe(),
           "mixed": lambda: qwen3_moe(norm_topk_prob=False, num_hidden_layers=3, decoder_sparse_step=2)}
KERNELS = ["dense"] + (["onednn"] if onednn_available() else [])


def hf_model(cfg, seed=0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, experts_implementation="eager").eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(4.0)  # peaked next-token distributions: few near ties
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):  # the router: well separated expert choices
                p.copy_(0.5 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def moe(request):
    cfg = CONFIGS[request.param]()
    return request.param, cfg, hf_model(cfg)


def ids_for(seed, shape=(3, 24)):
    return torch.randint(3, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def routing_margin(hf, ids) -> float:
    """The smallest gap, over every token of `ids` and every sparse layer, between the softmax
    probabilities of a token's k-th and (k+1)-th experts."""
    with torch.no_grad():
        logits = hf(ids, output_router_logits=True).router_logits
    top = torch.cat([torch.softmax(r.float(), -1).topk(TOP_K + 1, dim=-1).values for r in logits])
    return (top[:, TOP_K - 1] - top[:, TOP_K]).min().item()


def test_the_fixtures_are_what_they_claim(moe):
    """Stacked experts in HF's state dict; the dense layers where the config puts them; routing away
    from ties on the inputs the tests use: the k-th and (k+1)-th experts' probabilities at least 1e-5
    apart for every token, a hundred times what fp32 rounding moves them by (the engine's logits are
    within ~1e-6 of HF's), so no test depends on which of two tied experts rounding picks."""
    name, cfg, hf = moe
    sd = hf.state_dict()
    sparse = [i for i in range(cfg.num_hidden_layers) if f"model.layers.{i}.mlp.gate.weight" in sd]
    assert sparse == ([0, 1] if name == "sparse" else [1])
    assert [L.mlp for L in layer_layouts(cfg)] == ["moe" if i in sparse else "swiglu" for i in range(cfg.num_hidden_layers)]
    assert sd["model.layers.1.mlp.experts.gate_up_proj"].shape == (EXPERTS, 2 * 32, 64)
    assert sd["model.layers.1.mlp.experts.down_proj"].shape == (EXPERTS, 64, 32)
    if name == "mixed":
        assert sd["model.layers.0.mlp.gate_proj.weight"].shape == (cfg.intermediate_size, 64)
    for seed in (1, 4):
        assert routing_margin(hf, ids_for(seed)) > 1e-5


@pytest.mark.parametrize("kernel", KERNELS)
def test_logits_equal_hf_through_the_kv_cache(moe, kernel):
    name, cfg, hf = moe
    ids = ids_for(1)
    with torch.no_grad():
        ref = hf(ids).logits
    model = InferenceModel(cfg, 128, kernel=kernel)
    sd = hf.state_dict()
    assert model.load(sd.items()) == len(sd) == len(dict(model.named_weights()))  # every engine tensor written
    assert all(torch.equal(t, sd[n]) for n, t in model.named_weights())
    got = chunked_logits(model, cfg, ids)
    diff = (got - ref).abs().max().item()
    print(f"\nqwen3_moe {name} [{kernel}]: max |logit - HF| = {diff:.2e} (logits up to {ref.abs().max().item():.1f})")
    assert diff < 1e-4


def test_the_per_expert_matmuls_equal_the_grouped_ones(moe, monkeypatch):
    """Where torch has no _grouped_mm (and off the CPU) the experts run one matmul each: the same logits."""
    name, cfg, hf = moe
    ids = ids_for(1)
    model = InferenceModel(cfg, 128, kernel="dense")
    model.load(hf.state_dict().items())
    grouped = chunked_logits(model, cfg, ids)
    monkeypatch.delattr(torch, "_grouped_mm")
    looped = chunked_logits(model, cfg, ids)
    with torch.no_grad():
        assert (looped - hf(ids).logits).abs().max() < 1e-4 and (looped - grouped).abs().max() < 1e-5


def test_qwen3_moe_is_a_supported_family(moe):
    """The pre-flight check accepts Qwen3-MoE now that the trainers train it (tests/test_moe_trainers.py,
    tests/test_megatron_moe.py), and lists it among the families it names when it refuses one."""
    from fastgrpo.models.families import UnsupportedModel, check_family

    name, cfg, hf = moe
    assert check_family(cfg.to_dict()) == "qwen3_moe"
    with pytest.raises(UnsupportedModel, match="qwen3_moe: Qwen3-MoE"):
        check_family({"model_type": "mixtral"})


def test_a_checkpoint_with_per_expert_tensors_loads(moe, tmp_path):
    """A checkpoint as transformers writes it (save_pretrained: one tensor per expert,
    `mlp.experts.{j}.gate_proj.weight`, ...) loads into the same stacked tensors: every one of its
    tensors is taken, and the engine then holds HF's state dict exactly."""
    name, cfg, hf = moe
    hf.save_pretrained(tmp_path)
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    sparse = sum(L.mlp == "moe" for L in layer_layouts(cfg))
    per_expert = [n for n in on_disk if ".mlp.experts." in n]
    assert len(per_expert) == 3 * EXPERTS * sparse and "model.layers.1.mlp.experts.7.down_proj.weight" in on_disk
    model = InferenceModel(cfg, 128, kernel="dense")
    assert model.load(on_disk.items()) == len(on_disk)
    sd = hf.state_dict()
    assert all(torch.equal(t, sd[n]) for n, t in model.named_weights())
    with pytest.raises(KeyError, match="experts.8"):  # an expert the config does not have
        model.load([("model.layers.1.mlp.experts.8.up_proj.weight", torch.zeros(32, 64))])


def test_a_verify_tree_step_equals_hf_along_each_path(moe):
    """As test_families': a tree of four nodes verified in one block (each node at its depth's position,
    seeing its ancestors); every node's logits equal HF's over the prompt and the node's path. Run as a
    ragged block too (the second row verifies only the root and its first child), as the engine does
    when rows verify trees of different sizes."""
    name, cfg, hf = moe
    ids = ids_for(4, (2, 14))
    depth, sees = tree_of_four()
    model = InferenceModel(cfg, 128, kernel="dense")
    model.load(hf.state_dict().items())
    valid = torch.tensor([[True] * 4, [True, True, False, False]])
    for ragged in (None, valid):
        cache = KVCache(cfg, 2, 128)
        model.forward(ids[:, :10], cache, slice(0, 2))
        cache.lengths += 10
        mask = sees.expand(2, 4, 4) if ragged is None else sees.expand(2, 4, 4) & ragged[:, None, :]
        logits, _ = model.forward(ids[:, 10:], cache, slice(0, 2), positions=10 + depth.expand(2, 4),
                                  new_mask=mask, valid=ragged)
        for b in range(2):
            for i in range(4):
                if ragged is not None and not ragged[b, i]:
                    continue
                path = [j for j in range(4) if sees[i, j]]  # ancestors, in order, then the node
                with torch.no_grad():
                    ref = hf(torch.cat([ids[b, :10], ids[b, 10:][path]])[None],
                             position_ids=torch.cat([torch.arange(10), 10 + depth[path]])[None]).logits[0, -1]
                assert (logits[b, i] - ref).abs().max() < 1e-4, (name, ragged is not None, b, i)


def test_the_routing_normalisation_and_every_expert_matter(moe):
    """Controls: routing with the other normalisation (renormalised top-k weights where HF uses the raw
    softmax ones, or the reverse), or one expert left at zero, moves the logits far beyond the 1e-4
    the tests above hold them to: those tests can fail."""
    name, cfg, hf = moe
    ids = ids_for(1)
    with torch.no_grad():
        ref = hf(ids).logits
    model = InferenceModel(cfg, 128, kernel="dense")
    model.load(hf.state_dict().items())
    model.layouts = [dataclasses.replace(L, moe=dataclasses.replace(L.moe, norm_topk_prob=not L.moe.norm_topk_prob))
                     if L.moe else L for L in model.layouts]
    assert (chunked_logits(model, cfg, ids) - ref).abs().max() > 1e-2
    model = InferenceModel(cfg, 128, kernel="dense")
    model.load(hf.state_dict().items())
    model.layers[1]["experts_gate_up"][3].zero_()  # expert 3 of the sparse layer 1, as a load that missed it
    model.layers[1]["experts_down"][3].zero_()
    assert (chunked_logits(model, cfg, ids) - ref).abs().max() > 1e-2


def test_greedy_tokens_equal_hf_generate(moe):
    name, cfg, hf = moe
    ps = prompts(4, seed=2)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    ours = engine_for(cfg, hf).generate([Request(p) for p in ps], greedy)
    for p, o in zip(ps, ours):
        out = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=EOS, pad_token_id=0)
        theirs = out[0, len(p):].tolist()
        assert greedy_near_tie(hf, p, o.token_ids, theirs), (name, p, o.token_ids, theirs)


def test_a_streamed_weight_push_serves_the_new_policy(moe):
    """A push of another policy's weights under HF's names, in buckets (experts arrive stacked, as a
    trainer's state dict holds them), checked against the sender's per-tensor checksums at the commit:
    the engine then generates the new policy's greedy tokens. A push that leaves out an expert tensor
    is refused at the commit."""
    name, cfg, hf = moe
    engine = engine_for(cfg, hf)
    new = hf_model(cfg, seed=7)
    sd = list(new.state_dict().items())
    sums = {n: checksum(t) for n, t in sd}
    for i in range(0, len(sd), 5):
        engine.update_weights(sd[i:i + 5], version=1, complete=False)
    engine.commit_weights(1, sums)
    ps = prompts(3, seed=5)
    ours = engine.generate([Request(p) for p in ps], SamplingParams(temperature=0.0, max_new_tokens=16))
    for p, o in zip(ps, ours):
        theirs = new.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=EOS,
                              pad_token_id=0)[0, len(p):].tolist()
        assert greedy_near_tie(new, p, o.token_ids, theirs), (name, p, o.token_ids, theirs)
    engine.update_weights([(n, t) for n, t in sd if n != "model.layers.1.mlp.experts.down_proj"], 2, complete=False)
    with pytest.raises(RuntimeError, match="experts.down_proj"):
        engine.commit_weights(2, {n: s for n, s in sums.items() if n != "model.layers.1.mlp.experts.down_proj"})
    # one tensor per expert (the Megatron trainer's export): checked under those names, the same rules
    per_expert = list(checkpoint_tensors(sd))
    split_sums = {n: checksum(t) for n, t in per_expert}
    engine.update_weights(per_expert, 3, complete=False)
    engine.commit_weights(3, split_sums)
    assert engine.stats()["weights_version"] == 3
    gone = "model.layers.1.mlp.experts.2.up_proj.weight"
    engine.update_weights([(n, t) for n, t in per_expert if n != gone], 4, complete=False)
    with pytest.raises(RuntimeError, match=r"experts\.2\.up_proj"):
        engine.commit_weights(4, {n: s for n, s in split_sums.items() if n != gone})
    bad = dict(split_sums, **{gone: split_sums[gone] + 1})
    engine.update_weights(per_expert, 5, complete=False)
    with pytest.raises(RuntimeError, match=r"experts\.2\.up_proj.weight differs"):
        engine.commit_weights(5, bad)


def test_the_draft_of_a_moe_target_is_a_dense_layer_at_its_sizes(moe):
    """The draft head of a MoE target: one dense Llama layer at the target's hidden size, heads, KV
    heads and head size, with an MLP of the config's dense width (intermediate_size); a speculative
    generate with it (untrained: few drafts accepted, verification still exercised) gives the plain
    engine's greedy tokens."""
    name, cfg, hf = moe
    draft = DraftHead(cfg)
    layout = layer_layout(cfg, 1)  # a sparse layer
    assert layout.mlp == "moe"
    assert draft.layer["wqkv"].shape == ((layout.heads + 2 * layout.kv_heads) * layout.head_dim, cfg.hidden_size)
    assert draft.layer["w_gate_up"].shape == (2 * cfg.intermediate_size, cfg.hidden_size)
    ps = prompts(4, seed=3)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    plain = engine_for(cfg, hf).generate([Request(p) for p in ps], greedy)
    spec = engine_for(cfg, hf, draft, Static(SpecConfig(3, 3, 8))).generate([Request(p) for p in ps], greedy)
    for p, a, b in zip(ps, spec, plain):
        assert greedy_near_tie(hf, p, a.token_ids, b.token_ids), (name, p, a.token_ids, b.token_ids)


@pytest.mark.slow  # a draft trained on the target's outputs: ~15 s
def test_speculative_greedy_equals_plain_greedy_with_a_trained_draft(moe):
    """A draft trained briefly on the MoE target's own greedy continuations is accepted often, and the
    speculative engine's tokens are still the plain engine's."""
    name, cfg, hf = moe
    ps = prompts(6, seed=3)
    draft = trained_draft(cfg, hf, ps)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=40)
    plain = engine_for(cfg, hf).generate([Request(p) for p in ps], greedy)
    engine = engine_for(cfg, hf, draft, Static(SpecConfig(3, 3, 8)))
    spec = engine.generate([Request(p) for p in ps], greedy)
    for p, a, b in zip(ps, spec, plain):
        assert greedy_near_tie(hf, p, a.token_ids, b.token_ids), (name, p, a.token_ids, b.token_ids)
    stats = engine.stats()
    print(f"\nqwen3_moe {name}: speculative accept_len {stats['accept_len']:.2f} over {stats['spec_steps']} steps")
    assert stats["spec_steps"] > 0 and stats["accept_len"] > 1.0
