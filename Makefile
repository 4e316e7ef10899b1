# Two commands from a fresh clone: `make run` trains on the embedded default dataset,
# `make test` runs lint, the format check, the type checker and the test suite. Both build .venv
# first (torch 2.13.0 + tessera + test deps), again whenever pyproject.toml changes.
PYTHON ?= python3
VENV ?= .venv
# test processes (pytest-xdist, whole modules each): the suite is mostly single-threaded work and
# waits on worker processes, so two keep two cores busy; each on one thread (OMP_NUM_THREADS,
# NUMBA_NUM_THREADS), since two workers each running a pool as wide as the machine oversubscribe it
# (three modules of single-process training: 111 s with default threads, 37 s with one)
TEST_WORKERS ?= 2
BIN := $(VENV)/bin
STAMP := $(VENV)/.tessera-installed

.PHONY: run test lint typecheck clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/tessera train

test: lint typecheck
	OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

lint: $(STAMP)
	$(BIN)/ruff check tessera tests benchmarks
	$(BIN)/ruff format --check tessera tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache
