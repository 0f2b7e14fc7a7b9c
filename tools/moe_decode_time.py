"""Time one embedded-engine decode step (one token for each of B sequences) of a Qwen3-MoE model against a
dense Qwen3 of the same active parameters (the same attention; a dense MLP as wide as the k experts a
token runs: intermediate_size = top_k * moe_intermediate_size), on this machine's CPU, fp32, random weights.

    python tools/moe_decode_time.py                       # 64 tokens, E=64, top-8, hidden 1024, 4 layers
    python tools/moe_decode_time.py --tokens 1 --tokens 8 --tokens 64 --threads 1
    python tools/moe_decode_time.py --verify --threads 1  # verify steps of T = 1..64 tokens against the price

With --verify, each step is one sequence's verify forward of T tokens (one row of T new tokens, causal,
over --context cached tokens; T = 1, 2, 4, ..., 64 unless --tokens says), timed for the MoE and the
dense model, beside the roofline's price of it (speculation/roofline.py: a forward reads attention,
router and the E (1 - (1 - k/E)^T) experts its tokens touch, `expected_experts`) and the experts the
router did touch. The price is made comparable with a CPU by anchoring it at the measured steps:

    predicted MoE(T) = MoE(1) x read(T) / read(1) + (dense(T) - dense(1))

read(T): the weights a forward of T tokens reads (`ModelShape.target_params`); the first term is the
weight-bytes term the roofline prices, scaled from the measured one-token step; the second what the
dense model of the same active parameters measures beyond its one-token step (more tokens' compute
and attention, which the MoE does as well: each token runs k experts). The expert-blind price is the
same without the experts, MoE(1) + (dense(T) - dense(1)): a MoE costing what its active size costs.

For each model: the median wall time of the forward over `--repeat` steps after a warm-up, each
sequence holding `--context` cached tokens, through the default kernel (oneDNN packed where
available). The MoE is also timed with its experts run one matmul per expert (the fallback where
torch has no _grouped_mm). Printed beside: the expected number of distinct experts a step's tokens
touch under uniform top-k routing, E (1 - (1 - k/E)^T), and those actually touched per layer (random
weights route close to uniformly), and the weight bytes a step reads (attention, router, the touched
experts; the dense model's all of its own).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import Qwen3Config, Qwen3MoeConfig

import fastgrpo.models.layers as engine_layers
from fastgrpo.engines.embedded.model import InferenceModel, KVCache
from fastgrpo.speculation.roofline import expected_experts, model_shape


def configs(a) -> tuple[Qwen3MoeConfig, Qwen3Config]:
    shared = dict(vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=a.heads,
                  num_key_value_heads=a.kv_heads, head_dim=a.hidden // a.heads, max_position_embeddings=4096,
                  rope_parameters=dict(rope_type="default", rope_theta=1e6), tie_word_embeddings=False)
    moe = Qwen3MoeConfig(**shared, intermediate_size=a.top_k * a.moe_ff, moe_intermediate_size=a.moe_ff,
                         num_experts=a.experts, num_experts_per_tok=a.top_k, norm_topk_prob=True)
    dense = Qwen3Config(**shared, intermediate_size=a.top_k * a.moe_ff)
    return moe, dense


def random_model(cfg, max_len: int) -> InferenceModel:
    model = InferenceModel(cfg, max_len)
    g = torch.Generator().manual_seed(0)
    named = [(n, torch.randn(t.shape, generator=g) * (1.0 if t.dim() == 1 else t.shape[-1] ** -0.5))
             for n, t in model.named_weights()]
    model.load(named)
    return model


def step_ids(cfg, rows: int, n: int) -> torch.Tensor:
    """A step's input tokens [rows, n], the same for every model and count at one shape (seeded by it)."""
    return torch.randint(0, cfg.vocab_size, (rows, n), generator=torch.Generator().manual_seed(1000 * rows + n))


