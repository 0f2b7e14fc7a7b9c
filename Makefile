# Two commands on a fresh machine: `make train` (the main job) and `make test`.
# Each creates .venv and installs what it needs first. torch is pinned to the CPU build.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# `make install-gpu` writes its own stamp; while it is there every target takes the GPU install (its
# recipe reruns when pyproject.toml changes) and never runs the CPU recipe, whose torch pin would replace
# SGLang's torch. `make install` on such a node (the CPU install over it) removes it.
GPU_STAMP := $(VENV)/.installed-gpu
INSTALLED = $(if $(wildcard $(GPU_STAMP)),$(GPU_STAMP),$(STAMP))
CONFIG ?= configs/tiny_cpu.yaml

.PHONY: install install-gpu check-gpu-install train train-distributed test test-slow test-all test-slurm policy bench bench-quick bench-e2e bench-forward clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py fastgrpo/speculation/_suffix_trie.c fastgrpo/engines/embedded/_tree_merge.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test,megatron,deepspeed]"
	rm -f $(GPU_STAMP)
	touch $(STAMP)

# GPU nodes (SGLang rollout): sglang 0.5.23 pins its own CUDA torch (torch==2.14.1), which the CPU pin
# above cannot share, so a GPU install is its own: tools/gpu_requirements.py lists fastgrpo's
# requirements without the CPU torch pin, the test, megatron and sglang extras, and SGLang's torch,
# with the packages the offline GPU check carries as wheels at the same pins (one list of them:
# fastgrpo/bench/gpu_check/pins.py); fastgrpo itself goes in without dependencies.
# `make check-gpu-install` resolves that list with pip --dry-run (nothing installed;
# tests/test_sglang_conformance.py does too, and checks the pins).
# Its stamp is $(GPU_STAMP) (see INSTALLED above).
install-gpu: $(GPU_STAMP)

$(GPU_STAMP): pyproject.toml setup.py fastgrpo/speculation/_suffix_trie.c fastgrpo/engines/embedded/_tree_merge.c tools/gpu_requirements.py fastgrpo/bench/gpu_check/pins.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/python tools/gpu_requirements.py > $(VENV)/gpu-requirements.txt
	$(BIN)/pip install -q -r $(VENV)/gpu-requirements.txt
	$(BIN)/pip install -q --no-deps -e .
	rm -f $(STAMP)
	touch $(GPU_STAMP)

check-gpu-install: $(INSTALLED)
	$(BIN)/python tools/gpu_requirements.py --resolve

# the policy (SFT warm start) and its draft are built once, then reused
policy: $(INSTALLED)
	$(BIN)/fastgrpo sft --config $(CONFIG) --if-missing
	$(BIN)/fastgrpo draft-pretrain --config $(CONFIG) --if-missing

train: policy
	$(BIN)/fastgrpo train --config $(CONFIG)

# a small distributed run on this machine: torchrun, the Megatron trainer on NPROC ranks, an embedded
# engine on each of them, and one more rank (the draft slice) training the draft from every engine
NPROC ?= 2
TP ?= $(NPROC)
PP ?= 1
ARGS ?=
train-distributed: policy
	$(BIN)/torchrun --nproc-per-node $$(( $(NPROC) + 1 )) -m fastgrpo train --config $(CONFIG) trainer.backend=megatron \
		parallel.tensor=$(TP) parallel.pipeline=$(PP) parallel.draft_ranks=1 draft.online=async threads=1 \
		grpo.steps=5 task.eval_size=100 \
		run_dir=runs/distributed $(ARGS)

# the speculation benchmarks on the task their results were measured on (its long-tailed answers)
bench bench-quick bench-e2e bench-forward: CONFIG = configs/tiny_cpu_plain.yaml

bench: policy
	$(BIN)/fastgrpo bench rollout --config $(CONFIG) --output bench/rollout.json

bench-quick: policy
	$(BIN)/fastgrpo bench rollout --config $(CONFIG) --quick --output bench/rollout-quick.json

bench-e2e: policy
	$(BIN)/fastgrpo bench e2e --config $(CONFIG) --output bench/e2e.json

bench-forward: policy
	$(BIN)/fastgrpo bench forward --config $(CONFIG) --output bench/forward.json

# -rs: say why a test skipped (here: the engine contract tests on SGLang, which needs CUDA).
# `make test` is the fast tier; the multi-process worlds (torchrun, DP/TP/PP runs) are marked slow and
# run by `make test-slow`, which CI runs too (`make test-all`: both); --durations prints the slowest
# tests, what CI's time budget is spent on. The fast tier runs in TEST_WORKERS pytest-xdist workers (a
# file's tests in one worker, each worker on one torch thread: tests/conftest.py), two for a two-core
# machine; the slow tier's worlds start their own processes and run one at a time
TEST_WORKERS ?= 2
test: $(INSTALLED)
	$(BIN)/pytest -x -q -rs --durations=15 -m "not slow" -n $(TEST_WORKERS) --dist loadfile

test-slow: $(INSTALLED)
	$(BIN)/pytest -x -q -rs --durations=25 -m slow

test-all: test test-slow

# `sbatch slurm/train_70b.sh` (tiny overrides) on a one-node Slurm cluster the tests start and stop;
# Debian's Slurm packages are installed first when missing (as root). Where apt cannot, the tests say
# why they skip, except under CI=true: there a tier that ran nothing must not pass, so the failed
# install ends the target (and tests/slurm/cluster.py fails rather than skips).
SLURM_PACKAGES := slurmd slurmctld slurm-client
SLURM_MISSING = $(if $(filter true,$(CI)),{ echo "test-slurm: CI=true and $(SLURM_PACKAGES) could not be installed with apt" >&2; exit 1; },echo "test-slurm: could not install $(SLURM_PACKAGES) with apt")
test-slurm: $(INSTALLED)
	@command -v slurmctld >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -q --no-install-recommends $(SLURM_PACKAGES); } >/dev/null || \
		$(SLURM_MISSING)
	FASTGRPO_TEST_SLURM=1 $(BIN)/pytest -x -q -rs tests/slurm

clean:
	rm -rf runs
