#!/usr/bin/env bash
# Fetch, on a machine that reaches PyPI, the wheels tools/gpu_check.sh installs on an offline GPU machine.
#
#   bash tools/gpu_wheels.sh            # into tools/gpu_wheels/ (ignored by git; the device tool carries it)
#
# The GPU machine's Python 3.12 has torch, transformers, safetensors and numpy (with their own
# requirements) and no network; fastgrpo's gpu-check path needs a few more packages, pinned in
# fastgrpo/bench/gpu_check/pins.py (WHEELS, the pins `make install-gpu` takes too): omegaconf, antlr4,
# PyYAML, tqdm, math-verify and its latex2sympy2/sympy/mpmath, megatron-core, psutil. Each is fetched as a wheel for CPython 3.12 on
# manylinux x86_64 without its dependencies (tests/test_gpu_check.py checks that every requirement of
# each is in the list or comes with torch/transformers). Fails if the wheels exceed 20 MB in all.
# PYTHON: the interpreter whose pip downloads (default: .venv/bin/python, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
DEST=tools/gpu_wheels
mkdir -p "$DEST"
read -r -a SPECS <<< "$(PYTHONPATH=. "$PY" -m fastgrpo.bench.gpu_check --wheel-specs)"
rm -f "$DEST"/*.whl
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d "$DEST" "${SPECS[@]}"

total=0
printf '%10s  %s\n' bytes wheel
for w in "$DEST"/*.whl; do
    size=$(stat -c %s "$w")
    total=$((total + size))
    printf '%10d  %s\n' "$size" "$(basename "$w")"
done
printf '%10d  total (%d wheels, %s MB)\n' "$total" "$(ls "$DEST"/*.whl | wc -l)" "$(awk -v t="$total" 'BEGIN { printf "%.1f", t / 1e6 }')"
if [ "$total" -gt 20000000 ]; then
    echo "gpu_wheels: $total bytes is over the 20 MB budget" >&2
    exit 1
fi
