# Shortcuts for the commands in README.md. `make help` lists them.
# Extra arguments go in ARGS:  make train ARGS="trainer.max_epochs=3 model=mlp"
# The interpreter: .venv's when there is one (make setup), else the python3 (or python) on PATH,
# i.e. your own active environment. PY=... picks another.
# (By name, not path: the shell finds it on PATH, and a path with spaces stays one word.)
PY ?= $(if $(wildcard .venv/bin/python),.venv/bin/python,$(if $(shell command -v python3),python3,python))
ARGS ?=
# make plot draws RUN (default: the newest training run under logs/train/runs).
RUN ?= $(shell ls -td logs/train/runs/*/ 2>/dev/null | head -n 1)

.PHONY: help setup train test test-fast lint format notebooks clean devices plot

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-13s %s\n", $$1, $$2}'

setup: ## create .venv with the project, its library and the development tools
	bash scripts/setup.sh

train: ## train with the default config (ARGS="key=value ..." to override)
	$(PY) -m project.train $(ARGS)

test: ## the whole test suite, as CI runs it
	$(PY) -m pytest $(ARGS)

test-fast: ## the fast unit tests only (no subprocesses, no notebooks)
	$(PY) -m pytest -m "not slow" $(ARGS)

lint: ## ruff lint and format check
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: ## apply ruff's fixes and formatting; strip notebook outputs
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .
	$(PY) -m nbstripout notebooks/*.ipynb

notebooks: ## run every notebook top to bottom; executed copies go to logs/notebooks/
	@mkdir -p logs/notebooks
	PROJECT_LOG_DIR="$(CURDIR)/logs" $(PY) -m jupyter execute --kernel_name=python3 \
		--output='../logs/notebooks/{notebook_name}' notebooks/*.ipynb

devices: ## list the GPUs this process may use, as cuda:N
	$(PY) -m runkit.devices $(ARGS)

plot: ## redraw curves.png of RUN=<run or sweep dir> (default: the newest run)
	@test -n "$(RUN)" || { echo "error: no run under logs/train/runs; pass RUN=<run dir>" >&2; exit 2; }
	$(PY) -m runkit.plot "$(RUN)" $(ARGS)

clean: ## delete caches and build outputs (never logs/: your runs stay)
	rm -rf outputs multirun lightning_logs .pytest_cache .ruff_cache build dist
	find . -name __pycache__ -type d -not -path './.venv/*' -prune -exec rm -rf {} +
# repo-only: begin

# This repository's own tools (the GPU check, mutation testing, benchmarks).
.PHONY: bench gpu-wheels gpu-check-dry mutate
gpu-wheels: ## fetch the wheels a GPU machine without internet lacks (wheels/gpu-py312)
	$(PY) scripts/gpu_check.py --fetch-wheels

gpu-check-dry: ## check, without a GPU, everything the GPU check will run
	$(PY) scripts/gpu_check.py --dry-run

mutate: ## mutation score of MODULE=checkpoints|gpus|gpu_stats|finite_loss (or a path, with TESTS="...") by its fast tests
	@test -n "$(MODULE)" || { echo "error: pass MODULE=checkpoints, gpus, gpu_stats or finite_loss (or a path under lib/runkit/src/ with TESTS=...)" >&2; exit 2; }
	$(PY) scripts/mutate.py $(MODULE) $(if $(TESTS),--tests $(TESTS)) $(ARGS)

bench: ## every benchmark briefly; ratios to benchmarks/results/<date>.json, compared with the last
	$(PY) benchmarks/run_all.py $(ARGS)
# repo-only: end
