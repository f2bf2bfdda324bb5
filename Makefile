# The two commands a newcomer needs: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install --disable-pip-version-check
# One stamp per set of packages: `make run` installs what running needs, and a
# later `make test` or `make bench` still installs its own extra.
RUNTIME := $(VENV)/.installed-runtime
DEV := $(VENV)/.installed-dev
BENCH := $(VENV)/.installed-bench
TOOLS := $(VENV)/.installed-tools
# bench, chaos and demo: a distribution of their own (tools/), so that the
# service's wheel carries none of them. Every set but the runtime adds it.
WITH_TOOLS := -e tools/

.PHONY: run test setup lint typecheck chaos demo bench clean

$(BIN)/python:
	@echo "make: creating the virtual environment $(VENV) with $(PYTHON)"
	$(PYTHON) -m venv $(VENV)

$(RUNTIME): pyproject.toml | $(BIN)/python
	@echo "make: installing intentledger and its runtime dependencies into $(VENV) (no test or benchmark tools)"
	$(PIP) -e .
	@touch $@
	@echo "make: runtime dependencies installed"

# The suite also runs a quick benchmark against the peers and type-checks
# them, so testing needs the bench extra beside the dev one.
$(DEV): pyproject.toml tools/pyproject.toml | $(BIN)/python
	@echo "make: installing intentledger with the test tools and benchmark peers (extras dev, bench) into $(VENV)"
	@echo "make: and intentledger-tools (tools/: bench, chaos, demo)"
	$(PIP) -e '.[dev,bench]' $(WITH_TOOLS)
	@touch $@

$(BENCH): pyproject.toml tools/pyproject.toml | $(BIN)/python
	@echo "make: installing intentledger with the benchmark peers (the bench extra) into $(VENV)"
	@echo "make: and intentledger-tools (tools/: bench, chaos, demo)"
	$(PIP) -e '.[bench]' $(WITH_TOOLS)
	@touch $@

$(TOOLS): pyproject.toml tools/pyproject.toml | $(BIN)/python
	@echo "make: installing intentledger and intentledger-tools (tools/: bench, chaos, demo) into $(VENV)"
	$(PIP) -e . $(WITH_TOOLS)
	@touch $@

setup: $(RUNTIME)

# Serve the API, dispatcher and sandbox provider on a local SQLite file.
run: $(RUNTIME)
	$(BIN)/intentledger migrate
	@echo "A key for trying it out (actor 'demo'):"
	$(BIN)/intentledger keys create --actor demo
	$(BIN)/intentledger serve

lint: $(DEV)
	$(BIN)/ruff check src tests tools
	$(BIN)/ruff format --check src tests tools

typecheck: $(DEV)
	$(BIN)/mypy

# Lint, type-check, then the whole suite on SQLite and on a throwaway
# PostgreSQL server that scripts/with-postgres starts and removes; the
# browser and Prometheus the suite drives are installed first when missing.
# Two test processes share the server; the tests marked `alone` (they restart
# it, or load the machine on purpose) run after them, one at a time.
test: lint typecheck
	scripts/ensure-test-tools
	scripts/with-postgres sh -c '$(BIN)/python -m pytest -n 2 --dist worksteal -m "not alone" && $(BIN)/python -m pytest -m alone'

# The full fault run of docs/reliability.md, on a throwaway PostgreSQL server.
chaos: $(TOOLS)
	scripts/with-postgres sh -c '$(BIN)/intentledger chaos --database-url "$$INTENTLEDGER_TEST_POSTGRES_URL" --restart-db-cmd "$$INTENTLEDGER_TEST_POSTGRES_RESTART"'

# One payment per sandbox scenario, watched live (README).
demo: $(TOOLS)
	$(BIN)/intentledger demo

# Issue 6's and 18's benchmarks on a throwaway, durable PostgreSQL server (fsync
# and synchronous_commit on; docs/benchmarks.md); BENCH_ARGS=--quick for a short
# run, BENCH_ARGS="--profile DIR" to sample with py-spy.
bench: $(BENCH)
	scripts/with-postgres --durable sh -c '$(BIN)/intentledger bench --database-url "$$INTENTLEDGER_TEST_POSTGRES_URL" $(BENCH_ARGS)'

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
