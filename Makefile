# One command per job; CI (.ci/run) calls the same ones.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install --quiet --disable-pip-version-check
# One stamp per extra installed into $(VENV), newer than pyproject.toml when what it names is
# there: `make run` needs the package with `[embedded]` (RUN_STAMP), everything else the test
# toolchain too, `[dev]` (STAMP: the name every .venv made before the split has, so it keeps
# working). `[dev]` holds all that `[embedded]` does, so its stamp stands for both.
RUN_STAMP := $(VENV)/.installed-embedded
STAMP := $(VENV)/.installed

.PHONY: run test test-all test-langgraph-oldest test-tools faults soak lint lock bench bench-all \
	bench-quick clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(RUN_STAMP): pyproject.toml | $(BIN)/python
	@if [ $(STAMP) -nt pyproject.toml ]; then echo "$(VENV) has the test toolchain: nothing to install"; \
	else $(PIP) -e '.[embedded]'; fi
	touch $@

$(STAMP): pyproject.toml | $(BIN)/python
	$(PIP) -e '.[dev]'
	touch $@ $(RUN_STAMP)

# The gateway on the embedded PostgreSQL in front of the demo upstream, both started here, with
# an admin token for this run; either one that cannot start stops both. Ctrl-C stops both.
# Ports: make run DEMO_PORT=9000 ONCEGATE_PORT=8080 ONCEGATE_ADMIN_PORT=8081.
run: $(RUN_STAMP)
	@VENV=$(VENV) bash scripts/run.sh

# tests/deploy evaluates the Grafana dashboard's queries on a real Prometheus,
# tests/e2e/test_queue.py drives /admin/ui in a real headless Chromium, and tests/faults/
# test_failover.py fails a primary over to its standby (Debian's postgresql-15: initdb,
# pg_basebackup; the package's own cluster is not used), all Debian's packages, installed here
# when they can be (root, with apt-get). Elsewhere those tests say they are skipped and the rest
# of the suite runs; CI (root on Debian) always has them.
test-tools: $(STAMP)
	@{ command -v prometheus >/dev/null && command -v chromium >/dev/null \
		&& [ -x /usr/lib/postgresql/15/bin/pg_basebackup ]; } || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
				apt-get install -y -qq --no-install-recommends prometheus chromium \
				postgresql-15 >/dev/null; \
		else \
			echo "make test: prometheus, chromium or postgresql-15 is not installed and cannot" \
				"be installed here (needs root and apt-get): the dashboard's, the admin page's" \
				"and the failover's tests will be skipped."; \
		fi; }

# The contract's whole surface: every test not marked slow (pyproject.toml), the gateway on
# PostgreSQL and the store on PostgreSQL and on Citus. A new user's second command: a few minutes.
# On TEST_WORKERS workers (pytest-xdist), each a session with its own PostgreSQL: the suite waits
# on processes and sockets about half the time, so three keep two cores busy (tests/conftest.py
# says how the tests are shared out). `make test TEST_WORKERS=0` runs it in one process.
TEST_WORKERS ?= 3
test: test-tools
	$(BIN)/python -m pytest -q -m "not slow" -n $(TEST_WORKERS)

# The rest of the suite, what `make test` leaves out (-m slow): the gateway's modules again on
# Citus, the 200-run LangGraph lab, load and fault loops, the chaos soak, the Dockerfile's
# install replayed. CI runs `make test` and then this: every test gates every landing, once.
test-all: test-tools
	$(BIN)/python -m pytest -q -m slow

# The LangGraph integration's tests again on the oldest LangGraph the extra allows (pyproject.toml),
# in an environment of its own; `make test` runs them on the newest.
LANGGRAPH_OLDEST := 1.1.10
OLDEST := .venv-langgraph-oldest
test-langgraph-oldest: $(STAMP)
	test -x $(OLDEST)/bin/python || $(PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install --quiet -e '.[dev]' 'langgraph==$(LANGGRAPH_OLDEST)'
	$(OLDEST)/bin/python -m pytest -q tests/agent/test_langgraph.py tests/agent/test_langgraph_tools.py \
		tests/agent/test_langgraph_keys.py

# The fault suite in full: real kills, outages under load, three gateways (docs/faults.md).
faults: $(STAMP)
	$(BIN)/python -m pytest -q tests/faults

# The chaos soak and its history checker (docs/faults.md): 10 minutes of gateway kills,
# PostgreSQL crashes, failovers and Citus worker losses under load, then every history checked.
# Options: make soak SOAK="--minutes 3 --seed 7 --scenarios single,failover,citus"
# A volume run: make soak SOAK="--minutes 60 --requests 1000000" (ends at whichever comes first)
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

# Options for bench/run.py go in BENCH, e.g. make bench BENCH="--json bench.json --duration 3"
# (--json PATH writes every row's figures and batch sizes as one JSON object; --json - prints it
# after the tables).
bench: $(BENCH_TOOLS)
	$(BIN)/python bench/run.py $(BENCH)

bench-all: $(BENCH_TOOLS)
	$(BIN)/python bench/run.py --all $(BENCH)

bench-quick: $(STAMP)
	$(BIN)/python bench/quick.py

# The container image's dependencies, pinned with hashes, from pyproject.toml (pip-tools).
# pgserver stays out: the image has no embedded PostgreSQL (Dockerfile).
lock: $(STAMP)
	$(BIN)/python -m pip install --quiet pip-tools
	$(BIN)/pip-compile --quiet --generate-hashes --strip-extras --unsafe-package pgserver \
		--no-emit-index-url --no-emit-find-links --output-file requirements.lock pyproject.toml

clean:
	rm -rf $(VENV) $(OLDEST) .pytest_cache .mypy_cache .ruff_cache
