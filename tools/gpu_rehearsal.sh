#!/usr/bin/env bash
# The GPU check rehearsed on this CPU under the GPU machine's own torch and transformers, so that a
# version difference fails here and not in a GPU session's scarce minutes.
#
#   bash tools/gpu_rehearsal.sh [--venv DIR] [--out DIR]
#
# Makes (once) a virtual environment at DIR (default: $TMPDIR/fastgrpo-gpu-rehearsal) with the versions
# fastgrpo/bench/gpu_check/pins.py's GPU_MACHINE names (what the device tool's image held at the last GPU
# check, bench/gpu/gpu_check.json) and the wheels' pins (WHEELS), then runs tools/gpu_check.sh at test size
# on the CPU with static steps held to what their CUDA graphs' replays would compute (--check-replays), and
# its 8B stage once more with the fused regions compiled.
# PyPI has that torch only as its CUDA build: about 3 GB to download, which runs on a CPU as well.
# Not rehearsed: the GPU machine's Python (3.12; this one's is whatever python3 is) and anything CUDA does.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${TMPDIR:-/tmp}/fastgrpo-gpu-rehearsal
OUT=${TMPDIR:-/tmp}/fastgrpo-gpu-rehearsal-out
while [ $# -gt 0 ]; do
    case "$1" in
        --venv) VENV=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        *) echo "gpu_rehearsal: unknown argument $1" >&2; exit 2 ;;
    esac
done

read -r -a MACHINE <<< "$(PYTHONPATH=. python3 -c 'from fastgrpo.bench.gpu_check.pins import GPU_MACHINE; print(*GPU_MACHINE)')"
read -r -a WHEELS <<< "$(PYTHONPATH=. python3 -c 'from fastgrpo.bench.gpu_check.pins import WHEELS; print(*WHEELS)')"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
if ! "$VENV/bin/python" -m pip install --quiet "${MACHINE[@]}" "${WHEELS[@]}" safetensors numpy; then
    echo "gpu_rehearsal: could not install ${MACHINE[*]} (a pip configuration that caps torch, /etc/xdg/pip on" \
         "this kind of machine, refuses it: PIP_CONFIG_FILE=/dev/null lifts it)" >&2
    exit 1
fi
"$VENV/bin/python" -c 'import torch, transformers; print(f"gpu_rehearsal: torch {torch.__version__}, transformers {transformers.__version__}")'
GPU_WHEELS=/nonexistent PYTHON="$VENV/bin/python" bash tools/gpu_check.sh --size test --device cpu --out "$OUT" \
    --work "$OUT/work" --check-replays engine.steps=static
# under --check-replays the fused regions run their eager functions (dynamo does not trace under a dispatch
# mode); the 8B stage again without it compiles them, through this torch's Inductor
GPU_WHEELS=/nonexistent PYTHON="$VENV/bin/python" bash tools/gpu_check.sh --size test --device cpu \
    --out "$OUT/compiled" --stages environment,decode_8b engine.steps=static
