# Two commands do all set-up on a fresh machine:
#   make run    create .venv if missing, install, run the main job on the embedded CPU default
#   make test   create .venv if missing, install, run ruff and the CPU test suite
#
# On a CPU machine torch is installed first from TORCH_SPEC, so no CUDA wheels are pulled in;
# on a GPU machine set TORCH_SPEC to the build you want (or an installed one), and add `.[gpu]`.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= test
STAMP := $(VENV)/.installed
KIT ?= runs/tiny-kit
RUN ?= runs/run-$(shell date +%Y%m%d-%H%M%S)
CONFIG ?= deployments/tiny-cpu.yaml
PYTEST_ARGS ?=

.PHONY: install run test test-slow lint bench clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $(STAMP)

# The main job: the stages that exist so far, on the embedded CPU default, in a new run directory:
# tiny kit -> convert (HF -> Megatron) -> SFT -> export (Megatron -> HF). The Prefect pipeline with
# rejection sampling, RL and evaluation replaces this recipe as those stages land.
run: $(STAMP)
	$(BIN)/slime datasets make-tiny $(KIT)
	$(BIN)/slime convert --config $(CONFIG) --save $(RUN)/convert
	$(BIN)/slime sft --config $(CONFIG) --load $(RUN)/convert --save $(RUN)/sft
	$(BIN)/slime export --config $(CONFIG) --load $(RUN)/sft --output-dir $(RUN)/export
	@echo "done: Megatron checkpoints in $(RUN)/convert and $(RUN)/sft, HF model in $(RUN)/export"

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(BIN)/python -m pytest -m "slow and not gpu and not sglang" $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python bench/shards.py
	$(BIN)/slime datasets make-tiny $(KIT)
	$(BIN)/python bench/engine.py --model $(KIT)/model

clean-venv:
	rm -rf $(VENV)
