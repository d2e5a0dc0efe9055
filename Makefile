# Every target sets itself up: a fresh machine needs only Python 3.11 and make.
# `make run` installs the package alone (numpy, onnxruntime, psutil, tqdm); the test, bench and
# check targets add the extras they need (LiteRT, Ray, pyarrow, pytest, the competing pools).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
HASH   := $(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)
BASE   := $(VENV)/.installed-base-$(HASH)
FULL   := $(VENV)/.installed-full-$(HASH)
EXTRAS := litert,parquet,test,bench,dev,metrics,ray,serve

.PHONY: run test test-fast bench bench-jobs check venv clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(BASE): pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/python -m pip install -q -c constraints.txt -e .
	rm -f $(VENV)/.installed-base-* && touch $@

$(FULL): pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[$(EXTRAS)]"
	rm -f $(VENV)/.installed-* && touch $(BASE) $@

venv: $(FULL)

run: $(BASE)       ## the main job on the bundled demo model (~20 s)
	$(BIN)/slabpool run

test: $(FULL)      ## the whole suite, slow cases included, as two runs side by side (tests/shards.py)
	$(BIN)/python -m tests.shards

test-fast: $(FULL) ## everything but the cases marked slow
	$(BIN)/python -m tests.shards -m "not slow"

bench: $(FULL)     ## slabpool vs the alternatives, side by side; writes bench/results/; then one call's latency (~1 min)
	$(BIN)/python -m bench
	$(BIN)/python -m bench.latency --json bench/results/latency.json

bench-jobs: $(FULL) ## the main job's workloads (rows, infer, JSONL, map, table) as whole processes
	$(BIN)/python -m bench.jobs

check: $(FULL)     ## ruff + mypy
	$(BIN)/ruff check slabpool engine workers shm tests bench
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
