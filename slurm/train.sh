#!/bin/bash
# Runs `fastgrpo train` on a Slurm allocation: one torchrun per node (srun), a rendezvous at the
# allocation's first node, checkpoints and MLflow under one shared run directory, a checkpoint before
# the job ends, and a clean requeue. Called by an sbatch script (slurm/train_70b.sh) as
#
#   slurm/train.sh CONFIG [key=value ...]
#
# Environment (all optional):
#   FASTGRPO_HOME            the repository, on a path every node sees (default: where sbatch ran)
#   FASTGRPO_VENV            the Python environment holding fastgrpo (default: $FASTGRPO_HOME/.venv)
#   FASTGRPO_RUN_DIR         checkpoints, MLflow and summaries (default: $FASTGRPO_HOME/runs/<config name>);
#                            the same directory across submissions is what makes a job resume
#   FASTGRPO_TRACKING_URI    an MLflow server instead of the run directory's sqlite file
#   FASTGRPO_NPROC_PER_NODE  processes per node (default: the GPUs Slurm gave the node)
#   FASTGRPO_GPU_MEMORY_GB   device memory for `fastgrpo plan` (default: the config's cluster section)
#   FASTGRPO_STOP_GRACE_S    how long torchrun lets the ranks finish a step and checkpoint after a stop
#                            signal before it kills them (default 540: inside the 600 s of --signal)
#   FASTGRPO_RDZV_PORT       the rendezvous port on the first node (default: 29500 + job id % 1000)
#
# Signals: Slurm's warning before the time limit (`--signal=B:USR1@600`) or
# `scancel --batch --signal=USR1 JOB` makes every rank checkpoint at the next step boundary, and the
# job requeues itself and resumes. SIGTERM (`scancel JOB`, preemption) does the same without the
# requeue; a plain `scancel` leaves the run the cluster's KillWait to reach that boundary.
set -euo pipefail

die() { echo "fastgrpo/slurm: $*" >&2; exit 1; }
say() { echo "fastgrpo/slurm: $*"; }

[[ $# -ge 1 ]] || die "usage: slurm/train.sh CONFIG [key=value ...]"
[[ -n ${SLURM_JOB_ID:-} ]] || die "not inside a Slurm job: submit with sbatch (see slurm/train_70b.sh)"
CONFIG=$1
shift

HOME_DIR=${FASTGRPO_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}
cd "$HOME_DIR"
[[ -f $CONFIG ]] || die "config $CONFIG not found under $HOME_DIR (set FASTGRPO_HOME to the repository)"
VENV=${FASTGRPO_VENV:-$HOME_DIR/.venv}
[[ -x $VENV/bin/torchrun ]] || die "no torchrun in $VENV/bin: run \`make install\` or set FASTGRPO_VENV"
export PATH=$VENV/bin:$PATH

NAME=$(basename "$CONFIG" .yaml)
RUN_DIR=${FASTGRPO_RUN_DIR:-$HOME_DIR/runs/$NAME}
NNODES=${SLURM_NNODES:-1}
NPROC=${FASTGRPO_NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}
[[ -n $NPROC ]] || die "Slurm gave no GPUs to this node: set FASTGRPO_NPROC_PER_NODE"
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
PORT=${FASTGRPO_RDZV_PORT:-$((29500 + SLURM_JOB_ID % 1000))}
for arg in "$@"; do
    [[ $arg != run_dir=* ]] || die "set FASTGRPO_RUN_DIR instead of $arg: the script resumes from that directory"
done
ARGS=(run_dir="$RUN_DIR" "$@")
[[ -n ${FASTGRPO_TRACKING_URI:-} ]] && ARGS+=(tracking.uri="$FASTGRPO_TRACKING_URI")

latest_checkpoint() { ls -d "$RUN_DIR"/checkpoints/step_* 2>/dev/null | sort | tail -n 1 || true; }

say "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): $CONFIG on $NNODES node(s) x $NPROC, rendezvous $HEAD_NODE:$PORT, run dir $RUN_DIR"
fastgrpo plan --config "$CONFIG" --nodes "$NNODES" --gpus-per-node "$NPROC" \
    ${FASTGRPO_GPU_MEMORY_GB:+--gpu-memory-gb "$FASTGRPO_GPU_MEMORY_GB"} "${ARGS[@]}" \
    || die "fastgrpo plan rejected this layout (above): nothing launched"

mkdir -p "$RUN_DIR"
BEFORE=$(latest_checkpoint)
if [[ -n $BEFORE ]]; then say "resuming from $BEFORE"; else say "no checkpoint in $RUN_DIR: starting at step 0"; fi

SRUN_PID=""
STOP=""  # the signal that asked the run to stop: USR1 (time limit near: requeue) or TERM (cancel)
on_signal() {
    STOP=$1
    say "SIG$1: every rank checkpoints after its current step (grace ${FASTGRPO_STOP_GRACE_S:-540} s)"
    # to every process of the job's steps (every node's torchrun and ranks), not this shell; a signal to
    # srun itself would make it tear the step down
    [[ -z $SRUN_PID ]] || scancel --signal=TERM "$SLURM_JOB_ID" || true
}
trap 'on_signal USR1' USR1
trap 'on_signal TERM' TERM

export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${FASTGRPO_STOP_GRACE_S:-540}
srun --nodes="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 \
    torchrun --nnodes="$NNODES" --nproc-per-node="$NPROC" --max-restarts=0 \
    --rdzv-backend=c10d --rdzv-endpoint="$HEAD_NODE:$PORT" --rdzv-id="$SLURM_JOB_ID" \
    -m fastgrpo train --config "$CONFIG" --resume "${ARGS[@]}" &
SRUN_PID=$!
[[ -z $STOP ]] || { sleep 5; scancel --signal=TERM "$SLURM_JOB_ID"; }  # a signal that came before srun started

# a trapped signal interrupts `wait` (status > 128) while srun runs on: wait again until it has ended
while :; do
    STATUS=0
    wait "$SRUN_PID" || STATUS=$?
    kill -0 "$SRUN_PID" 2>/dev/null || break
done

AFTER=$(latest_checkpoint)
if [[ $STATUS -eq 0 ]]; then
    say "run finished: $RUN_DIR"
    exit 0
fi
if [[ -n $STOP && -n $AFTER && $AFTER != "$BEFORE" ]]; then
    # torchrun itself exits non-zero after a signal even when every rank stopped cleanly: the new
    # checkpoint is what says the stop worked
    if [[ $STOP == USR1 ]]; then
        say "stopped at $AFTER; requeueing job $SLURM_JOB_ID to resume from it"
        scontrol requeue "$SLURM_JOB_ID"
    else
        say "stopped at $AFTER; submit again to resume"
    fi
    exit 0
fi
die "the run failed (srun exit status $STATUS${STOP:+, after SIG$STOP}); latest checkpoint: ${AFTER:-none}"
