# Every target installs what it needs itself: `make demo` and `make test` work on a fresh machine.
# TORCH is pinned: an unpinned torch pulls several GB of CUDA packages. Which build the pin gets is pip's choice:
# the CPU wheel where pip's configuration offers one (as on the CI machines), else PyPI's wheel, which on Linux
# is the CUDA build; TORCH_INDEX=https://download.pytorch.org/whl/cpu asks PyTorch's CPU index for it. On a
# CUDA machine: `make TORCH=torch install`.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Stable timings on shared machines (see docs/benchmarks.md).
BENCH_ENV := OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296

.PHONY: install demo demo-rl test test-cuda test-floor lint bench bench-check bench-quick bench-probes bench-headline bench-hostbound bench-phases clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch would pull several GB of CUDA packages.
	$(PY) -m pip install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)")
	# The pin again: pip may otherwise upgrade torch past it while resolving the extras' dependencies (it took
	# torch 2.10.0 to 2.14.1 in `make test-floor`'s venv, which then tested no floor at all).
	$(PY) -m pip install -q -e ".[dev]" "$(TORCH)"
	touch $(STAMP)

demo: install
	$(PY) -m instrument run nca

demo-rl: install
	$(PY) -m instrument run rl_cartpole

test: install
	WANDB_MODE=offline WANDB_SILENT=true $(PY) -m pytest

# The tests marked `cuda` alone (skipped by `make test` without a GPU); on a GPU machine with a CUDA torch:
# `make TORCH=torch test-cuda`. With a CPU build of torch it stops with an error (tests/conftest.py) instead of
# skipping them all: a venv made earlier with a CPU build of torch needs `.venv/bin/pip uninstall -y torch` first.
test-cuda: install
	WANDB_MODE=offline WANDB_SILENT=true $(PY) -m pytest -m cuda -rs

# The suite on the oldest torch instrument supports (instrument/torch_floor.py), in a venv of its own; the
# check between the two steps makes sure that venv's torch is the floor and not a release pip chose instead.
TORCH_FLOOR := 2.10.0
FLOOR_VENV := .venv-torch-floor
test-floor:
	$(MAKE) VENV=$(FLOOR_VENV) TORCH=torch==$(TORCH_FLOOR) install
	$(FLOOR_VENV)/bin/python -c "import sys, torch; v = torch.__version__; \
	sys.exit(None if v.split('+')[0] == '$(TORCH_FLOOR)' else 'make test-floor: expected torch $(TORCH_FLOOR), found ' + v)"
	$(MAKE) VENV=$(FLOOR_VENV) TORCH=torch==$(TORCH_FLOOR) test

lint: install
	$(PY) -m ruff check instrument tests bench

bench: install
	$(BENCH_ENV) $(PY) -m pytest bench -p no:randomly --benchmark-only -q -s

bench-check: install
	$(BENCH_ENV) INSTRUMENT_BENCH_CHECK=1 $(PY) -m pytest bench -p no:randomly --benchmark-only -q -s

# A smoke test of the whole bench (3 repetitions): noisy figures, written to bench/results/quick.{json,md}.
bench-quick: install
	$(BENCH_ENV) INSTRUMENT_BENCH_QUICK=1 $(PY) -m pytest bench -p no:randomly --benchmark-only -q -s

bench-headline: install
	$(BENCH_ENV) $(PY) -W "ignore::DeprecationWarning" -m bench.headline

# The GPU's regime on a CPU: tiny workloads, ops dispatched and host time per variant (docs/benchmarks.md).
bench-hostbound: install
	$(BENCH_ENV) $(PY) -W "ignore::DeprecationWarning" -m bench.hostbound

# Where the NCA's logging step spends the training thread's time, phase by phase (docs/benchmarks.md).
bench-phases: install
	$(BENCH_ENV) $(PY) -W "ignore::DeprecationWarning" -m bench.phases

# Embedded probes: off/on vs a probe-free model, eager/scripted/compiled (docs/probes.md).
bench-probes: install
	$(BENCH_ENV) $(PY) bench/probe_overhead.py --compile

clean:
	rm -rf $(VENV) runs bench/results .benchmarks