def step_time(model: InferenceModel, cfg, tokens: int, context: int, repeat: int, per_row: int = 1) -> float:
    """Median seconds of a forward of `tokens` tokens: `tokens` rows of one (a decode step), or with
    `per_row` > 1, tokens // per_row rows of `per_row` (a verify step)."""
    rows_n = max(tokens // per_row, 1)
    cache = KVCache(cfg, rows_n, context + per_row + 1)
    cache.lengths[:] = context  # a context of cached keys/values (their values do not change the cost)
    ids = step_ids(cfg, rows_n, per_row)
    rows = slice(0, rows_n)
    model.forward(ids, cache, rows)  # warm-up (oneDNN primitives, allocator)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        model.forward(ids, cache, rows)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def touched_experts(model: InferenceModel, cfg, tokens: int, context: int, per_row: int = 1) -> list[int]:
    """Distinct experts each sparse layer's router picks for one step's tokens (the tokens step_time times)."""
    seen = []
    real = engine_layers.routed_experts

    def spy(x, expert, weight, w_gate_up, w_down):
        seen.append(int(expert.unique().numel()))
        return real(x, expert, weight, w_gate_up, w_down)

    rows_n = max(tokens // per_row, 1)
    cache = KVCache(cfg, rows_n, context + per_row + 1)
    cache.lengths[:] = context
    engine_layers.routed_experts = spy
    try:
        model.forward(step_ids(cfg, rows_n, per_row), cache, slice(0, rows_n))
    finally:
        engine_layers.routed_experts = real
    return seen


def verify_table(a, moe: InferenceModel, moe_cfg, dense: InferenceModel, dense_cfg) -> None:
    """Verify steps of one row of T tokens: measured against the roofline's expert pricing (module doc)."""
    tokens = sorted(set(a.tokens or [1, 2, 4, 8, 16, 32, 64]) | {1})  # T = 1 anchors the price
    shape = model_shape(moe_cfg, name="tiny MoE")
    read = {T: shape.target_params(T)[0] for T in tokens}
    dense_s, moe_s = {}, {}
    for T in tokens:  # the two models at each T in turn: a slow spell of a shared machine hits both
        dense_s[T] = step_time(dense, dense_cfg, T, a.context, a.repeat, per_row=T)
        moe_s[T] = step_time(moe, moe_cfg, T, a.context, a.repeat, per_row=T)
    print(f"verify steps: one sequence, T new tokens over {a.context} cached; median of {a.repeat} after a warm-up; "
          f"predicted = MoE(1) x read(T)/read(1) + (dense(T) - dense(1))")
    print(f"{'T':>3} | {'dense ms':>8} | {'MoE ms':>8} | {'predicted ms':>12} | {'pred/meas':>9} | "
          f"{'blind ms':>8} | {'read(T)/read(1)':>15} | {'experts touched per layer':>25} | {'E(1-(1-k/E)^T)':>14}")
    for T in tokens:
        growth = dense_s[T] - dense_s[1]
        predicted = moe_s[1] * read[T] / read[1] + growth
        blind = moe_s[1] + growth
        touched = touched_experts(moe, moe_cfg, T, a.context, per_row=T)
        print(f"{T:3d} | {dense_s[T] * 1e3:8.2f} | {moe_s[T] * 1e3:8.2f} | {predicted * 1e3:12.2f} | "
              f"{predicted / moe_s[T]:9.2f} | {blind * 1e3:8.2f} | {read[T] / read[1]:15.2f} | "
              f"{statistics.mean(touched):25.1f} | {expected_experts(a.experts, a.top_k, T):14.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, action="append", help="decode tokens per step (repeatable; default 64)")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--moe-ff", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--threads", type=int, help="torch threads (default torch's own; on a shared machine 1 gives "
                   "steadier figures: with 2, every op's thread barrier waits whenever the other thread is preempted)")
    p.add_argument("--verify", action="store_true", help="verify steps of one row of T tokens (T = 1..64 unless "
                   "--tokens), measured beside the roofline's expert pricing and the experts touched")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    moe_cfg, dense_cfg = configs(a)
    max_len = a.context + max(a.tokens or [64]) + 1 if a.verify else a.context + 2
    moe, dense = random_model(moe_cfg, max_len), random_model(dense_cfg, max_len)
    h, E, k, ff = a.hidden, a.experts, a.top_k, a.moe_ff
    d = h // a.heads
    attn = (a.heads * d * 2 + a.kv_heads * d * 2) * h
    expert = 3 * h * ff
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, kernel {moe.kernel}; "
          f"{a.layers} layers, hidden {h}, E={E} experts of width {ff}, top-{k}; dense MLP width {k * ff}; "
          f"context {a.context}")
    print(f"params per layer: attention {attn / 1e6:.2f} M, MoE all experts {E * expert / 1e6:.2f} M, "
          f"active {k * expert / 1e6:.2f} M (= the dense MLP's)")
    if a.verify:
        verify_table(a, moe, moe_cfg, dense, dense_cfg)
        return
    for T in a.tokens or [64]:
        t_dense = step_time(dense, dense_cfg, T, a.context, a.repeat)
        t_moe = step_time(moe, moe_cfg, T, a.context, a.repeat)
        has = torch._grouped_mm
        del torch._grouped_mm  # the per-expert fallback of model.grouped_mm
        try:
            t_loop = step_time(moe, moe_cfg, T, a.context, a.repeat)
        finally:
            torch._grouped_mm = has
        touched = touched_experts(moe, moe_cfg, T, a.context)
        expected = expected_experts(E, k, T)
        gb = lambda n: n * 4 * a.layers / 1e9  # noqa: E731  (fp32 bytes over all layers)
        print(f"T={T:3d}: dense {t_dense * 1e3:7.2f} ms | MoE grouped_mm {t_moe * 1e3:7.2f} ms "
              f"({t_moe / t_dense:.2f}x) | MoE per-expert loop {t_loop * 1e3:7.2f} ms ({t_loop / t_dense:.2f}x) | "
              f"experts touched per layer {touched} (uniform: {expected:.1f}) | weights read per step: "
              f"dense {gb(attn + k * expert):.3f} GB, MoE {gb(attn + E * h + statistics.mean(touched) * expert):.3f} GB")


if __name__ == "__main__":
    main()
