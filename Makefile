# The whole set-up: `make run` and `make test` create .venv if needed and install everything.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench
PIP    := $(BIN)/python -m pip --disable-pip-version-check --no-input -qq

export PREFECT_HOME ?= $(CURDIR)/.trainyard/prefect
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export DVC_NO_ANALYTICS ?= 1
# Stage commands in dvc.yaml call `trainyard`; make them find the venv's.
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: install browser run test repro bench lint clean storage-down

install: $(STAMP)

# torch 2.13.0 first: its CPU wheel is found locally, and with it installed the range in
# pyproject.toml is satisfied, so pip never pulls the multi-GB CUDA build.
$(STAMP): pyproject.toml constraints.txt
	mkdir -p $(PREFECT_HOME)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -c constraints.txt -e '.[dev]'
	$(BIN)/python -c "import torch, prefect, dvc, comet_ml, s3fs, trainyard" 
	$(MAKE) --no-print-directory browser
	touch $(STAMP)

# Headless chromium + chromedriver for the comparison page's browser test (Debian packages;
# playwright cannot download its own browser here), and tmux, the real terminal the progress
# bar's test runs in. Needs root, as CI runs; skipped if present.
browser:
	@{ command -v chromium && command -v tmux; } >/dev/null 2>&1 || { \
		apt-get update -qq >/dev/null && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver tmux >/dev/null; }

run: $(STAMP)
	mkdir -p $(PREFECT_HOME)
	$(BIN)/trainyard storage up
	$(BIN)/trainyard run

# Two test files at a time: most tests wait on subprocesses (Prefect, torchrun, the store),
# and a file's module fixtures (a trained model, a Prefect server) are built once.
test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile

# valgrind: the loop benchmark counts instructions with callgrind (Debian package, as above).
$(BENCH_STAMP): $(STAMP)
	$(PIP) install -c constraints.txt -e '.[dev,bench]'
	@command -v valgrind >/dev/null 2>&1 || { apt-get update -qq >/dev/null && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind >/dev/null; }
	touch $(BENCH_STAMP)

# Never part of `make test` (which runs the quick mode once, asserting no timings).
bench: $(BENCH_STAMP)
	$(BIN)/python -m benchmarks.run

repro: $(STAMP)
	$(BIN)/dvc repro

lint: $(STAMP)
	$(BIN)/ruff check trainyard flows tasks tests benchmarks
	$(BIN)/ruff format --check trainyard flows tasks tests benchmarks

storage-down:
	$(BIN)/trainyard storage down

clean: storage-down
	rm -rf .trainyard data/processed metrics.json
