# Two commands do all set-up on a fresh machine:
#   make run    create .venv if missing, install, run the main job on the embedded CPU default
#   make test   create .venv if missing, install, run ruff, the import contract (lint-imports) and the CPU test suite
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
ifeq ($(origin RUN_ID), undefined)
RUN_ID := run-$(shell date +%Y%m%d-%H%M%S)
endif
# Prefect for `make run` and `make serve`: its own home under runs/ (`make serve PREFECT_HOME=...` for another),
# a start-up timeout that suits a loaded machine (the ephemeral server takes 25-46 s here), no telemetry,
# slime's and the tasks' logs in the run log
PREFECT_HOME := $(CURDIR)/runs/.prefect
PREFECT_ENV := PREFECT_HOME=$(PREFECT_HOME) PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=180 \
	PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 PREFECT_LOGGING_EXTRA_LOGGERS=slime,tasks
CONFIG ?= deployments/tiny-cpu.yaml
PYTEST_ARGS ?=

.PHONY: install run serve test test-slow lint bench docs clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $(STAMP)

# The main job: the Prefect pipeline (flows/pipeline.py) on the embedded CPU default, as a new run
# under runs/: tiny kit (built when missing: the config names it under `kit:`) -> convert (HF -> Megatron) -> SFT -> rejection sampling (reported) -> RL
# (Ray, one Prefect task per step) -> evaluate (RL and SFT checkpoints) -> export (Megatron -> HF).
# Ephemeral Prefect API (no server to start); run history in runs/.prefect. It ends with a summary
# (time per stage, eval accuracy per stage, artifacts, exported HF directory, how to open the UI).
# `make run RUN_ID=<an earlier id>` resumes or reuses that run.
run: $(STAMP)
	@start=$$(date +%s); $(PREFECT_ENV) $(BIN)/python -m flows.pipeline --config $(CONFIG) --run-id $(RUN_ID) \
	  && echo "pipeline took $$(( $$(date +%s) - start )) s"
	@echo "done: artifacts in runs/$(RUN_ID)/<stage>/ (Prefect stage results in runs/$(RUN_ID)/.prefect-results);" \
	      "same run again (reuses every completed stage): make run RUN_ID=$(RUN_ID)"

# A local Prefect server (http://127.0.0.1:$(PORT), run history and server log in $(PREFECT_HOME)), every work
# pool of prefect.yaml (slime-local, slime-gpu, slime-cpu: process pools, created when missing), the slime-gpu
# tag limit, every deployment of prefect.yaml, then a worker of slime-local in the foreground: flows/serve.py.
# slime-gpu and slime-cpu need their own worker elsewhere (docs/prefect-workers.md). One Ctrl-C stops the
# worker, then the server. In another shell:
#   export PREFECT_API_URL=http://127.0.0.1:4200/api
#   .venv/bin/prefect deployment run 'post-training/tiny-cpu' --watch
PORT ?= 4200
serve: $(STAMP)
	@exec env $(PREFECT_ENV) $(BIN)/python -m flows.serve --port $(PORT)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(BIN)/python -m pytest -m "slow and not gpu and not sglang" $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports

bench: $(STAMP)
	$(BIN)/python bench/shards.py
	$(BIN)/slime datasets make-tiny $(KIT)
	$(BIN)/python bench/engine.py --model $(KIT)/model

# The generated docs: docs/configuration.md (`slime config reference`) and the refused-flag table of
# docs/from-slime.md; tests/test_cli.py and tests/test_docs.py fail when either is stale
docs: $(STAMP)
	$(BIN)/slime config reference > docs/configuration.md
	$(BIN)/python tests/test_docs.py --write

clean-venv:
	rm -rf $(VENV)
