#!/usr/bin/env bash
# fastgrpo's GPU path on one H100 or H200, shown to work and measured, in one command of at most 600 seconds.
#
# 1. Before, on a machine that reaches PyPI (the GPU machine has no network):
#        bash tools/gpu_wheels.sh          # or: bash tools/gpu_check.sh --fetch
#    fetches ~11 MB of wheels (omegaconf, antlr4, PyYAML, tqdm, math-verify, latex2sympy2, sympy, mpmath,
#    megatron-core, psutil; the list is fastgrpo/bench/gpu_check/pins.py's WHEELS) into tools/gpu_wheels/,
#    which git ignores and the device tool carries with the working tree.
# 2. On the GPU machine (Python 3.12 with torch + CUDA, transformers, safetensors, numpy), from anywhere:
#        bash tools/gpu_check.sh --out "$OUT"
#    It builds the C extensions for that Python where they are not built for it (setup.py build_ext
#    --inplace; optional, as at install), installs the wheels whose package this Python lacks or has in an
#    older version (pip install --no-index --no-deps --target, into a temporary directory; unzipped if pip
#    fails), puts that directory
#    and the repository first on PYTHONPATH,
#    and runs `python -m fastgrpo.bench.gpu_check` from the repository root, offline (HF_HUB_OFFLINE=1),
#    without MLflow (tracking.enabled=false) or plots.
#    Other arguments go to the driver: --size test (toy sizes, seconds), --device cpu|cuda|auto,
#    --check-replays (on a CPU with engine.steps=static: every static step held to what its graph's replay
#    would compute),
#    --stages sft,draft,..., --work DIR (keep the policy, draft and cost model there), key=value overrides
#    (e.g. sft.max_minutes=1). PYTHON=... picks the interpreter (default: python3 or python, whichever has torch).
#
# Stages, each timed against its planned seconds (fastgrpo/bench/gpu_check/harness.py's PLANNED_S; the run
# holds itself to 540 s, leaving the rest of the 600 for the wheels, Python's start and the report) and
# printed with its progress; a stage that fails is recorded with its error and the run goes on:
#   environment (10 s: versions, device, its spec-sheet and measured copy bandwidth);
#   sft (100 s: a ~308M policy warm-started on the task in bf16, 66 s of training and its evaluation);
#   draft (50 s: its EAGLE draft, 36 s of pretraining and one online round);
#   train_step (30 s: one GRPO step of the Megatron trainer, world of 1, TP1 PP1, NCCL, against the torch
#     trainer's on the same batch);
#   weight_push (5 s: trainer -> engine through the weight bridge, the checksummed commit, a corrupted tensor
#     refused);
#   decode_bound (25 s: the plain decode step at batch 1 and 64 against bytes read / peak memory bandwidth,
#     and where the rest goes: device busy time and op count from the profiler, the matmuls alone in a CUDA
#     graph, launch cost);
#   step_bench (90 s: plain decoding and five tree shapes at 1, 4, 16, 64 and 256 rows, eager steps against
#     static ones replayed from CUDA graphs, medians of 3 calls of 24 tokens a row in rotated order);
#   simulator_fit (2 s: bench simulate's roofline and overhead constants fitted to those steps, its error
#     before and after the fit and with each level held out);
#   decode_8b (60 s: a random-weight Llama-3.1-8B shape, bf16, decoding at batch 1, 16 and 64 in the graphed
#     engine against its bandwidth bound, its layers' pointwise regions op by op and fused (compiled);
#     skipped with the reason where memory is short);
#   rollout (150 s, what is left: off, static and its A/A twin static_aa, fastgrpo, tlt, aware,
#     aware_per_sequence at 1, 4, 16, 64 and 256 running sequences and a GRPO batch, 3 repetitions in
#     rotated order after a warm-up, medians and standard errors, aware's state after every call, its
#     calibrated cost model and every call's per-step trace).
#
# Writes <out>/gpu_check.json (per stage: status, seconds, numbers or the error and its traceback; rewritten
# after every stage, so a run cut short keeps what it finished) and <out>/gpu_check.md (the tables).
# Default <out>: bench/gpu_check. Exit status: 0 every stage ok; 1 a stage failed (the others still ran);
# 2 no usable Python.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=bench/gpu_check
ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --fetch) exec bash tools/gpu_wheels.sh ;;
        --out) OUT=$2; shift 2 ;;
        --out=*) OUT=${1#--out=}; shift ;;
        *) ARGS+=("$1"); shift ;;
    esac
