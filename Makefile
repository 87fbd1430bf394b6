# featbake: `make demo` and `make test` are the whole set-up; each installs what is missing first.
# TORCH is the torch requirement: users bring their own CUDA build; CI pins the local CPU wheel.
PYTHON ?= python3
TORCH ?= torch
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install emulators demo test soak bench lint clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py featbake/kernels.c
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

demo: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) examples/demo.py

# One pytest worker per core, each test file on one worker (its module fixtures and moto server
# stay with it); TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= auto

# The az:// tests' server, Azurite (Azure's Blob emulator), comes from npm; the gs:// tests'
# fake-gcs-server and the s3:// tests' moto come with the dev extra. CI fails, not skips,
# without them.
emulators:
	@command -v azurite-blob >/dev/null || npm install -g --silent azurite

test: install emulators
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# A bounded 60 s soak (benchmarks/soak.py, not collected by pytest): 2 writers, 2 readers with
# DataLoader workers and a gc loop on one store; then verify clean and every feature = live.
soak: install
	$(PY) benchmarks/soak.py

bench: install
	$(PY) benchmarks/run.py

lint: install
	$(PY) -m ruff check featbake tests benchmarks examples
	$(PY) -m ruff format --check featbake tests benchmarks examples
	$(PY) -m mypy
	$(PY) -m pytest -q -p no:cacheprovider tests/test_architecture.py

clean:
	rm -rf $(VENV) .featbake examples/demo_data examples/demo_encoder.pt examples/*_work benchmarks/_work
