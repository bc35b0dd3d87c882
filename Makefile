# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-done

.PHONY: setup demo console test lint typecheck unit integration clean proto

setup: $(STAMP)

$(STAMP): pyproject.toml
	@{ command -v mosquitto && command -v chromium && command -v chromedriver && command -v prometheus; } >/dev/null 2>&1 || { \
	  echo "installing mosquitto, chromium, chromium-driver and prometheus (Debian packages)"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
	    mosquitto mosquitto-clients chromium chromium-driver prometheus; }
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first: 2.13.0 is a CPU build on this disk; a bare `torch` would pull CUDA.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/python -m fedge.protocols.grpc.build
	@touch $(STAMP)

demo: setup
	$(BIN)/fedge demo

# The demo, then the operator console over its live fleet until Ctrl-C (an admin token
# printed once); `make demo` itself ends by itself and says how to open it.
CONSOLE_PORT ?= 8470
console: setup
	$(BIN)/fedge demo --console $(CONSOLE_PORT)

lint: setup
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

typecheck: setup
	$(BIN)/mypy

# `integration` and `test` run on WORKERS parallel pytest-xdist workers: most integration
# tests wait on processes (brokers, SuperNodes, rounds), not the CPU -- the suite costs
# about 27 min of CPU (user + sys) on 2 cores, against 41 min of wall time one test at a
# time. One OpenMP thread per process, so the workers' torch threads do not fight over
# the cores. `make test WORKERS=1` runs it on one worker.
WORKERS ?= 3

# The fast tier (pure logic, under 3 minutes on 2 cores): no process, no socket server, no
# training over a second. `integration` and `slow` are the rest; `test` runs everything.
# One OpenMP thread: on a busy 2-core host torch's spinning threads made the same tests
# 3-4x slower (test_feddf + test_dp_sgd: 23 s vs 6 s, measured side by side).
unit: setup
	OMP_NUM_THREADS=1 $(BIN)/pytest -m "not integration and not slow" -q --durations=10

integration: setup
	OMP_NUM_THREADS=1 $(BIN)/pytest -m "integration or slow" -q -n $(WORKERS) --dist loadgroup --durations=25

test: setup lint typecheck
	OMP_NUM_THREADS=1 $(BIN)/pytest -q -n $(WORKERS) --dist loadgroup --durations=25

clean:
	rm -rf $(VENV) build dist .pytest_cache .mypy_cache .ruff_cache
