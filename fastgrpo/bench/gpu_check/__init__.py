"""`fastgrpo bench gpu-check` (or `python -m fastgrpo.bench.gpu_check`; `tools/gpu_check.sh` wraps it for
an offline GPU machine): the GPU path shown to work and measured, in one command of at most 600 seconds
on one H100 or H200 (the run holds itself to 540 s; `harness.PLANNED_S` is each stage's plan).

Stages, each timed and printed as it goes; a stage that fails is recorded with its error and the run
goes on to the next (the exit status is 1 if any failed). The JSON and the markdown tables are rewritten
after every stage, so a run cut short keeps what it finished.

- environment: versions, the device, its spec-sheet memory bandwidth (by name) and a measured copy's.
- sft: the policy (`model.size=gpu`, ~308M parameters) warm-started on the task (`fastgrpo sft`'s
  code) on the device, bf16 autocast, ~1 minute (a fixed step count, `sft.max_minutes` as a guard): the
  policy matters here for the draft's acceptance, not its accuracy.
- draft: its draft (`fastgrpo draft-pretrain`'s code) on the device, ~36 s.
- train_step: one GRPO step of the Megatron trainer (world of 1, TP1 PP1, NCCL on a GPU) against the
  torch trainer's, both bf16, on the same batch: log-probabilities, loss, gradient norm, step times.
- weight_push: the trainer's weights into an engine through the weight bridge (buckets, a version,
  the checksummed commit), timed against a device memcpy of the same bytes; a corrupted tensor is
  refused at the commit; the Megatron trainer's export is pushed too when that stage built one.
- decode_bound: the plain decode step at batch 1 and 64 against its memory-bandwidth bound (bytes of
  weights + KV cache read per step / peak bandwidth), and what the rest is (see `decode_bound`).
- step_bench: the decode steps alone, plain and five tree shapes at 1, 4, 16, 64 and 256 rows, in the
  eager engine and the static one (CUDA graphs), medians and standard errors of repeated calls; plain and
  d4k4n12 in a static engine with fused pointwise regions too (`engine.fused`, compiled before the timing),
  and the kernels one step of those launches (the profiler over a graph replay).
- simulator_fit: `bench simulate`'s roofline and overhead constants fitted to those steps (`fit.py`),
  its error before and after, and with each level held out.
- decode_8b: a random-weight Llama-3.1-8B shape (configs/models/, bf16) decoding at batch 1, 16 and 64
  in the graphed engine against its bandwidth bound (skipped, with the reason, without the memory).
- rollout: `bench rollout`'s workloads on this device, repeated until they decide: off, static and its
  A/A twin (the noise floor), fastgrpo, tlt, aware, aware_per_sequence at 1, 4, 16, 64 and 256 running
  sequences and on a GRPO batch (with bench rollout's static trees and unshared prefill), 3 repetitions
  in rotated order, medians and standard errors; every call's per-step trace, aware's state after each
  of its calls and its calibrated cost model kept with the results.

`--size test --device cpu` runs every stage at toy sizes in well under a minute (tests/test_gpu_check.py,
inside `make test`), so the script cannot rot before a GPU runs it.

What the GPU machine lacks beyond torch, transformers, safetensors and numpy is `WHEELS` (fetched
by `tools/gpu_wheels.sh`; `pins.py`, which `make install-gpu` reads too); tests/test_gpu_check.py checks
that the modules this path imports come from nowhere else. No MLflow (`tracking.enabled=false`; nothing
here starts a tracker), no plots.

The package: `pins` (the GPU installs' pins and which carried wheels to install), `harness` (the sizes,
the run and its timing helpers), `stages` (the stages in run order, and the training side's), `decode`
(decode_bound, decode_8b), `steps` (step_bench, simulator_fit), `rollout_sweep` (rollout), `records` (one
timed generate() call and what is kept of it), `fit` (the simulator's constants fitted to measured steps),
`report` (the tables), `driver` (`run`, `main`).
"""

from __future__ import annotations

from fastgrpo.bench.gpu_check.driver import main, run
from fastgrpo.bench.gpu_check.harness import PEAK_BANDWIDTH, PLANNED_S, SIZES, STAGES, Check, Size, spread
from fastgrpo.bench.gpu_check.pins import BASE, GPU_EXTRAS, GPU_TORCH, WHEELS, gpu_requirements, wheels_to_install
from fastgrpo.bench.gpu_check.report import against_simulator, dumps, markdown
from fastgrpo.bench.gpu_check.decode import DECODE_BATCHES
from fastgrpo.bench.gpu_check.records import policy_state
from fastgrpo.bench.gpu_check.rollout_sweep import AA_PAIR, AWARE_MODES, FIXED_MODES, SWEEP_MODES, grpo_summary, level_row
from fastgrpo.bench.gpu_check.stages import STAGE_FUNCTIONS
from fastgrpo.bench.gpu_check.steps import FUSED_SHAPES, MERGED_SHAPES, STEP_SHAPES, step_cells

__all__ = ["AA_PAIR", "AWARE_MODES", "BASE", "DECODE_BATCHES", "FIXED_MODES", "FUSED_SHAPES", "GPU_EXTRAS", "GPU_TORCH",
           "MERGED_SHAPES", "PEAK_BANDWIDTH", "PLANNED_S", "SIZES", "STAGES", "STAGE_FUNCTIONS", "STEP_SHAPES",
           "SWEEP_MODES", "WHEELS",
           "Check", "Size", "against_simulator", "dumps", "gpu_requirements", "grpo_summary", "level_row", "main",
           "markdown", "policy_state", "run", "spread", "step_cells", "wheels_to_install"]
