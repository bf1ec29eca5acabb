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
ifeq ($(origin RUN_ID), undefined)
RUN_ID := run-$(shell date +%Y%m%d-%H%M%S)
endif
# Prefect for `make run`: its own home under runs/, a start-up timeout that suits a loaded machine
# (the ephemeral server takes 25-46 s here), no telemetry, slime's and the tasks' logs in the run log
PREFECT_ENV := PREFECT_HOME=$(CURDIR)/runs/.prefect PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=180 \
	PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 PREFECT_LOGGING_EXTRA_LOGGERS=slime,tasks
CONFIG ?= deployments/tiny-cpu.yaml
PYTEST_ARGS ?=

.PHONY: install run serve test test-slow lint bench clean-venv

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

# A local Prefect server (http://127.0.0.1:$(PORT), run history in runs/.prefect), the process work pool
# slime-local, the slime-gpu tag limit and every deployment of prefect.yaml, then a worker in the
# foreground. Ctrl-C twice stops the worker (here the first one alone did not end it within 80 s);
# the server, in its own session, is then stopped by its PID. In another shell:
#   export PREFECT_API_URL=http://127.0.0.1:4200/api
#   .venv/bin/prefect deployment run 'post-training/tiny-cpu' --watch
PORT ?= 4200
serve: $(STAMP)
	@set -e; mkdir -p runs; export $(PREFECT_ENV) PREFECT_API_URL=http://127.0.0.1:$(PORT)/api; \
	setsid $(BIN)/prefect server start --host 127.0.0.1 --port $(PORT) > runs/prefect-server.log 2>&1 & server=$$!; \
	trap 'kill -INT $$server 2>/dev/null; wait $$server 2>/dev/null' EXIT; \
	echo "prefect server (pid $$server) starting, log runs/prefect-server.log"; \
	until $(BIN)/python -c "import httpx; httpx.get('http://127.0.0.1:$(PORT)/api/health').raise_for_status()" 2>/dev/null; do \
	  kill -0 $$server 2>/dev/null || { echo "prefect server exited: see runs/prefect-server.log"; exit 1; }; sleep 2; done; \
	$(BIN)/prefect work-pool inspect slime-local > /dev/null 2>&1 || $(BIN)/prefect work-pool create slime-local --type process; \
	$(BIN)/prefect concurrency-limit inspect slime-gpu > /dev/null 2>&1 || $(BIN)/prefect concurrency-limit create slime-gpu 1; \
	$(BIN)/prefect deploy --all --no-prompt; \
	echo "UI: http://127.0.0.1:$(PORT)  (PREFECT_API_URL=http://127.0.0.1:$(PORT)/api)"; \
	$(BIN)/prefect worker start --pool slime-local

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
