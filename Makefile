# Two entry points for a fresh machine: `make run` (demo) and `make test`. Both set themselves up.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch; the package metadata itself accepts any torch>=2.5.
TORCH_PIN ?= torch==2.13.0
PACKAGES := -e . -e plugins/scheduler_fifo -e plugins/scheduler_mixed -e plugins/scheduler_priority \
	-e plugins/attention_flash -e plugins/models_qwen3
STAMP := $(VENV)/.install-stamp
SOURCES := pyproject.toml plugins/scheduler_fifo/pyproject.toml plugins/scheduler_mixed/pyproject.toml \
	plugins/scheduler_priority/pyproject.toml plugins/attention_flash/pyproject.toml plugins/models_qwen3/pyproject.toml

.PHONY: install run test lint bench-host soak clean

install: $(STAMP)

$(STAMP): $(SOURCES) Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q "$(TORCH_PIN)" -e ".[test]" -e "plugins/scheduler_fifo[test]" \
		-e "plugins/scheduler_mixed[test]" -e "plugins/scheduler_priority[test]" \
		-e "plugins/attention_flash[test]" -e "plugins/models_qwen3[test]"
	touch $(STAMP)

run: install
	$(BIN)/nanovllm generate --demo --max-tokens 32

test: install
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/python -m pip install -q ruff
	$(BIN)/ruff check .

bench-host: install
	$(BIN)/python benchmarks/host_overhead.py

# not in CI: 20,000 requests against the CPU demo server (SOAK_ARGS="--num-requests 2000" for a shorter run)
soak: install
	$(BIN)/python benchmarks/soak.py $(SOAK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info plugins/*/*.egg-info
