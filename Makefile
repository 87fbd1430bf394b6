# featbake: `make demo` and `make test` are the whole set-up; each installs what is missing first.
# TORCH is the torch requirement: users bring their own CUDA build; CI pins the local CPU wheel.
PYTHON ?= python3
TORCH ?= torch
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install emulators demo test hunt soak bench gpu-wheels lint clean

install: $(STAMP)

# --no-compile: pip would compile every installed module to bytecode (torch, transformers, ray:
# about 90 s of CPU of a 4-minute install here); the interpreter compiles, and keeps, only the
# modules a run imports (about 15 s for the whole suite's imports).
$(STAMP): pyproject.toml setup.py featbake/kernels.c
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile "$(TORCH)"
	$(PY) -m pip install -q --no-compile -e ".[dev]"
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

# Python keeps what it compiles (and pytest its rewritten test modules) in __pycache__, even where
# the environment sets PYTHONDONTWRITEBYTECODE: otherwise every CLI subprocess and rank compiles
# featbake again, and each worker rewrites every test module (7% of a CLI test file's CPU).
# The 20 slowest tests close the run's output: where the suite's time goes, at each CI run.
test: install emulators
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile \
		--durations=20

# Opt-in race hunting, not part of `make test` (slower): the suite with benchmarks/hunt_plugin.py,
# which makes every test process report 16 CPUs (featbake.device.process_cpus, os.cpu_count,
# os.sched_getaffinity: forked decode workers and wide reads on a 2-core machine) and run the
# cyclic collector every 60 allocations (gc.set_threshold(60, 5, 5): finalizers inside locks and
# transactions). HUNT_ARGS narrows it: make hunt HUNT_ARGS="tests/test_process.py".
HUNT_ARGS ?=
hunt: install emulators
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -p benchmarks.hunt_plugin -n auto \
		--dist loadfile $(HUNT_ARGS)

# A bounded 60 s soak (benchmarks/soak.py, not collected by pytest): 2 writers, 2 readers with
# DataLoader workers and a gc loop on one store; then verify clean and every feature = live.
soak: install
	$(PY) benchmarks/soak.py

bench: install
	$(PY) benchmarks/run.py

# The wheels a GPU machine without featbake's dependencies needs for benchmarks/gpu_record.sh
# (issue 44): cp312 manylinux builds, each pinned to the version tested here, in .whl/
# (git-ignored; the record's `run` call carries it). featbake's own: soundfile (needs cffi, which
# needs pycparser), soxr, google-crc32c, zarr (needs numcodecs, donfig); and torchdata, which
# tests/serve/test_loader.py imports. The rest of what they need (numpy, pyyaml, packaging,
# typing-extensions, requests, urllib3, torch) is on that machine. Not ray: its wheel alone
# (79 MB) is over the 64 MiB that travels with the working tree, so part `ray` skips there.
# The check: the tree that travels (tracked and untracked files, and .whl) stays under 48 MiB.
GPU_WHEELS := soundfile==0.14.0 cffi==2.1.1 pycparser==3.12 soxr==1.1.0 google-crc32c==1.9.0 \
	zarr==3.1.6 numcodecs==0.16.6 donfig==0.8.1.post1 torchdata==0.11.0
GPU_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
	manylinux2014_x86_64 manylinux1_x86_64

gpu-wheels:
	rm -rf .whl && mkdir -p .whl
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp $(addprefix --platform ,$(GPU_PLATFORMS)) -d .whl $(GPU_WHEELS)
	@ls .whl
	@{ git ls-files -co --exclude-standard -z; find .whl -type f -print0; } \
		| du --files0-from=- -cb | tail -1 | awk '{ mib = $$1 / 1048576; \
		printf "gpu-wheels: the tree that travels with .whl is %.1f MiB (limit 64)\n", mib; \
		if (mib > 48) { print "gpu-wheels: over 48 MiB: carry less"; exit 1 } }'

lint: install
	$(PY) -m ruff check featbake tests benchmarks examples
	$(PY) -m ruff format --check featbake tests benchmarks examples
	$(PY) -m mypy
	$(PY) -m pytest -q -p no:cacheprovider tests/test_architecture.py

clean:
	rm -rf $(VENV) .featbake examples/demo_data examples/demo_store examples/demo_encoder.pt examples/*_work benchmarks/_work
