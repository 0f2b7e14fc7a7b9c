"""The roofline price of a GPU forward: the seconds a named accelerator takes for a forward of a named
model, from public specifications and stated efficiency assumptions. `bench simulate` prices its
simulated GPUs with it, and `aware` on SGLang decides from it (speculation/sglang_tiers.py) until a
calibration of SGLang's own forwards exists.

A mixture-of-experts model (Qwen3-MoE) is priced by the experts a forward reads: each sparse layer
reads its attention, its router and every expert that at least one of the forward's tokens is routed
to (`expected_experts`), while each token computes with its k experts only. Verifying k tokens for
each of B sequences therefore reads many more experts than decoding one token each, and a tree costs
far more than on a dense model of the same active parameters (`ModelShape.blind` prices it as one)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from fastgrpo.speculation.cost_model import (CONTEXT, CONTEXT_EXTRA, CONTEXT_PROBES, KINDS, ROW_PROBES, ROWS, SWEEP,
                                             CostModel, context_rates, monotone, row_seconds, swept_on, sweep_rows)
from fastgrpo.speculation.spec import SpecConfig


# Public specifications. H100 SXM5: 3.35 TB/s HBM3, 989 TFLOP/s dense BF16, NVLink 4 at 900 GB/s
# (450 GB/s each way) -- NVIDIA H100 Tensor Core GPU datasheet. H200 SXM: 4.8 TB/s HBM3e, the same
# 989 TFLOP/s dense BF16 and 900 GB/s NVLink -- NVIDIA H200 Tensor Core GPU datasheet.
@dataclass(frozen=True)
class Accelerator:
    name: str
    hbm_bytes_s: float
    peak_flops: float
    link_bytes_s: float  # one direction, per GPU (what a ring all-reduce streams at)
    # Our assumptions, not measurements: decode GEMV-like kernels reach ~80% of HBM bandwidth and
    # large GEMMs ~60% of dense peak; a captured (CUDA-graph) forward costs ~0.4 ms of launch and
    # synchronisation beyond its roofline, a draft forward ~0.1 ms; sampling and scheduling ~0.3 ms
    # per step and a speculative step's tree build and verification ~0.3 ms more; an NCCL
    # all-reduce over NVLink ~10 us of latency.
    bw_eff: float = 0.8
    flops_eff: float = 0.6
    target_overhead_s: float = 0.4e-3
    draft_overhead_s: float = 0.1e-3
    step_overhead_s: float = 0.3e-3
    spec_overhead_s: float = 0.3e-3
    allreduce_latency_s: float = 10e-6


H100 = Accelerator("H100 SXM", 3.35e12, 989e12, 450e9)
H200 = Accelerator("H200 SXM", 4.8e12, 989e12, 450e9)
ACCELERATORS = {"h100": H100, "h200": H200}


def expected_experts(experts: int, top_k: int, tokens: float) -> float:
    """The expected number of distinct experts of one sparse layer that a forward of `tokens` tokens
    routes to, under uniform top-k routing: E (1 - (1 - k/E)^T).

    Why: an expert's weights are read from memory once per forward if any token is routed to it, and
    not at all otherwise, so what a memory-bound MoE forward reads grows with the experts its tokens
    touch, not with the k each token runs. Under uniform routing a given expert is among one token's
    k of E with probability k/E, independently across tokens, so it is missed by all T tokens with
    probability (1 - k/E)^T; summed over the E experts, E (1 - (1 - k/E)^T) are touched. One token
    touches exactly k; a batch of tokens tends to all E (E=128, k=8: 8 at T=1, 82.4 at 16, 125.9 at
    64). Real routers are not uniform (popular experts are shared more often), so this is an upper
    estimate of the experts read at a given T; `tools/moe_decode_time.py` counts what a router does.
    `tokens` may be fractional (an average over rows): the formula is smooth in T."""
    if experts <= 0 or top_k <= 0:
        return 0.0
    if top_k >= experts:
        return float(experts)
    return experts * (1.0 - (1.0 - top_k / experts) ** max(tokens, 0.0))


# Model shapes from the models' Hugging Face config.json (meta-llama/Meta-Llama-3-8B, -70B).
@dataclass(frozen=True)
class ModelShape:
    """A decoder's shape, as the roofline prices it. Dense (`experts` 0): every layer an attention and a
    SwiGLU MLP of `intermediate`. Mixture of experts (Qwen3-MoE): `sparse_layers` of the `layers` have
    instead a router over `experts` SwiGLU experts of width `expert_intermediate`, `experts_per_token`
    of them run per token (the others keep a dense MLP of `intermediate`). `expert_blind`: price every
    forward as reading only one token's k experts (a dense model of the active size: what a price that
    ignores experts says; `blind`)."""

    name: str
    layers: int
    hidden: int
    intermediate: int  # a dense layer's MLP width (a MoE's dense layers and its EAGLE draft's layer)
    heads: int
    kv_heads: int
    vocab: int
    tp: int = 1
    bytes_per_param: int = 2  # bf16 weights and KV
    head_size: int = 0  # the config's head_dim where it states one (Qwen3: heads x head_dim need not be hidden)
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    sparse_layers: int = 0
    expert_blind: bool = False

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    @property
    def attention_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return h * (q + 2 * kv) + q * h

    @property
    def layer_params(self) -> int:
        """A dense decoder layer: attention and a SwiGLU MLP of `intermediate`."""
        return self.attention_params + 3 * self.hidden * self.intermediate

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def moe(self) -> bool:
        return self.experts > 0 and self.experts_per_token > 0 and self.sparse_layers > 0

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.expert_intermediate

    def experts_read(self, tokens: float) -> float:
        """Experts a sparse layer reads in a forward of `tokens` tokens (expected_experts; one token's k
        when `expert_blind`)."""
        if self.expert_blind:
            return float(self.experts_per_token)
        return expected_experts(self.experts, self.experts_per_token, tokens)

    def target_params(self, tokens: float) -> tuple[float, float]:
        """(parameters a target forward of `tokens` tokens reads, parameters each token computes with).
        Dense: both every parameter (the LM head included). MoE: each sparse layer reads its attention,
        router and the experts its tokens touch (`experts_read`) and computes with attention, router and
        k experts."""
        total = self.layers * self.layer_params + self.lm_head_params
        if not self.moe:
            return total, total
        sparse = self.sparse_layers * (self.attention_params + self.experts * self.hidden)
        dense = (self.layers - self.sparse_layers) * self.layer_params + self.lm_head_params
        read = dense + sparse + self.sparse_layers * self.experts_read(tokens) * self.expert_params
        active = dense + sparse + self.sparse_layers * self.experts_per_token * self.expert_params
        return read, active

    def blind(self) -> ModelShape:
        """This shape priced as if every forward read only one token's k experts (a dense model of the
        active size): what ignoring experts prices; a dense shape is its own."""
        return replace(self, name=f"{self.name} (expert-blind)", expert_blind=True) if self.moe else self


LLAMA3_8B = ModelShape("Llama-3-8B", 32, 4096, 14336, 32, 8, 128256, tp=1)
LLAMA3_70B = ModelShape("Llama-3-70B (TP8)", 80, 8192, 28672, 64, 8, 128256, tp=8)
MODELS = {"llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B}


class Roofline:
    """Step latency of `model` on `hw`: each forward takes its matmuls' time, the longer of reading the
    weights at achievable bandwidth and their FLOPs for every token at achievable peak, plus its
    attention's, the longer of reading every row's KV cache and attending over it, plus a fixed overhead
    and, at TP > 1, two ring all-reduces of the activations per layer. The two are separate kernels, one
    after the other, so one's memory traffic does not hide the other's compute: at a long context a
    verify's extra tokens pay their matmuls' FLOPs on top of the KV reads (a tree of 8 tokens a row is
    1.60x a plain step of Llama-3-8B at 64 rows over 2,000 cached tokens; one roofline over the whole
    forward would price it at 1.16x). The draft (EAGLE: one decoder layer, the fusing projection, the
    target's LM head) runs on the same GPUs at the same TP."""

    padded = False  # SGLang's paged KV cache: each row reads its own context

    def __init__(self, hw: Accelerator, model: ModelShape):
        self.hw, self.model = hw, model
        self.name = f"{hw.name} / {model.name}"

    def _forward(self, B: int, n: int, ctx_sum: int, params: float, layers: int, overhead: float,
                 active: float | None = None) -> float:
        """`params`: the weights the forward reads; `active`: those each token computes with (default
        the same: a dense forward; a MoE's reads its touched experts, computes with k)."""
        m, hw = self.model, self.hw
        tokens = B * n
        bandwidth, peak = hw.hbm_bytes_s * hw.bw_eff, hw.peak_flops * hw.flops_eff
        matmuls = max(params * m.bytes_per_param / m.tp / bandwidth,
                      2 * (params if active is None else active) * tokens / m.tp / peak)
        kv_bytes_per_token = 2 * layers * m.kv_heads * m.head_dim * m.bytes_per_param / m.tp
        attention = max(kv_bytes_per_token * ctx_sum / bandwidth,
                        4 * layers * m.heads * m.head_dim * n * ctx_sum / m.tp / peak)
        seconds = matmuls + attention + overhead
        if m.tp > 1:
            message = tokens * m.hidden * m.bytes_per_param
            seconds += 2 * layers * (hw.allreduce_latency_s + 2 * (m.tp - 1) / m.tp * message / hw.link_bytes_s)
        return seconds

    def target(self, B: int, n: int, ctx_max: int, ctx_sum: int) -> float:
        m = self.model
        if not m.moe:
            return self._forward(B, n, ctx_sum, m.layers * m.layer_params + m.lm_head_params, m.layers,
                                 self.hw.target_overhead_s)
        read, active = m.target_params(B * n)
        return self._forward(B, n, ctx_sum, read, m.layers, self.hw.target_overhead_s, active)

    def draft(self, B: int, n: int, ctx_max: int, ctx_sum: int) -> float:
        """An EAGLE draft: one dense decoder layer (the target's attention, an MLP of its
        `intermediate_size`, as `models/draft.py` builds it for a MoE target too), the fusing
        projection and the target's LM head."""
        m = self.model
        return self._forward(B, n, ctx_sum, m.layer_params + 2 * m.hidden * m.hidden + m.lm_head_params, 1,
                             self.hw.draft_overhead_s)

    def decode_step(self, B: int, ctx_max: int, ctx_sum: int, speculating: bool = False) -> float:
        return self.target(B, 1, ctx_max, ctx_sum) + self.hw.step_overhead_s

    def drafting(self, c: SpecConfig, B: int, width: int, ctx_max: int, ctx_sum: int) -> float:
        """A speculative step's draft forwards: the catch-up of `width` tokens a row, then a level of
        `topk` tokens a row for each further level of the tree."""
        return self.draft(B, width, ctx_max, ctx_sum) + (c.depth - 1) * self.draft(B, c.topk, ctx_max, ctx_sum)

    def spec_step(self, c: SpecConfig, B: int, width: int, ctx_max: int, ctx_sum: int,
                  verified: float | None = None) -> float:
        verify = self.target(B, verified or c.num_verify, ctx_max, ctx_sum)
        return self.drafting(c, B, width, ctx_max, ctx_sum) + verify + self.hw.step_overhead_s + self.hw.spec_overhead_s

    def prefill(self, unique: int, width: int, joined: int) -> float:
        return self.target(unique, width, width, unique * width // 2) + self.hw.step_overhead_s

    def between_steps(self, B: int) -> float:
        return 0.0  # in step_overhead_s

    def per_call(self, sequences: int) -> float:
        return 0.0


def sparse_layer_count(layers: int, experts: int, sparse_step: int, mlp_only: Sequence[int]) -> int:
    """Layers whose MLP is routed experts, as transformers' Qwen3MoeDecoderLayer decides: layer i is
    sparse unless listed in `mlp_only_layers`, when there are experts and (i + 1) is a multiple of
    `decoder_sparse_step` (families.py lays the engine's layers out by the same rule)."""
    if experts <= 0 or sparse_step <= 0:
        return 0
    return sum(1 for i in range(layers) if i not in set(mlp_only) and (i + 1) % sparse_step == 0)


def model_shape(config, tp: int = 1, name: str | None = None) -> ModelShape:
    """A Hugging Face `config` (PretrainedConfig or its dict: Llama-style dense, or Qwen3-MoE with
    num_experts / num_experts_per_tok / moe_intermediate_size) as a ModelShape at tensor parallelism
    `tp`, bf16. A config's head_dim is taken where it states one (Qwen3: 32 heads x 128 on hidden 2048)."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    layers, heads = int(get("num_hidden_layers")), int(get("num_attention_heads"))
    experts = int(get("num_experts") or 0)
    moe = {}
    if experts > 0:
        moe = dict(experts=experts, experts_per_token=int(get("num_experts_per_tok")),
                   expert_intermediate=int(get("moe_intermediate_size")),
                   sparse_layers=sparse_layer_count(layers, experts, int(get("decoder_sparse_step") or 1),
                                                    get("mlp_only_layers") or ()))
    return ModelShape(name or str(get("_name_or_path", "") or get("model_type", "model")), layers,
                      int(get("hidden_size")), int(get("intermediate_size")), heads,
                      int(get("num_key_value_heads") or heads), int(get("vocab_size")), tp=tp,
                      head_size=int(get("head_dim") or 0), **moe)


def load_model_shape(path: str | Path, tp: int = 1) -> ModelShape:
    """The ModelShape of a Hugging Face config.json at `path` (configs/models/*.json), named by its
    file's stem."""
    path = Path(path)
    return model_shape(json.loads(path.read_text()), tp=tp, name=path.stem)


def accelerator_named(device_name: str) -> Accelerator:
    """The accelerator whose specifications price `device_name` (torch.cuda.get_device_name): H200 for
    an H200, else H100 (the closest public profile; a stated assumption for any other GPU)."""
    return H200 if "H200" in device_name.upper() else H100


def simulated_cost_model(costs: Roofline, error: Callable[[str, int], float] | None = None) -> CostModel:
    """What `engines/embedded/calibrate.calibrate` would measure on the simulated machine: target and draft forwards
    at each sweep size (B = min(tokens, 64) rows of tokens / B new tokens, over CONTEXT cached tokens
    each), at its row probes and at its context probes. `error(kind, tokens)` multiplies a point (to
    test that `aware` survives a bad calibration). Each kind is swept on past SWEEP while its curve is
    still flat (`cost_model.swept_on`: a mixture-of-experts model)."""
    def measured(kind: str, B: int, n: int, ctx: int = CONTEXT) -> float:
        forward = costs.target if kind == "target" else costs.draft
        return forward(B, n, ctx, B * ctx) * (error(kind, B * n) if error else 1.0)

    target_s, draft_s = (swept_on({t: measured(kind, sweep_rows(t), max(t // ROWS, 1)) for t in SWEEP},
                                  lambda t, kind=kind: measured(kind, sweep_rows(t), t // ROWS))
                         for kind in KINDS)
    probes = {(B, n): measured("target", B, n) for B, n in ROW_PROBES}
    context_extra_s = {(kind, B, n): measured(kind, B, n, CONTEXT + CONTEXT_EXTRA) - measured(kind, B, n)
                       for kind in KINDS for B, n in CONTEXT_PROBES}
    return CostModel(target_s, draft_s, row_seconds(monotone(target_s), probes), context_rates(context_extra_s))
