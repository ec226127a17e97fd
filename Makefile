# The two set-up commands (see README): `make demo` runs the default experiment, `make test` runs the tests.
# Both create .venv when it is missing, with the exact versions of constraints.txt (infra/install.sh: uv when it
# installs, pip otherwise; the CPU build of torch first so nothing pulls a CUDA build).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUN_NAME ?= tiny-$(shell date +%Y%m%d-%H%M%S)
# The lock: every package, transitive and test extras included, for Python 3.11-3.13 (CPU/CI/Dockerfile.cpu), and
# the GPU image's (Python 3.12, linux x86_64, the `gpu` extra with vLLM and the CUDA torch it pins).
COMPILE = $(BIN)/uv pip compile pyproject.toml --quiet --custom-compile-command "make lock"
LOCK_CPU = $(COMPILE) --extra test --universal -o constraints.txt
LOCK_GPU = $(COMPILE) --extra gpu --python-version 3.12 --python-platform x86_64-manylinux_2_28 -o constraints-gpu.txt

.PHONY: demo test test-fast install lock upgrade-lock clean-cache ui docs docs-serve

$(STAMP): pyproject.toml constraints.txt infra/install.sh
	PYTHON=$(PYTHON) VENV=$(VENV) infra/install.sh
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/grpo run --config tiny --run-name $(RUN_NAME)

# The whole suite on TEST_WORKERS pytest-xdist workers (whole modules each). Four on
# 2 cores: the tests spend much of their time waiting on the processes and servers they start, and the workers share
# one Prefect and one MLflow server (tests/servers.py) and one artefact cache, so another worker adds no servers. Five
# once kept the shared Prefect server's SQLite busy past its clients' retries; four keep the margin. Measured at 6412e47
# (idle): five workers 17m30s, three 15m13s, four 14m53s (more workers on 2 cores burn more CPU; fewer overlap fewer
# waits).
# xdist hands out the modules with the most tests first (its loadscope reorder), each to the first free worker, so
# the few-test modules that wait on servers and browsers run beside many quick CPU-bound ones; tests/conftest.py hands
# out two of them first (HANDED_OUT_FIRST), which otherwise ran alone at the end. Handing out every long module first
# (--no-loadscope-reorder) ran every server and browser module at once: the workers ended together, but the suite took
# longer (17m11s against 16m24s idle).
TEST_WORKERS ?= 4
test: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The edit-test loop: the unit layer only (no training, servers, browsers or extra processes; ~1 minute).
test-fast: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -n 2 -m "not integration" $(PYTEST_ARGS)

# Re-resolve the lock after changing a range in pyproject.toml, keeping every other pin as it is.
lock: $(STAMP)
	$(LOCK_CPU)
	$(LOCK_GPU)

# Deliberate upgrade: the newest versions inside pyproject.toml's ranges, installed, then the whole suite.
upgrade-lock: $(STAMP)
	$(LOCK_CPU) --upgrade
	$(LOCK_GPU) --upgrade
	$(MAKE) install test

clean-cache:
	rm -rf .cache/grpo

ui: $(STAMP)
	$(BIN)/grpo ui

# The docs site (mkdocs.yml, docs/): built strictly into site/ (a broken link or reference fails), or served with
# live reload on http://127.0.0.1:8000. tests/test_docs.py builds it too and runs its examples.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve
