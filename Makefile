# Two commands on a fresh machine: `make train` (the main job) and `make test`.
# Each creates .venv and installs what it needs first. torch is pinned to the CPU build.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
POLICY := artifacts/policy-bench
CONFIG ?= configs/tiny_cpu.yaml

.PHONY: install train test policy bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

policy: $(POLICY)/config.json

$(POLICY)/config.json: | $(STAMP)
	$(BIN)/fastgrpo sft --config $(CONFIG)

train: $(STAMP) $(POLICY)/config.json
	$(BIN)/fastgrpo train --config $(CONFIG)

test: $(STAMP)
	$(BIN)/pytest -x -q

clean:
	rm -rf runs
