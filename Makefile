# The two set-up commands (see README): `make demo` runs the default experiment, `make test` runs the tests.
# Both create .venv when it is missing. torch is installed first from the CPU build so pip never pulls CUDA.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUN_NAME ?= tiny-$(shell date +%Y%m%d-%H%M%S)

.PHONY: demo test install clean-cache ui

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/grpo run --config configs/tiny.yaml --run-name $(RUN_NAME)

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

clean-cache:
	rm -rf .cache/grpo

ui: $(STAMP)
	$(BIN)/grpo ui
