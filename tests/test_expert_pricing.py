"""Speculation priced for experts: a mixture-of-experts forward reads every expert its tokens
touch, E (1 - (1 - k/E)^T) per sparse layer, and computes with k per token; a dense model prices as
it always did."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from fastgrpo.speculation.cost_model import FURTHER, SWEEP
from fastgrpo.speculation.policy import Aware
from fastgrpo.speculation.roofline import (H100, LLAMA3_8B, LLAMA3_70B, ModelShape, Roofline, expected_experts,
                                           load_model_shape, model_shape, simulated_cost_model, sparse_layer_count)

QWEN3_30B_A3B = Path(__file__).resolve().parents[1] / "configs" / "models" / "qwen3-30b-a3b.json"


@pytest.fixture(scope="module")
def moe() -> ModelShape:
    return load_model_shape(QWEN3_30B_A3B)


def test_expected_experts_by_hand():
    assert expected_experts(4, 2, 1) == pytest.approx(2.0)  # one token: exactly its k
    assert expected_experts(4, 2, 2) == pytest.approx(3.0)  # 4 (1 - (1/2)^2)
    # E=128, k=8, T=64: 128 (1 - (15/16)^64), (15/16)^64 = 0.016074...
    assert expected_experts(128, 8, 64) == pytest.approx(125.9425, abs=1e-3)
    assert expected_experts(128, 8, 16) == pytest.approx(82.42, abs=1e-2)  # 128 (1 - 0.35607)
    assert expected_experts(128, 8, 0) == 0.0
    assert expected_experts(8, 8, 3) == 8.0  # every expert runs every token
    assert expected_experts(0, 0, 10) == 0.0  # dense
    # more tokens never touch fewer experts, and never more than E
    values = [expected_experts(128, 8, t) for t in (1, 1.5, 2, 8, 64, 512, 8192)]
    assert values == sorted(values) and values[-1] <= 128


def test_the_real_config_is_read_as_its_shape(moe):
    assert (moe.layers, moe.hidden, moe.heads, moe.kv_heads, moe.head_dim) == (48, 2048, 32, 4, 128)
    assert (moe.experts, moe.experts_per_token, moe.expert_intermediate, moe.sparse_layers) == (128, 8, 768, 48)
    assert moe.moe and moe.intermediate == 6144
    # every weight a forward can read, plus the embedding table and the norms (which it does not read
    # in full), is transformers' count of the model: 30,532,122,624 (configs/models/README.md)
    read_all, active = moe.target_params(10**9)
    norms = 48 * (2 * 2048 + 2 * 128) + 2048
    assert read_all + moe.vocab * moe.hidden + norms == pytest.approx(30_532_122_624, abs=1)
    assert active + moe.vocab * moe.hidden + norms == pytest.approx(3.35e9, rel=0.01)  # the "A3B"


def test_sparse_layers_follow_transformers_rule():
    assert sparse_layer_count(48, 128, 1, []) == 48
    assert sparse_layer_count(8, 4, 2, []) == 4  # layers 1, 3, 5, 7
    assert sparse_layer_count(8, 4, 2, [3]) == 3
    assert sparse_layer_count(8, 0, 1, []) == 0
    shape = model_shape({**json.loads(QWEN3_30B_A3B.read_text()), "num_hidden_layers": 4, "decoder_sparse_step": 2})
    assert shape.sparse_layers == 2
    read, active = shape.target_params(1)
    dense_layer = shape.attention_params + 3 * 2048 * 6144
    sparse_layer = shape.attention_params + 128 * 2048 + 8 * 3 * 2048 * 768
    assert read == active == 2 * dense_layer + 2 * sparse_layer + shape.lm_head_params


def _dense_target(m: ModelShape, B: int, n: int, ctx_sum: int) -> float:
    """The roofline's target forward of a dense model, by hand: the matmuls (the longer of reading the
    weights and their FLOPs), then attention (the longer of reading the KV caches and its FLOPs)."""
    hw = H100
    bandwidth, peak = hw.hbm_bytes_s * hw.bw_eff, hw.peak_flops * hw.flops_eff
    params = m.layers * (m.hidden * (m.hidden + 2 * m.kv_heads * (m.hidden // m.heads)) + m.hidden * m.hidden
                         + 3 * m.hidden * m.intermediate) + m.vocab * m.hidden
    kv = 2 * m.layers * m.kv_heads * (m.hidden // m.heads) * m.bytes_per_param / m.tp
    matmuls = max(params * m.bytes_per_param / m.tp / bandwidth, 2 * params * B * n / m.tp / peak)
    attention = max(kv * ctx_sum / bandwidth, 4 * m.layers * m.heads * (m.hidden // m.heads) * n * ctx_sum / m.tp / peak)
    seconds = matmuls + attention + hw.target_overhead_s
    if m.tp > 1:
        message = B * n * m.hidden * m.bytes_per_param
        seconds += 2 * m.layers * (hw.allreduce_latency_s + 2 * (m.tp - 1) / m.tp * message / hw.link_bytes_s)
    return seconds


@pytest.mark.parametrize("shape", [LLAMA3_8B, LLAMA3_70B], ids=["8b", "70b-tp8"])
def test_a_dense_model_is_priced_by_its_matmuls_and_its_attention(shape):
    costs = Roofline(H100, shape)
    for B, n, ctx in ((1, 1, 100), (1, 16, 3000), (64, 4, 2000), (128, 48, 16000)):
        assert costs.target(B, n, ctx, B * ctx) == _dense_target(shape, B, n, B * ctx)  # exact, not approximate
    assert shape.blind() is shape
    assert sorted(simulated_cost_model(costs).target_s) == sorted(SWEEP)


def test_a_dense_config_is_read_as_before():
    """Llama-3-8B's keys (its head_dim 128 = 4096 / 32, as the config states it) are the shape the
    roofline always priced, to the last bit."""
    config = {"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
              "num_key_value_heads": 8, "vocab_size": 128256, "head_dim": 128}
    shape = model_shape(config, name=LLAMA3_8B.name)
    assert not shape.moe and replace(shape, head_size=0) == LLAMA3_8B
    assert Roofline(H100, shape).target(4, 8, 500, 2000) == Roofline(H100, LLAMA3_8B).target(4, 8, 500, 2000)


def test_a_moe_verify_costs_more_than_a_dense_model_of_its_active_size(moe):
    priced, blind = Roofline(H100, moe), Roofline(H100, moe.blind())
    ctx = 2000
    # one token: the k experts either way
    assert priced.target(1, 1, ctx, ctx) == pytest.approx(blind.target(1, 1, ctx, ctx), rel=1e-12)
    for T in (2, 4, 16, 64):
        assert priced.target(1, T, ctx, ctx) > blind.target(1, T, ctx, ctx)
        # the extra bytes are exactly the extra experts, every sparse layer
        extra = moe.target_params(T)[0] - moe.target_params(1)[0]
        assert extra == pytest.approx(48 * (expected_experts(128, 8, T) - 8) * moe.expert_params)
        assert moe.target_params(T)[1] == moe.target_params(1)[1]  # each token computes with k: FLOPs per token fixed
    assert priced.target(1, 16, ctx, ctx) > 4 * priced.target(1, 1, ctx, ctx)  # 82 experts read, not 8
    assert blind.target(1, 16, ctx, ctx) < 1.1 * blind.target(1, 1, ctx, ctx)  # a dense GPU at batch 1: about free
    # the EAGLE draft is one dense layer either way
    assert priced.draft(4, 8, ctx, 4 * ctx) == blind.draft(4, 8, ctx, 4 * ctx)


def test_a_moe_calibration_sweeps_past_where_compute_takes_over(moe):
    """Qwen3-30B-A3B on an H100 is still memory-bound at SWEEP's 512 tokens (every expert read, 8 run):
    a sweep stopping there prices 128 rows x 64 nodes like one plain step of 128 rows. It goes on to
    where a doubling of tokens costs 1.5x, and its last segment then prices larger forwards."""
    costs = Roofline(H100, moe)
    curve = simulated_cost_model(costs)
    points = sorted(curve.target_s)
    assert points[: len(SWEEP)] == sorted(SWEEP) and points[len(SWEEP):] == list(FURTHER[: len(points) - len(SWEEP)])
    assert points[-1] >= 2048
    last, before = (costs.target(64, t // 64, 128, 64 * 128) for t in points[-1:-3:-1])
    assert last >= 1.5 * before and curve.target_s[points[-2]] < 1.5 * curve.target_s[points[-3]]
    verify = costs.target(64, 128, 128, 64 * 128)  # the sweep's shape of 8192 tokens
    assert curve.target(8192) == pytest.approx(verify, rel=0.05)
    assert verify > 2 * costs.target(64, 8, 128, 64 * 128)


def _verified(aware: Aware, running: int, context: float | None) -> int:
    aware.context = context
    choice = aware._decide(running)
    return 1 if choice is None else choice.num_verify


def test_aware_priced_for_experts_speculates_less_at_low_concurrency_and_no_less_at_high(moe):
    """What the maths says, at aware's prior acceptance (alpha 0.6): at one row a tree's tokens each bring
    experts a plain step does not read (d6k8n48: 122 of 128 against 8), so aware priced for experts
    declines the deep tree that expert-blind aware takes. At 64-128 rows a plain step already reads
    nearly all 128 experts, so verifying more tokens reads nothing more until compute takes over, which
    with ~10x the bytes of the active size comes later than on the dense model expert-blind pricing
    assumes: aware priced for experts verifies at least as many tokens there, more without a long
    context. (Not shallower at high concurrency, then: deeper. With the EAGLE-3 profile's higher
    acceptance, deep trees pay even at one row: BENCHMARKS.md section 12.)"""
    for tp in (1, 2):
        shape = replace(moe, tp=tp)
        priced = Aware(simulated_cost_model(Roofline(H100, shape)))
        blind = Aware(simulated_cost_model(Roofline(H100, shape.blind())))
        for context in (None, 3000):
            assert _verified(priced, 1, context) < _verified(blind, 1, context), (tp, context)
            for running in (64, 128):
                assert _verified(priced, running, context) >= _verified(blind, running, context), (tp, context, running)
        assert _verified(priced, 128, None) > _verified(blind, 128, None)
