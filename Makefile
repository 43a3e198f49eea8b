# One command per job; CI (.ci/run) calls the same ones.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint bench clean

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

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check app tests bench
	$(BIN)/ruff format --check app tests bench
	$(BIN)/mypy
	$(BIN)/lint-imports

bench: $(STAMP)
	$(BIN)/python bench/quick.py

clean:
	rm -rf $(VENV) .oncegate .pytest_cache .mypy_cache .ruff_cache
