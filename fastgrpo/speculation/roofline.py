"""The roofline price of a GPU forward: the seconds a named accelerator takes for a forward of a named
model, from public specifications and stated efficiency assumptions. `bench simulate` prices its
simulated GPUs with it, and `aware` on SGLang decides from it (speculation/sglang_tiers.py) until a
calibration of SGLang's own forwards exists."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fastgrpo.speculation.cost_model import (CONTEXT, CONTEXT_EXTRA, CONTEXT_PROBES, KINDS, ROW_PROBES, ROWS, SWEEP,
                                             CostModel, context_rates, monotone, row_seconds, sweep_rows)
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


# Model shapes from the models' Hugging Face config.json (meta-llama/Meta-Llama-3-8B, -70B).
@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tp: int = 1
    bytes_per_param: int = 2  # bf16 weights and KV

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        h, kv = self.hidden, self.kv_heads * self.head_dim
        return h * (h + 2 * kv) + h * h + 3 * h * self.intermediate

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden


LLAMA3_8B = ModelShape("Llama-3-8B", 32, 4096, 14336, 32, 8, 128256, tp=1)
LLAMA3_70B = ModelShape("Llama-3-70B (TP8)", 80, 8192, 28672, 64, 8, 128256, tp=8)
MODELS = {"llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B}


class Roofline:
    """Step latency of `model` on `hw`: each forward takes the longer of its bytes (weights, and the
    KV cache of every row's context) over achievable bandwidth and its FLOPs (matmuls of every token,
    attention growing with context) over achievable peak, plus a fixed overhead and, at TP > 1, two
    ring all-reduces of the activations per layer. The draft (EAGLE: one decoder layer, the fusing
    projection, the target's LM head) runs on the same GPUs at the same TP."""

    padded = False  # SGLang's paged KV cache: each row reads its own context

    def __init__(self, hw: Accelerator, model: ModelShape):
        self.hw, self.model = hw, model
        self.name = f"{hw.name} / {model.name}"

    def _forward(self, B: int, n: int, ctx_sum: int, params: int, layers: int, overhead: float) -> float:
        m, hw = self.model, self.hw
        tokens = B * n
        kv_bytes_per_token = 2 * layers * m.kv_heads * m.head_dim * m.bytes_per_param / m.tp
        bytes_ = params * m.bytes_per_param / m.tp + kv_bytes_per_token * ctx_sum
        flops = 2 * params * tokens / m.tp + 4 * layers * m.heads * m.head_dim * n * ctx_sum / m.tp
        seconds = max(bytes_ / (hw.hbm_bytes_s * hw.bw_eff), flops / (hw.peak_flops * hw.flops_eff)) + overhead
        if m.tp > 1:
            message = tokens * m.hidden * m.bytes_per_param
            seconds += 2 * layers * (hw.allreduce_latency_s + 2 * (m.tp - 1) / m.tp * message / hw.link_bytes_s)
        return seconds

    def target(self, B: int, n: int, ctx_max: int, ctx_sum: int) -> float:
        m = self.model
        return self._forward(B, n, ctx_sum, m.layers * m.layer_params + m.lm_head_params, m.layers,
                             self.hw.target_overhead_s)

    def draft(self, B: int, n: int, ctx_max: int, ctx_sum: int) -> float:
        m = self.model
        return self._forward(B, n, ctx_sum, m.layer_params + 2 * m.hidden * m.hidden + m.lm_head_params, 1,
                             self.hw.draft_overhead_s)

    def decode_step(self, B: int, ctx_max: int, ctx_sum: int, speculating: bool = False) -> float:
        return self.target(B, 1, ctx_max, ctx_sum) + self.hw.step_overhead_s

    def spec_step(self, c: SpecConfig, B: int, width: int, ctx_max: int, ctx_sum: int,
                  verified: float | None = None) -> float:
        draft = self.draft(B, width, ctx_max, ctx_sum) + (c.depth - 1) * self.draft(B, c.topk, ctx_max, ctx_sum)
        return (draft + self.target(B, verified or c.num_verify, ctx_max, ctx_sum) + self.hw.step_overhead_s
                + self.hw.spec_overhead_s)

    def prefill(self, unique: int, width: int, joined: int) -> float:
        return self.target(unique, width, width, unique * width // 2) + self.hw.step_overhead_s

    def between_steps(self, B: int) -> float:
        return 0.0  # in step_overhead_s

    def per_call(self, sequences: int) -> float:
        return 0.0


def model_shape(config, tp: int = 1, name: str | None = None) -> ModelShape:
    """A Hugging Face Llama-style `config` (PretrainedConfig or its dict) as a ModelShape at tensor
    parallelism `tp`, bf16."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    return ModelShape(name or str(get("_name_or_path", "") or get("model_type", "model")), int(get("num_hidden_layers")),
                      int(get("hidden_size")), int(get("intermediate_size")), int(get("num_attention_heads")),
                      int(get("num_key_value_heads") or get("num_attention_heads")), int(get("vocab_size")), tp=tp)


def accelerator_named(device_name: str) -> Accelerator:
    """The accelerator whose specifications price `device_name` (torch.cuda.get_device_name): H200 for
    an H200, else H100 (the closest public profile; a stated assumption for any other GPU)."""
    return H200 if "H200" in device_name.upper() else H100


def simulated_cost_model(costs: Roofline, error: Callable[[str, int], float] | None = None) -> CostModel:
    """What `engines/embedded/calibrate.calibrate` would measure on the simulated machine: target and draft forwards
    at each sweep size (B = min(tokens, 64) rows of tokens / B new tokens, over CONTEXT cached tokens
    each), at its row probes and at its context probes. `error(kind, tokens)` multiplies a point (to
    test that `aware` survives a bad calibration)."""
    def measured(kind: str, B: int, n: int, ctx: int = CONTEXT) -> float:
        forward = costs.target if kind == "target" else costs.draft
        return forward(B, n, ctx, B * ctx) * (error(kind, B * n) if error else 1.0)

    target_s, draft_s = ({t: measured(kind, sweep_rows(t), max(t // ROWS, 1)) for t in SWEEP} for kind in KINDS)
    probes = {(B, n): measured("target", B, n) for B, n in ROW_PROBES}
    context_extra_s = {(kind, B, n): measured(kind, B, n, CONTEXT + CONTEXT_EXTRA) - measured(kind, B, n)
                       for kind in KINDS for B, n in CONTEXT_PROBES}
    return CostModel(target_s, draft_s, row_seconds(monotone(target_s), probes), context_rates(context_extra_s))
