# One command per job; CI (.ci/run) calls the same ones.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test faults soak lint bench bench-all bench-quick clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The gateway on the embedded PostgreSQL in front of the demo upstream, both started here.
# Ctrl-C stops both.
run: $(STAMP)
	@$(BIN)/oncegate demo-upstream --port 9000 & demo=$$!; \
	trap 'kill $$demo 2>/dev/null' EXIT INT TERM; \
	$(BIN)/oncegate serve --upstream http://127.0.0.1:9000 --log-format text

# tests/deploy evaluates the Grafana dashboard's queries on a real Prometheus, and
# tests/e2e/test_queue.py drives /admin/ui in a real headless Chromium (both Debian's packages).
TEST_TOOLS := $(VENV)/.test-tools
$(TEST_TOOLS): $(STAMP)
	command -v prometheus >/dev/null || (apt-get update && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus)
	command -v chromium >/dev/null || (apt-get update && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium)
	touch $(TEST_TOOLS)

# The whole suite but the slowest fault tests (a few minutes).
test: $(TEST_TOOLS)
	$(BIN)/python -m pytest -q -m "not slow"

# The fault suite in full: real kills, outages under load, three gateways (docs/faults.md).
faults: $(STAMP)
	$(BIN)/python -m pytest -q tests/faults

# The chaos soak and its history checker (docs/faults.md): 10 minutes of gateway kills and
# PostgreSQL crashes under load, then every history checked. Options: make soak SOAK="--minutes 3 --seed 7"
soak: $(STAMP)
	$(BIN)/python -m tests.soak $(SOAK)

lint: $(STAMP)
	$(BIN)/ruff check app migrations tests bench examples
	$(BIN)/ruff format --check app migrations tests bench examples
	$(BIN)/mypy
	$(BIN)/lint-imports

# Benchmarks (bench/README.md): wrk from Debian drives every configuration; idemkit is the peer.
BENCH_TOOLS := $(VENV)/.bench-tools
$(BENCH_TOOLS): $(STAMP)
	command -v wrk >/dev/null || (apt-get update && apt-get install -y --no-install-recommends wrk)
	$(BIN)/python -m pip install --quiet -e '.[dev,bench]'
	touch $(BENCH_TOOLS)

bench: $(BENCH_TOOLS)
	$(BIN)/python bench/run.py

bench-all: $(BENCH_TOOLS)
	$(BIN)/python bench/run.py --all

bench-quick: $(STAMP)
	$(BIN)/python bench/quick.py

clean:
	rm -rf $(VENV) .oncegate .pytest_cache .mypy_cache .ruff_cache
