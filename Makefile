# Two commands on a fresh machine: `make run` and `make test` (`make docs` builds the manual).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test docs clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch is pinned and installed first so that no dependency can pull a CUDA build.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[train,dev,integrations,torchft,torchtitan,docs]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/edgc demo

# Two workers, whole files each (module fixtures run once); the multi-process tests size themselves
# for two cores, and much of a process test is one core importing torch while the other idles.
# ruff first: lint and format check of the whole tree (pyproject.toml's [tool.ruff]), seconds.
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=15 tests

# Into build/docs/ (git-ignored); tests/core/test_docs.py builds it too, with warnings as errors.
docs: $(STAMP)
	$(BIN)/python -m sphinx -b html -q -W --keep-going docs build/docs
	@echo "the manual: build/docs/index.html"

clean:
	rm -rf $(VENV) runs build .pytest_cache
