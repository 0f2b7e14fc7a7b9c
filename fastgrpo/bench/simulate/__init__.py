"""`fastgrpo bench simulate`: one engine's rollout, simulated step by step, and checked against this CPU.

Why: speculation pays where a verify forward of tens of tokens costs about one plain forward (a GPU at
small batch) and where rollouts have a long tail (reasoning RL). Neither exists here. The simulator
replays the engine's scheduling (continuous batching: prefill whenever rows are free, every other
step a plain or speculative decode step of all running rows, finished rows leave at once) with the
REAL speculation policy objects deciding at every step, against a stated cost model of a named
accelerator and model, and accepted lengths drawn from a stated acceptance profile. It is trusted
only as far as, with this machine's measured costs and our engine's measured acceptance, it predicts
the real engine's rollout times, which the same command measures (the "validation" section).

Nothing here hands a policy the simulator's true costs: `aware` gets a cost model built by timing the
simulated forwards with the calibration sweep of `engines/embedded/calibrate.calibrate` (same sizes, same fixed
context) and then corrects it, as on the engine, from the step seconds it observes.

The parts: `costs` (what a step costs: the CPU profile's `CpuCosts`), `acceptance` (accepted drafts:
profiles and the draft's confidence), `workload` (GRPO batches and long tails), `simulator` (the
engine's loop, step by step, and the policies it runs), `profile` (this machine's costs, measured on
the engine), `validate` (the engine and the simulator on the same workloads), `gpu` (the simulated GPU
cases), `shape` (`--model`: one config.json's shape on one simulated GPU, a MoE's experts priced, no
CPU validation), `command` (`bench simulate` itself, its plot and its table) and, apart from the
simulator, `truths` (step-cost truths `aware` is graded on by its tests and the tools/aware_* replays).
"""


from fastgrpo.bench.rollout import STATIC_SWEEP  # noqa: F401  (re-exported: the static trees compared)
from fastgrpo.speculation.cost_model import CONTEXT, SWEEP  # noqa: F401
from fastgrpo.bench.simulate.costs import (  # noqa: F401
    Costs, CpuCosts, STATIC_DEFAULT)
from fastgrpo.bench.simulate.acceptance import (  # noqa: F401
    AcceptanceProfile, DraftConfidence, eagle_profile, fit_acceptance)
from fastgrpo.bench.simulate.workload import (  # noqa: F401
    SimRequest, Workload, grpo_workload, longtail_workload, resampled_workload)
from fastgrpo.bench.simulate.simulator import (  # noqa: F401
    Recorder, Rows, SimRun, replay_steps, sim_policies, simulate)
from fastgrpo.bench.simulate.profile import (  # noqa: F401
    CpuProfiler, PREFILL_CASES, PROFILE_CONFIGS, PROFILE_LEVELS, SHAPES_PER_LEVEL)
from fastgrpo.bench.simulate.validate import (  # noqa: F401
    LEVEL_PASSES, REPETITIONS, SWEEP_MODES, VALIDATION_REPLAYS, level_reps, median_se, price_engine_run, validate, whole_tree_acceptance)
from fastgrpo.bench.simulate.gpu import (  # noqa: F401
    BUCKETS, GPU_MAX_BATCH, GPU_STATICS, LEARNING, RHO_SWEEP, bucket_name, gpu_fixed_concurrency, gpu_results, run_policies, time_by_bucket)
from fastgrpo.bench.simulate.command import (  # noqa: F401
    bench_simulate, markdown, plot_all)