done

PY=${PYTHON:-}
if [ -z "$PY" ]; then
    for candidate in python3 python; do
        if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "import torch" 2>/dev/null; then
            PY=$candidate
            break
        fi
    done
fi
if [ -z "$PY" ]; then
    echo "gpu_check: no python with torch found (set PYTHON=...)" >&2
    exit 2
fi

# the wheels this Python lacks, or has only in an older version (a newer one it has stays in charge):
# fastgrpo/bench/gpu_check/pins.py's wheels_to_install decides, with the standard library alone
SITE=$(mktemp -d "${TMPDIR:-/tmp}/fastgrpo-gpu-site.XXXXXX")
trap 'rm -rf "$SITE"' EXIT
WHEELS_DIR=${GPU_WHEELS:-tools/gpu_wheels}  # GPU_WHEELS: another folder of them (a test on another Python)
MISSING=()
if [ -d "$WHEELS_DIR" ]; then
    mapfile -t MISSING < <(PYTHONPATH=. "$PY" -m fastgrpo.bench.gpu_check --wheels-to-install "$WHEELS_DIR")
fi
if [ ${#MISSING[@]} -gt 0 ]; then
    echo "gpu_check: installing ${#MISSING[@]} wheels into $SITE: ${MISSING[*]##*/}"
    if ! "$PY" -m pip install --quiet --no-index --no-deps --no-compile --target "$SITE" "${MISSING[@]}"; then
        echo "gpu_check: pip failed; unpacking the wheels instead"
        for wheel in "${MISSING[@]}"; do
            "$PY" -m zipfile -e "$wheel" "$SITE"
        done
    fi
elif [ ! -d "$WHEELS_DIR" ]; then
    echo "gpu_check: no $WHEELS_DIR/ (fetch it with tools/gpu_wheels.sh where PyPI is reachable)"
fi

# the C parts (setup.py: the draft index's trie, the hybrid merge) for this Python, where they are not built for
# it yet: a build made elsewhere is for another Python (the device machine's 3.12), and without them the
# index's lookups and the hybrid merge run as their slower Python and torch equivalents. Optional, as at
# install: a failure leaves those in charge, and the environment stage records which ran
EXTENSIONS="import fastgrpo.speculation._suffix_trie, fastgrpo.engines.embedded._tree_merge"
if ! PYTHONPATH=. "$PY" -c "$EXTENSIONS" 2>/dev/null; then
    echo "gpu_check: building the C extensions for $("$PY" -c 'import sys; print(sys.version.split()[0])')"
    if ! timeout 120 "$PY" setup.py --quiet build_ext --inplace >"${TMPDIR:-/tmp}/fastgrpo-build-ext.log" 2>&1; then
        echo "gpu_check: warning: the C extensions did not build (the Python equivalents run instead):" >&2
        tail -3 "${TMPDIR:-/tmp}/fastgrpo-build-ext.log" >&2
    fi
fi

export PYTHONPATH=".:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export GPU_CHECK_INSTALLED="${MISSING[*]+${MISSING[*]##*/}}"  # what the environment stage reports
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
# no network on the GPU machine: NCCL's bootstrap and gloo's side groups over loopback
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo} GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
export MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
if ! "$PY" -c "import omegaconf, tqdm, math_verify, megatron.core, psutil" 2>/dev/null; then
    echo "gpu_check: warning: some packages are missing (the stages that need them will fail):" >&2
    "$PY" -c "import omegaconf, tqdm, math_verify, megatron.core, psutil" 2>&1 | tail -1 >&2
fi
"$PY" -m fastgrpo.bench.gpu_check --out "$OUT" ${ARGS[@]+"${ARGS[@]}"}
