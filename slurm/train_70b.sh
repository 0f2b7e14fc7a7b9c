#!/bin/bash
# GRPO on Llama-3.1-70B-Instruct (configs/llama3_70b.yaml): submit from the repository's root on a shared filesystem,
#
#   sbatch slurm/train_70b.sh [key=value ...]
#
# Any #SBATCH line below can be overridden on the command line as usual (sbatch --nodes=... --time=...);
# the layout must still pass `fastgrpo plan`, which runs first. slurm/train.sh documents the environment
# variables (run directory, Python environment, ...), the signals and the requeue.
#SBATCH --job-name=fastgrpo-llama3-70b
#SBATCH --nodes=9
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --output=slurm-%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
set -euo pipefail
HOME_DIR=${FASTGRPO_HOME:-$SLURM_SUBMIT_DIR}
exec "$HOME_DIR/slurm/train.sh" "${FASTGRPO_CONFIG:-configs/llama3_70b.yaml}" "$@"
