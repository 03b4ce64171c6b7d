# Two entry points for a fresh machine: `make run` (demo) and `make test`. Both set themselves up.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch; the package metadata itself accepts any torch>=2.5.
TORCH_PIN ?= torch==2.13.0
# The exact versions CI last passed with: `make install` (and every pip call of the tests, through
# PIP_CONSTRAINT) takes them, so a new release upstream cannot break a fresh clone. `make test-latest` runs the
# suite on the newest releases; `make lock` then records what it ran with.
LOCK := $(abspath constraints.txt)
LATEST := .venv-latest
EDITABLES := -e ".[test]" -e "plugins/scheduler_fifo[test]" -e "plugins/scheduler_mixed[test]" \
	-e "plugins/scheduler_priority[test]" -e "plugins/attention_flash[test]" -e "plugins/models_qwen3[test]" \
	-e "plugins/structured_xgrammar[test]" -e "plugins/structured_llguidance[test]" -e "plugins/quant_fp8[test]" \
	-e "plugins/bench[test]" -e "plugins/testing[test]" \
	-e "plugins/data_parallel[test]" -e "plugins/attention_flashinfer[test]"
STAMP := $(VENV)/.install-stamp
SOURCES := pyproject.toml plugins/scheduler_fifo/pyproject.toml plugins/scheduler_mixed/pyproject.toml \
	plugins/scheduler_priority/pyproject.toml plugins/attention_flash/pyproject.toml plugins/models_qwen3/pyproject.toml \
	plugins/structured_xgrammar/pyproject.toml plugins/structured_llguidance/pyproject.toml plugins/quant_fp8/pyproject.toml \
	plugins/bench/pyproject.toml plugins/testing/pyproject.toml plugins/data_parallel/pyproject.toml \
	plugins/attention_flashinfer/pyproject.toml

.PHONY: install run test test-latest lock lint bench-host soak clean

install: $(STAMP)

$(STAMP): $(SOURCES) constraints.txt Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel
	PIP_CONSTRAINT=$(LOCK) $(BIN)/python -m pip install -q "$(TORCH_PIN)"
	PIP_CONSTRAINT=$(LOCK) $(BIN)/python -m pip install -q "$(TORCH_PIN)" $(EDITABLES)
	touch $(STAMP)

run: install
	$(BIN)/nanovllm generate --demo --max-tokens 32

# The suite in two processes (pytest-xdist), each given whole files, so that a file's module fixtures (an engine, a
# server, a Ray cluster, the built wheels) are made once; in the order the files are collected (xdist would otherwise
# start the files of most tests first, which leaves the few long ones for the end). `make test XDIST=` runs it in one.
XDIST ?= -n 2 --dist loadfile --no-loadscope-reorder

test: install
	PIP_CONSTRAINT=$(LOCK) $(BIN)/python -m pytest -q $(XDIST)

# the suite against the newest releases, in a virtualenv of its own made anew (run it before `make lock`)
test-latest:
	rm -rf $(LATEST)
	$(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q --upgrade pip setuptools wheel
	$(LATEST)/bin/python -m pip install -q "$(TORCH_PIN)"
	$(LATEST)/bin/python -m pip install -q --upgrade "$(TORCH_PIN)" $(EDITABLES)
	$(LATEST)/bin/python -m pytest -q

# constraints.txt from the virtualenv `make test-latest` passed in (torch is TORCH_PIN's; our own are editable)
lock:
	@test -x $(LATEST)/bin/python || { echo "make lock: run make test-latest first (it makes $(LATEST))" >&2; exit 2; }
	{ echo "# The versions \`make test\` installs: written by \`make lock\` from the environment \`make test-latest\`"; \
	  echo "# passed in (Python $$($(LATEST)/bin/python -c 'import platform; print(platform.python_version())'), CPU). Edit by running those two, not by hand."; \
	  $(LATEST)/bin/python -m pip freeze --exclude-editable | grep -v -e '^torch==' -e '^-e ' | LC_ALL=C sort -f; \
	} > constraints.txt

lint: install
	$(BIN)/python -m pip install -q ruff
	$(BIN)/ruff check .

bench-host: install
	$(BIN)/python benchmarks/host_overhead.py

# not in CI: 20,000 requests against the CPU demo server (SOAK_ARGS="--num-requests 2000" for a shorter run)
soak: install
	$(BIN)/python benchmarks/soak.py $(SOAK_ARGS)

clean:
	rm -rf $(VENV) $(LATEST) build *.egg-info plugins/*/*.egg-info
