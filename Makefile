# Every target sets itself up: a fresh machine needs only Python 3.11 and make.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)
EXTRAS := litert,test,bench,dev,metrics,ray

.PHONY: run test test-fast bench check venv clean

venv: $(STAMP)
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[$(EXTRAS)]"
	rm -f $(VENV)/.installed-* && touch $@

run: venv         ## the main job on the bundled demo model (~20 s)
	$(BIN)/slabpool run

test: venv        ## the whole suite, slow cases included (a few minutes on 2 cores)
	$(BIN)/python -m pytest -q

test-fast: venv   ## everything but the cases marked slow
	$(BIN)/python -m pytest -q -m "not slow"

bench: venv       ## slabpool vs the alternatives, side by side; writes bench/results/
	$(BIN)/python -m bench

check: venv       ## ruff + mypy
	$(BIN)/ruff check engine workers shm tests bench
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
