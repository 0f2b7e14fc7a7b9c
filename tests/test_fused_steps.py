"""Fused pointwise regions (models/fused.py, engine.fused): each compiled region computes its eager function
(bf16 bit for bit where Inductor keeps the eager casts); static steps with them give the op-by-op steps' tokens and log-probabilities in every
family, plain and speculative; they dispatch fewer ops a layer; asking for them without static steps is
refused by name."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from fastgrpo.config import ConfigError, load_config
from fastgrpo.engines.embedded.engine import EmbeddedEngine
from fastgrpo.engines.embedded.graphs import StepAudit, launched_ops
from fastgrpo.models.draft import DraftHead
from fastgrpo.models.fused import fused_pointwise
from fastgrpo.models.layers import EAGER
from fastgrpo.models.policy import new_policy, policy_config
from fastgrpo.models.sampling import seed_key
from fastgrpo.speculation.policy import Static
from fastgrpo.speculation.spec import SpecConfig
from fastgrpo.types import Request, SamplingParams
from tests.test_families import family, hf_model, prompts  # noqa: F401 (family: a fixture)
from tests.test_moe_engine import qwen3_moe
from tests.test_static_steps import STOPS, assert_same

EOS = 2
# Inductor's C++ backend keeps every cast the eager code makes (emulate_precision_casts) from torch 2.13 on;
# 2.11's (the GPU machine's version, run here by tools/gpu_rehearsal.sh's venv) elides some: bf16 norms then
# differ by one unit in the last place here and there (seen)
CASTS_KEPT = torch.__version__ >= (2, 13)
T1 = SamplingParams(temperature=1.0, max_new_tokens=20)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=20)


def regions(dtype, B, n, seed=0):
    """Each region's inputs, shaped as a layer passes them (4 q heads and 2 k heads of 32, hidden 64)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    x, res, w = r(B, n, 64), r(B, n, 64), r(64)
    qk, cos, sin, q_norm, k_norm = r(B, n, 6, 32), r(B, n, 1, 32), r(B, n, 1, 32), r(32), r(32)
    noise_seed, key = torch.tensor(seed_key(77 + seed)), torch.randint(0, 2**62, (B, 1), generator=g)
    position = torch.randint(0, 4000, (B, 1), generator=g) + torch.arange(n)
    return {"norm": (x, w, 1e-6), "add_norm": (x, res, w, 1e-6), "rotate_qk": (qk, cos, sin, 4, None, None, 1e-6),
            "rotate_qk with norms": (qk, cos, sin, 4, q_norm, k_norm, 1e-6), "silu_mul": (r(B, n, 192),),
            "uniforms": (noise_seed, key, position)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_each_region_computes_its_eager_function(dtype):
    """bf16: bit for bit where Inductor keeps the eager code's casts (CASTS_KEPT; without
    `emulate_precision_casts` 20-50% of the elements differ, measured). fp32: the pointwise regions bit for
    bit, the norms within 2e-6 of the values' scale (a fused mean of squares adds in another order). The
    sampling noise (an integer hash, float64 out): bit for bit."""
    fused = fused_pointwise()
    for B, n in ((1, 1), (6, 1), (4, 12)):
        for name, args in regions(dtype, B, n).items():
            op = name.split(" ")[0]
            with torch.inference_mode():
                want, got = getattr(EAGER, op)(*args), getattr(fused, op)(*args)
            want, got = torch.cat(want, -1) if op == "add_norm" else want, torch.cat(got, -1) if op == "add_norm" else got
            assert got.dtype == want.dtype and got.shape == want.shape
            if op == "uniforms" or (dtype == torch.bfloat16 and CASTS_KEPT):
                assert torch.equal(got, want), (name, B, n)
            elif dtype == torch.bfloat16:  # a rounding or two apart, at the values' scale
                assert (got.float() - want.float()).abs().max() <= 2**-6 * want.float().abs().max(), (name, B, n)
            elif op == "silu_mul" or (op == "rotate_qk" and args[4] is None):
                assert torch.equal(got, want), (name, B, n)
            else:
                assert (got - want).abs().max() <= 2e-6 * want.abs().max(), (name, B, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_draft_heads_layer_fused_computes_its_eager_function(dtype):
    """The draft's features and logits with its layer's regions fused (as static speculative steps run it),
    against the same head op by op: bf16 bit for bit, fp32 within 1e-5 of the values' scale."""
    cfg = policy_config("test", 61, 128, bos_id=1, eos_id=EOS, pad_id=0)
    torch.manual_seed(0)
    draft = DraftHead(cfg).to(dtype)
    draft.bind_target(torch.randn(61, cfg.hidden_size), torch.randn(61, cfg.hidden_size))
    B, n = 3, 5
    hidden, tokens = torch.randn(B, n, cfg.hidden_size, dtype=dtype), torch.randint(0, 61, (B, n))
    positions = torch.arange(n).expand(B, n)
    with torch.inference_mode():
        out = [draft.logits(draft.features(hidden, tokens, positions, None, lambda k, v: (k, v), ops), ops)
               for ops in (EAGER, fused_pointwise())]
    if dtype == torch.bfloat16 and CASTS_KEPT:
        assert torch.equal(out[0], out[1])
    elif dtype == torch.bfloat16:  # one bf16 unit in the last place through the head's norm, times the head
        assert (out[1].float() - out[0].float()).abs().max() <= 0.05 * out[0].float().abs().max()
    else:
        assert (out[1] - out[0]).abs().max() <= 1e-5 * out[0].abs().max()


def static_engine(cfg, weights, fused, policy=None, draft=None, dtype=torch.float32):
    e = EmbeddedEngine(cfg, 4, 128, eos_id=STOPS, pad_id=0, policy=policy, static_steps=True, dtype=dtype)
    e.update_weights(weights, version=0)
    if draft is not None:
        e.update_draft(draft.state_dict().items(), version=0)
    e.fused = fused
    return e


def random_draft(cfg):
    torch.manual_seed(1)
    return DraftHead(cfg)


def same_tokens_fused_or_not(name, cfg, hf):
    """Plain sampled steps and speculative greedy ones (a verify forward of a 12-node tree through the fused
    regions) give the same tokens, finish reasons and log-probabilities (within 1e-5) fused as op by op."""
    ps = prompts(6, seed=4)
    weights = list(hf.state_dict().items())
    for sampling, policy in ((T1, None), (GREEDY, Static(SpecConfig(4, 4, 12)))):
        draft = random_draft(cfg) if policy else None
        runs = [static_engine(cfg, weights, fused, policy, draft).generate([Request(p) for p in ps], sampling, seed=3)
                for fused in (False, True)]
        assert_same(hf, ps, runs[1], runs[0], sampling, 3)
        assert sum(a.token_ids == b.token_ids for a, b in zip(*runs)) >= 5, name


def test_fused_steps_give_the_op_by_op_steps_tokens(family):  # noqa: F811
    """Llama 3.1, Qwen2.5 (q/k/v biases), Qwen3 (q/k norms, fused with the rotation)."""
    same_tokens_fused_or_not(*family)


def test_fused_moe_steps_give_the_op_by_op_steps_tokens():
    cfg = qwen3_moe()
    same_tokens_fused_or_not("qwen3-moe", cfg, hf_model(cfg))


@pytest.mark.skipif(not CASTS_KEPT, reason="this torch's C++ backend elides some bf16 casts (see CASTS_KEPT)")
def test_fused_bf16_steps_equal_op_by_op_ones_bit_for_bit():
    """In bf16 every region rounds as the eager code does, so a whole generate call is identical: tokens and
    log-probabilities to the bit, plain and speculative."""
    cfg = policy_config("test", 61, 128, bos_id=1, eos_id=EOS, pad_id=0)
    weights = list(new_policy(cfg, seed=3).state_dict().items())
    ps = prompts(5, seed=6)
    for policy in (None, Static(SpecConfig(3, 2, 6))):
        draft = random_draft(cfg) if policy else None
        runs = [static_engine(cfg, weights, fused, policy, draft, torch.bfloat16).generate(
            [Request(p) for p in ps], T1, seed=5) for fused in (False, True)]
        for a, b in zip(*runs):
            assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def most_kernel_ops(e: EmbeddedEngine, speculative: bool) -> int:
    """The most kernel-launching ops one of `e`'s static steps (speculative ones, or plain ones) dispatches
    in a generate call, after a first call that compiled what it needs."""
    e.generate([Request(p) for p in prompts(3, seed=1)], T1, seed=1)
    steps, run = [], e.graphs.run

    def profiled(key, step):
        with profile(activities=[ProfilerActivity.CPU]) as p:
            out = run(key, step)
        if (key[0] != "plain") == speculative:
            steps.append(launched_ops(p.events()))
        return out

    e.graphs.run = profiled
    e.generate([Request(p) for p in prompts(3, seed=1)], T1, seed=1)
    return max(steps)


def test_fused_steps_dispatch_fewer_ops_a_layer():
    """The ops a plain static step dispatches that launch kernels (not views), per layer (two depths of
    one model, the difference halved) and in the rest of the step: op by op 28 a layer and 99, fused 12
    and 30 (measured). The control is the op-by-op count: the same profiler sees each of its norms' and
    rotation's ops."""
    base = policy_config("test", 61, 128, bos_id=1, eos_id=EOS, pad_id=0)
    counts = {}
    for layers in (2, 4):
        cfg = base.__class__(**{**base.to_dict(), "num_hidden_layers": layers})
        weights = list(new_policy(cfg, seed=1).state_dict().items())
        for fused in (False, True):
            counts[(layers, fused)] = most_kernel_ops(static_engine(cfg, weights, fused), speculative=False)
    per_layer = {fused: (counts[(4, fused)] - counts[(2, fused)]) / 2 for fused in (False, True)}
    rest = {fused: counts[(2, fused)] - 2 * per_layer[fused] for fused in (False, True)}
    print(f"\nkernel-launching ops a layer: op by op {per_layer[False]:.0f}, fused {per_layer[True]:.0f}; "
          f"the rest of the step: op by op {rest[False]:.0f}, fused {rest[True]:.0f}")
    assert per_layer[False] >= 26 and per_layer[True] <= 13
    assert rest[False] >= 90 and rest[True] <= 45  # the sampling noise's hash, ~60 ops, is one region


def test_fused_speculative_steps_dispatch_fewer_ops():
    """A d4k4n12 speculative static step of a 2-layer target: its draft's layer and head norm run fused
    too (the catch-up and each of the four draft levels), and the sampling noise. Kernel-launching ops:
    op by op 468, fused 283 (measured); the rest is the tree's own work (top-k, gathers, masks, the
    verify walk)."""
    cfg = policy_config("test", 61, 128, bos_id=1, eos_id=EOS, pad_id=0)
    weights = list(new_policy(cfg, seed=1).state_dict().items())
    counts = {fused: most_kernel_ops(static_engine(cfg, weights, fused, Static(SpecConfig(4, 4, 12)),
                                                   random_draft(cfg)), speculative=True) for fused in (False, True)}
    print(f"\nkernel-launching ops of a d4k4n12 step: op by op {counts[False]}, fused {counts[True]}")
    assert counts[False] >= 450 and counts[True] <= 300


def test_fused_steps_pass_the_audit_by_their_eager_functions():
    """Under a dispatch mode (the audit, the replay check) dynamo does not trace: the regions run their eager
    functions there, so the audit still sees every op of a fused step, and no host sync."""
    cfg = policy_config("test", 61, 128, bos_id=1, eos_id=EOS, pad_id=0)
    e = static_engine(cfg, list(new_policy(cfg, seed=2).state_dict().items()), fused=True)
    audits, run = [], e.graphs.run

    def audited(key, step):
        e.graphs.audit = audit = StepAudit()
        audits.append(audit)
        try:
            return run(key, step)
        finally:
            e.graphs.audit = None

    e.graphs.run = audited
    e.generate([Request(p) for p in prompts(3, seed=2)], T1, seed=2)
    assert audits and all(not a.violations for a in audits)
    assert all(a.ops["rsqrt"] > 0 and a.ops["silu"] > 0 for a in audits)  # the norms' and the gate's own ops


def test_fused_kernels_need_static_steps():
    with pytest.raises(ConfigError, match=r"engine\.fused needs static steps"):
        load_config(None, ["engine.fused=true", "engine.steps=eager"])
    with pytest.raises(ConfigError, match=r"engine\.fused is the embedded engine's"):
        load_config(None, ["engine.fused=true", "engine.backend=sglang"])
    assert load_config(None, ["engine.fused=true", "engine.steps=static"]).engine.fused
    cfg = policy_config("test", 61, 128, bos_id=1, eos_id=EOS, pad_id=0)
    e = EmbeddedEngine(cfg, 2, 64, eos_id=EOS, static_steps=False)
    with pytest.raises(ValueError, match="fused kernels run in static steps"):
        e.fused = True


def test_the_factory_builds_a_fused_engine_the_trainer_agrees_with(tmp_path, tiny_policy):
    """engine.fused through build_engine: the fused engine's sampled tokens, scored by the trainer, have the
    log-probabilities the engine reported (within 1e-4); with engine.steps=auto on a CPU (eager steps) the
    build names the key to change."""
    from transformers import AutoConfig

    from fastgrpo.engines import build_engine
    from fastgrpo.grpo.batch import build_batch
    from fastgrpo.models.tokenizer import load_text_format
    from fastgrpo.trainers import build_trainer
    from tests.conftest import tiny_config

    text, model_config = load_text_format(tiny_policy), AutoConfig.from_pretrained(tiny_policy)
    off = {"speculation.policy": "off", "draft.online": "off", "engine.fused": True}
    with pytest.raises(ValueError, match=r"engine\.fused=true needs static steps.*engine\.steps=static"):
        build_engine(tiny_config(tmp_path, tiny_policy, **off), model_config, text)
    cfg = tiny_config(tmp_path, tiny_policy, **off, **{"engine.steps": "static"})
    trainer = build_trainer(cfg)
    engine = build_engine(cfg, model_config, text)
    assert engine.fused and engine.static
    engine.update_weights(trainer.export_weights(), version=0)
    prompt = [1, 5, 6, 7]
    out = engine.generate([Request(prompt)], SamplingParams(temperature=1.0, max_new_tokens=8), seed=3)[0]
    batch = build_batch([prompt], [out.token_ids], [out.logprobs], torch.zeros(1), pad_id=0)
    scored = trainer.logprobs(batch)[0, len(prompt):len(prompt) + len(out.token_ids)]
    torch.testing.assert_close(scored, torch.tensor(out.logprobs), atol=1e-4, rtol=0)
